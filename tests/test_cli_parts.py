"""The pieces of ``pipedp train`` in one process: light parsing, config files, weight decay, the schedule."""

import argparse
import json
import os
import re
import subprocess
import sys
import types

import pytest
import torch

from pipedp.cli.configfile import dumps
from pipedp.cli.flags import add_config_flags, flag_name
from pipedp.cli.main import parse
from pipedp.cli.options import JobConfig, OnResume, OptimizerConfig, on_resume
from pipedp.cli.record import CONFIG_JSON, IGNORED, RunFolder, job_fields, sections
from pipedp.config import PipelineConfig, PrivacyConfig
from pipedp.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _modules_after(argv):
    """The heavy modules loaded by ``pipedp <argv>`` in a fresh interpreter, and its exit code."""
    code = (
        "import sys\n"
        "from pipedp.cli.main import main\n"
        "try:\n"
        f"    code = main({argv!r})\n"
        "except SystemExit as exc:\n"
        "    code = exc.code\n"
        "print(sorted(m for m in ('torch', 'transformers', 'opacus', 'numpy') if m in sys.modules), code)\n"
    )
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    return out.stdout.strip().splitlines()[-1], out.stderr


@pytest.mark.parametrize(
    "argv, code, message",
    [
        (["train", "--help"], 0, ""),
        (["train", "--stages", "x"], 2, "argument --stages: invalid int value"),
        (["train", "--stages", "0"], 2, "--stages: must be >= 1, got 0"),
        (["train", "--eval-fraction", "2"], 2, "--eval-fraction: must be in (0, 1)"),
        (["train", "--model", "/no/such/folder"], 2, "is neither 'tiny-gpt' nor a local folder"),
    ],
)
def test_help_and_flag_errors_load_no_torch(argv, code, message):
    last, stderr = _modules_after(argv)
    assert last == f"[] {code}", stderr[-2000:]
    assert message in stderr


def test_a_config_file_round_trips_and_flags_override_it(tmp_path):
    argv = [
        "train",
        "--stages",
        "3",
        "--seq-len",
        "20",
        "--lr-schedule",
        "cosine",
        "--warmup-steps",
        "5",
        "--epochs",
        "2",
    ]
    argv += ["--no-progress", "--lora-targets", "c_attn", "--checkpoint-key", "secret", "--no-self-check"]
    args = parse(argv)
    flags = {k: v for k, v in vars(args).items() if k != "command"}
    path = tmp_path / "job.toml"
    path.write_text(dumps(sections(flags)))
    assert "secret" not in path.read_text()  # the checkpoint key is never written
    again = parse(["train", "--config", str(path)])
    for key, value in vars(args).items():
        if key not in ("config", "checkpoint_key", "given"):  # (given: which flags were typed, a record of the parse)
            assert getattr(again, key) == value, key
    over = parse(
        ["train", "--config", str(path), "--steps", "7", "--seq-len", "64"]
    )  # --steps excludes the file's epochs
    assert (over.steps, over.epochs, over.seq_len, over.stages) == (7, None, 64, 3)
    path.write_text(
        '[data]\nseq_len = 16\n[anything]\nstages = 4\n"batch-size" = 8\nlora-targets = ["q_proj", "v_proj"]\n'
    )
    mixed = parse(["train", "--config", str(path)])
    assert (mixed.seq_len, mixed.stages, mixed.batch_size, mixed.lora_targets) == (16, 4, 8, "q_proj,v_proj")


@pytest.mark.parametrize(
    "content, message",
    [
        ("stagez = 2\n", "unknown key 'stagez'"),
        ('stages = "two"\n', "argument --stages: invalid int value: 'two'"),
        ("resume = 1\n", "'resume' is a switch: give true or false"),
        ("seq_len = 8\nseq-len = 9\n", "'seq-len' is given twice"),
        ("steps = [\n", "is not valid TOML"),
    ],
)
def test_bad_config_files_give_one_clear_line(tmp_path, capsys, content, message):
    path = tmp_path / "job.toml"
    path.write_text(content)
    with pytest.raises(SystemExit) as exc:
        parse(["train", "--config", str(path)])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_weight_decay_skips_biases_norms_and_embeddings_unless_asked():
    from pipedp.cli.build import no_decay_parameters, optimizer_factory
    from pipedp.models import GPTConfig, tiny_gpt

    model = tiny_gpt(GPTConfig(vocab_size=16, seq_len=8, d_model=8, n_heads=2, n_layers=1))
    params = list(model.parameters())
    optim = OptimizerConfig(weight_decay=0.1).validate()
    opt = optimizer_factory(optim, no_decay_parameters(model, optim.no_decay_kinds()), params)(params)
    assert isinstance(opt, torch.optim.AdamW)
    decayed, free = opt.param_groups
    names = {id(p): n for n, p in model.named_parameters()}
    assert decayed["weight_decay"] == 0.1 and free["weight_decay"] == 0.0
    assert sorted(names[id(p)] for p in decayed["params"]) == [
        "1.attn.proj.weight",
        "1.attn.qkv.weight",
        "1.fc.weight",
        "1.out.weight",
        "2.head.weight",
    ]
    assert len(free["params"]) == len(params) - 5  # biases, LayerNorms, the two embeddings
    every = OptimizerConfig(weight_decay=0.1, no_decay="", optimizer="sgd", momentum=0.9).validate()
    sgd = optimizer_factory(every, no_decay_parameters(model, every.no_decay_kinds()), params)(params)
    assert len(sgd.param_groups) == 1 and sgd.param_groups[0]["momentum"] == 0.9


def test_the_schedule_runs_step_by_step_and_a_resume_takes_the_new_options():
    from pipedp.cli.build import optimizer_factory, resume_optimizers, scheduler_factory

    optim = OptimizerConfig(lr=0.1, lr_schedule="linear", warmup_steps=2, weight_decay=0.01).validate()
    weight = torch.nn.Parameter(torch.zeros(3))
    opt = optimizer_factory(optim, set(), [weight])([weight])
    sched = scheduler_factory(optim, 10)(opt)
    used = []
    for _ in range(5):  # as the trainer does: optimizer step, then scheduler step
        used.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert used == pytest.approx([0.1 * optim.lr_factor(s, 10) for s in range(5)])
    state = {"opt": opt.state_dict(), "sched": sched.state_dict()}
    # a fresh build loads the checkpoint, then --lr 0.2 and --weight-decay 0 apply from step 5 on
    new = OptimizerConfig(lr=0.2, lr_schedule="linear", warmup_steps=2).validate()
    opt2 = optimizer_factory(new, set(), [weight])([weight])
    sched2 = scheduler_factory(new, 10)(opt2)
    opt2.load_state_dict(state["opt"])
    sched2.load_state_dict(state["sched"])
    trainer = types.SimpleNamespace(state=types.SimpleNamespace(optimizers=[opt2], schedulers=[sched2]))
    lines = resume_optimizers(trainer, new, 10, 5)
    assert "optimizer: --lr 0.2 replaces the checkpoint's 0.1" in lines
    assert "optimizer: --weight-decay 0.0 replaces the checkpoint's 0.01" in lines
    assert opt2.param_groups[0]["lr"] == pytest.approx(0.2 * new.lr_factor(5, 10))
    opt2.step()
    sched2.step()
    assert opt2.param_groups[0]["lr"] == pytest.approx(0.2 * new.lr_factor(6, 10))


def _changed(f, value):
    """Another valid-looking value of a flag's field (what a user might pass on --resume)."""
    if f.metadata["choices"]:
        return next(c for c in f.metadata["choices"] if c != value)
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    return "another"  # a path, a list, or None: any other string


def test_resume_reads_each_flags_rule_from_its_field_and_an_old_record_misses_newer_flags(tmp_path):
    """Every flag of pipedp train says on its field what changing it does to a resumed run (cli/options.py): each
    refused one must be refused, each other one listed, or not even compared; a flag the record predates ran as
    its default."""
    args = parse(["train"])
    was = {k: v for k, v in vars(args).items() if k not in IGNORED}
    for newer in ("save_strategy", "disable_dp", "export_merged"):  # as a record written before these flags
        was.pop(newer)
    (tmp_path / CONFIG_JSON).write_text(json.dumps({"flags": was, "resolved": {}}))
    folder = RunFolder(str(tmp_path))
    job = types.SimpleNamespace(pipeline=PipelineConfig(), privacy=PrivacyConfig(max_grad_norm=1.0), train_rows=None)
    assert folder.compare(args, job) == []  # unchanged, missing keys included
    rules = set()
    for f in job_fields():
        rule = on_resume(f)
        rules.add(rule)
        now = types.SimpleNamespace(**{**vars(args), f.name: _changed(f, getattr(args, f.name))})
        if rule.refused:
            with pytest.raises(ConfigError, match=re.escape(rule.reason)):
                folder.compare(now, job)
        else:
            notes = folder.compare(now, job)
            if f.name in IGNORED:
                assert notes == [], f.name
            else:
                old, new = getattr(args, f.name), getattr(now, f.name)
                shown = "(default)" if old is None else repr(old)
                assert notes == [f"{flag_name(f.name)}: {shown} -> {new!r} ({rule.reason})"], f.name
    assert rules == set(OnResume)  # every rule is exercised
    # a record every run writes with --model: without it the record is damaged, and resuming is refused (not read
    # as the default model)
    damaged = {k: v for k, v in was.items() if k != "model"}
    (tmp_path / CONFIG_JSON).write_text(json.dumps({"flags": damaged, "resolved": {}}))
    with pytest.raises(ConfigError, match=r"--model: \(default\) -> 'tiny-gpt' \(the resumed run must train the same"):
        folder.compare(args, job)


def test_a_field_naming_a_help_group_the_parser_lacks_is_an_error():
    """A flag must not land silently outside its --help group (the fallback to the parser hid a typo)."""
    parser = argparse.ArgumentParser()
    with pytest.raises(KeyError, match=r"--\S+: its field names the help group '\w+', which this parser lacks"):
        add_config_flags(parser, (JobConfig,), groups={"no such group": parser.add_argument_group("x")})
