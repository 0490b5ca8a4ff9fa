"""The names a Hugging Face / dp-transformers user types: aliases that mean pipedp's flag, refusals that say the
difference, "did you mean", the subcommand's help, --help's groups, and docs/cli.md's table. Parsing only: no run."""

import os
import re

import pytest

from pipedp.cli.main import build_parser, parse, train_parser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (Hugging Face / dp-transformers argument, pipedp's flag, a value): written out here, not read from the parser's
# alias table, so an alias dropped from the parser fails
SAME_MEANING = [
    ("--learning-rate", "--lr", "0.01"),
    ("--max-steps", "--steps", "7"),
    ("--num-train-epochs", "--epochs", "2.5"),
    ("--output-dir", "--checkpoint-dir", "runs/x"),
    ("--save-steps", "--checkpoint-every", "9"),
    ("--save-total-limit", "--keep-last", "2"),
    ("--eval-steps", "--eval-every", "5"),
    ("--target-delta", "--delta", "1e-6"),
    ("--per-sample-max-grad-norm", "--max-grad-norm", "0.25"),
    ("--lr-scheduler-type", "--lr-schedule", "cosine"),
    ("--logging-steps", "--epsilon-every", "4"),
    ("--per-device-eval-batch-size", "--eval-batch-size", "3"),
    ("--max-seq-length", "--seq-len", "64"),
    ("--model-name-or-path", "--model", "some/folder"),
    ("--train-file", "--data", "a.jsonl"),
    ("--validation-file", "--eval-data", "b.jsonl"),
    ("--gradient-checkpointing", "--activation-checkpointing", None),
    ("--disable-tqdm", "--no-progress", None),
    ("--overwrite-output-dir", "--overwrite", None),
]


def parsed(*argv):
    return vars(build_parser().parse_args(["train", *argv]))


def refused(capsys, *argv):
    with pytest.raises(SystemExit) as stop:
        parse(list(argv))
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("pipedp: error:"), err
    return err


@pytest.mark.parametrize("theirs, ours, value", SAME_MEANING)
def test_a_hugging_face_name_sets_what_pipedps_flag_sets(theirs, ours, value):
    given = [value] if value is not None else []
    default = parsed()
    mine = parsed(ours, *given)
    assert mine != default  # the value is not the default: the comparison below means something
    assert parsed(theirs, *given) == mine
    underscored = "--" + theirs[2:].replace("-", "_")
    if value is None:
        assert parsed(underscored) == mine
    else:
        assert parsed(f"{underscored}={value}") == mine


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--gradient_accumulation_steps", "4"], "--batch-size is the whole logical batch"),
        (["--per-device-train-batch-size", "8"], "--microbatch-size caps the rows"),
        (["--bf16"], "--precision bf16-mixed"),
        (["--fp16"], "no float16 mode"),
        (["--resume-from-checkpoint", "runs/x"], "give --checkpoint-dir DIR --resume"),
        (["--optim", "adamw_torch"], "--optimizer here"),
        (["--block-size", "128"], "never packs records"),
        (["--disable-tqdm", "True"], "switches take no value"),
    ],
)
def test_a_name_that_means_something_else_is_refused_with_the_difference(capsys, argv, says):
    err = refused(capsys, "train", *argv)
    assert says in err and "(see 'pipedp train --help')" in err


def test_an_unknown_flag_gets_a_did_you_mean_from_its_own_subcommand(capsys):
    err = refused(capsys, "train", "--learnig-rate", "0.1")
    assert "unrecognized arguments: --learnig-rate 0.1" in err and "did you mean --learning-rate" in err
    assert err.endswith("(see 'pipedp train --help')")
    err = refused(capsys, "train", "--zzzz")
    assert "did you mean" not in err and "--zzzz" in err
    err = refused(capsys, "schedule", "show", "1f1b", "--stages", "2", "--microbatches", "2", "--cost", "F=1")
    assert "did you mean --costs" in err and err.endswith("(see 'pipedp schedule show --help')")
    err = refused(capsys, "audit", "--canary", "3")
    assert "did you mean --canaries" in err and err.endswith("(see 'pipedp audit --help')")


def test_a_config_file_takes_the_names_too_and_suggests_for_an_unknown_key(tmp_path, capsys):
    job = tmp_path / "job.toml"
    job.write_text("[training]\nlearning_rate = 0.02\nnum_train_epochs = 2\n")
    args = parse(["train", "--config", str(job)])
    assert args.lr == 0.02 and args.epochs == 2.0
    args = parse(["train", "--config", str(job), "--max_steps", "5"])  # the command line's length wins
    assert args.steps == 5 and args.epochs is None
    job.write_text("learning_rate = 0.02\nlr = 0.03\n")
    assert "'learning-rate' and 'lr' name one flag" in refused(capsys, "train", "--config", str(job))
    job.write_text("learnin-rate = 0.02\n")
    err = refused(capsys, "train", "--config", str(job))
    assert "unknown key 'learnin-rate': did you mean learning-rate" in err and "pipedp train --help" in err


def test_help_is_grouped_model_data_privacy_optimization_pipeline_run():
    help_text = train_parser(build_parser()).format_help()
    titles = re.findall(r"^(\w+) options:$", help_text, flags=re.M)
    assert titles == ["model", "data", "privacy", "optimization", "pipeline", "run"]
    sections = dict(zip(titles, re.split(r"^\w+ options:$", help_text, flags=re.M)[1:]))
    where = {
        "model": ["--model", "--lora-r", "--export"],
        "data": ["--data", "--seq-len", "--eval-fraction"],
        "privacy": ["--noise-multiplier", "--max-grad-norm", "--delta", "--max-logical-batch"],
        "optimization": ["--lr", "--steps", "--epochs", "--batch-size", "--warmup-ratio"],
        "pipeline": ["--stages", "--microbatches", "--inprocess"],
        "run": ["--checkpoint-dir", "--resume", "--config", "--report-to"],
    }
    for title, flags in where.items():
        for flag in flags:
            assert re.search(rf"^  {re.escape(flag)}[ ,\n]", sections[title], flags=re.M), (flag, title)


def test_docs_table_names_every_alias_and_only_real_flags():
    text = open(os.path.join(ROOT, "docs", "cli.md"), encoding="utf-8").read()
    table = text[text.index("## Coming from Hugging Face") :].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| `--")]
    theirs = {name.replace("_", "-") for row in rows for name in re.findall(r"`(--[a-z_0-9]+)", row.split("|")[1])}
    ours = {name for row in rows for name in re.findall(r"`(--[a-z-0-9]+)", row.split("|")[3])}
    train = train_parser(build_parser())
    aliases = {s for a in train._actions for s in a.option_strings[1:] if s.startswith("--") and s != "--help"}
    assert aliases <= theirs, sorted(aliases - theirs)  # every alias the parser takes is in the table
    assert ours <= set(train._option_string_actions), sorted(ours - set(train._option_string_actions))
