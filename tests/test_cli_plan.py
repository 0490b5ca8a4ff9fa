"""``pipedp plan``: the flags (no torch to parse them), the printed plan, the static bytes of a
Llama-2-7B-shaped model built on meta, and the pieces (the tracker, the composition over a schedule, the
search). The prediction against measured memory: tests/numerics/test_plan.py."""

import json
import os
import subprocess
import sys

import pytest
import torch

from pipedp.cli.main import build_parser, main
from pipedp.cli.plan import parse_bytes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytest.importorskip("transformers")


def _folder(tmp_path, **shape):
    """A config.json only: the planner reads no weights."""
    from transformers import LlamaConfig

    values = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        architectures=["LlamaForCausalLM"],
    )
    values.update(shape)
    LlamaConfig(**values).save_pretrained(tmp_path)
    return str(tmp_path)


def _llama_7b(tmp_path):
    return _folder(
        tmp_path,
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        torch_dtype="float16",
    )


# ---- the flags ---------------------------------------------------------------------------------------
def test_parsing_the_plan_flags_loads_no_torch():
    code = (
        "import sys; from pipedp.cli.main import build_parser; a = build_parser().parse_args(['plan', '--model', "
        "'m', '--microbatch-size', '2', '--seq-len', '8', '--device-memory', '80GB', '--lora-r', '8']); "
        "print(a.device_memory, a.stages, a.schedule, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.stdout.split() == ["80000000000", "2", "1f1b", "False"], out.stderr


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--microbatch-size", "2", "--seq-len", "8"], "--model"),
        (["--model", "m", "--seq-len", "8"], "--microbatch-size"),
        (["--model", "m", "--microbatch-size", "0", "--seq-len", "8"], "must be >= 1"),
        (["--model", "m", "--microbatch-size", "2", "--seq-len", "8", "--device-memory", "lots"], "memory size"),
        (["--model", "m", "--microbatch-size", "2", "--seq-len", "8", "--precision", "fp8"], "invalid choice"),
    ],
)
def test_a_bad_flag_is_one_line_naming_it(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["plan", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_memory_sizes():
    assert parse_bytes("80GB") == parse_bytes("80G") == 80 * 10**9
    assert parse_bytes("80GiB") == parse_bytes("80gib") == 80 * 2**30
    assert parse_bytes("1.5TB") == 1.5e12 and parse_bytes("24000000000") == 24 * 10**9
    assert parse_bytes("512 MiB") == 512 * 2**20


def test_a_missing_folder_is_one_error_line(tmp_path, capsys):
    rc = main(["plan", "--model", str(tmp_path / "nowhere"), "--microbatch-size", "1", "--seq-len", "8"])
    assert rc == 2 and "does not exist" in capsys.readouterr().err


# ---- the printed plan ------------------------------------------------------------------------------------
def test_plan_prints_every_stage_and_the_largest_fitting_size(tmp_path, capsys):
    from pipedp import PipelineConfig
    from pipedp.planner import estimate

    folder = _folder(tmp_path / "model")
    out_json = str(tmp_path / "plan.json")
    argv = ["plan", "--model", folder, "--stages", "2", "--microbatch-size", "2", "--seq-len", "16"]
    assert main([*argv, "--no-self-check", "--device-memory", "48MiB", "--json", out_json]) == 0
    text = capsys.readouterr().out
    for word in ("stage", "weights", "optimizer", "activations", "peak", "embeddings", "head", "later steps"):
        assert word in text, text
    assert "largest micro-batch size that fits 48 MiB on every stage" in text, text
    plan = json.load(open(out_json))
    stages, fit = plan["stages"], plan["largest_fit"]
    assert len(stages) == 2 and fit > 2
    params = sum(s["static"]["params"] for s in stages)
    assert params == sum(p.numel() for p in _meta(folder).parameters())
    for s in stages:  # AdamW: two float32 tensors per trainable parameter; one float32 clipped sum
        assert s["static"]["optimizer"] == 2 * s["static"]["trainable_bytes"] == 8 * s["static"]["trainable"]
        assert s["static"]["grads"] == 4 * s["static"]["trainable"]
        assert s["total"] >= s["weights"] + s["static"]["optimizer"] + s["pass_peak"]
    # the size found fits, and the next one does not (both simulated afresh)
    pipeline = PipelineConfig(self_check=False)
    assert max(s.total for s in estimate(folder, 2, fit, 16, pipeline=pipeline).stages) <= 48 * 2**20
    assert max(s.total for s in estimate(folder, 2, fit + 1, 16, pipeline=pipeline).stages) > 48 * 2**20
    none = estimate(folder, 2, 2, 16, pipeline=pipeline, device_memory=2**17)  # the weights alone take more
    assert none.largest_fit == 0 and "no micro-batch size fits" in none.fit_note


def test_the_first_step_s_self_check_holds_about_one_row_s_gradient_not_a_few(tmp_path):
    from pipedp.planner import estimate

    stages = estimate(_folder(tmp_path), 2, 4, 16).stages
    extra = [s.first_pass_peak - s.pass_peak for s in stages if s.first_pass_peak is not None]
    assert len(extra) == len(stages) and max(extra) > 0  # the simulation does run the check
    for s, more in zip(stages, extra):  # one row's reference gradient and one layer's (it once held ~8x)
        assert more < 2 * s.static.grads


def test_lora_trains_the_adapters_only_and_splits_where_the_base_model_splits(tmp_path):
    from pipedp import PipelineConfig
    from pipedp.planner import estimate

    folder, pipeline = _folder(tmp_path), PipelineConfig(self_check=False)
    full, lora = estimate(folder, 2, 2, 16, pipeline=pipeline), estimate(folder, 2, 2, 16, lora_r=4, pipeline=pipeline)
    assert [s.blocks for s in lora.stages] == [s.blocks for s in full.stages]
    r, width, layers = 4, 32, 4
    assert sum(s.static.trainable for s in lora.stages) == layers * 2 * r * (width + width)  # q and v: A and B
    assert all(s.total < f.total for s, f in zip(lora.stages, full.stages))


def test_more_micro_batches_in_flight_hold_more_and_checkpointing_less(tmp_path):
    from pipedp import PipelineConfig
    from pipedp.planner import estimate

    folder = _folder(tmp_path)

    def peak(**options):
        pipeline = PipelineConfig(microbatches=8, self_check=False, **options)
        return estimate(folder, 2, 4, 32, pipeline=pipeline).stages[0].pass_peak

    assert peak(schedule="gpipe") > peak(schedule="1f1b")  # 8 micro-batches in flight against 2
    assert peak(activation_checkpointing=True) < peak()


# ---- a Llama-2-7B-shaped model on meta -------------------------------------------------------------------
def test_a_7b_model_is_planned_from_its_config_alone(tmp_path):
    """The static parts of a Llama-2-7B config (float16) on 4 stages: no weights read, nothing simulated."""
    from pipedp import PipelineConfig, PrivacyConfig
    from pipedp.planner import Setup

    folder = _llama_7b(tmp_path)
    pipeline = PipelineConfig(stages=4)
    setup = Setup(folder, pipeline, PrivacyConfig(), 4096, 8, ("q_proj", "v_proj"), 0, "adamw", 0.0)
    static = setup.static
    params = sum(s.params for s in static)
    assert 6.7e9 < params < 6.8e9
    assert sum(s.frozen_bytes for s in static) == 2 * (params - sum(s.trainable for s in static))  # float16
    assert sum(s.trainable for s in static) == 32 * 2 * 8 * (4096 + 4096)  # LoRA r=8 on q, v: 4.19 M
    assert all(s.frozen_bytes < 0.3 * 2 * params for s in static)  # each stage holds only its share
    full = Setup(folder, replace_stages(pipeline, 2), PrivacyConfig(), 4096, None, (), 0, "adamw", 0.0).static
    for s in full:  # full fine-tuning of float16 weights: float32 clipped sums, float16 Adam state (as torch's)
        assert s.grads == 4 * s.trainable and s.optimizer == 2 * 2 * s.trainable


def test_a_sharded_optimizer_is_planned_as_the_replica_that_owns_the_most(tmp_path):
    """Full fine-tuning of the 7B config on 2 stages x 4 replicas: each replica's Adam state is its owned share (at
    most one tensor over a quarter), the clipped sums are every parameter's still."""
    from pipedp import PipelineConfig, PrivacyConfig
    from pipedp.planner import Setup

    folder = _llama_7b(tmp_path)

    def static(**options):
        pipeline = PipelineConfig(stages=2, replicas=4, **options)
        return Setup(folder, pipeline, PrivacyConfig(), 4096, None, (), 0, "adamw", 0.0).static

    for whole, shard in zip(static(), static(shard_optimizer=True)):
        largest = 2 * 2 * 32000 * 4096  # the embedding's (or head's) float16 moments
        assert whole.optimizer / 4 <= shard.optimizer <= whole.optimizer / 4 + largest
        assert shard.grads == whole.grads and shard.trainable == whole.trainable
        assert shard.stepped_grads < whole.stepped_grads / 2


def _meta(folder):
    from pipedp.split.hf_loading import build_on_meta

    return build_on_meta(folder)


def replace_stages(pipeline, stages):
    from dataclasses import replace

    return replace(pipeline, stages=stages)


# ---- the pieces ------------------------------------------------------------------------------------------
def test_the_tracker_counts_each_storage_once_until_torch_frees_it():
    from pipedp.planner.tracker import MemoryTracker

    existing = torch.ones(1000)
    with MemoryTracker(1, answer_reads=False) as tracker:
        a = torch.zeros(256, 1024)  # 1 MiB
        view = a[:10]
        a.add_(existing[:1].sum())  # in place: nothing new but the scalar sum, freed at once
        b = a * 2
        assert tracker.current[0] == 2 * 2**20
        del a, b
        assert tracker.current[0] == 2**20  # the view keeps a's storage
        del view
    assert tracker.current[0] == 0 and tracker.peak[0] == 2 * 2**20


def test_compose_follows_a_stage_s_actions():
    import schedules
    from pipedp.planner.report import Profile, compose

    def profile(w_delta):
        return Profile({"F": (10, 12), "I": (-4, 1), "W": (w_delta, 1), "SEND_F": (0, 0), "RECV_B": (0, 0)})

    first, rest = profile(-6 + 5), profile(-6)  # the first W leaves 5 (the clipped sums) for good
    actions = schedules.build("gpipe", 2, 3).for_stage(0)
    peak, phase = compose(actions, first, rest)
    assert (peak, phase) == (32, "F")  # the third forward: 2 x 10 held + its 12
    one_f_one_b = schedules.build("1f1b", 2, 3).for_stage(0)
    assert compose(one_f_one_b, first, rest) == (27, "F")  # F2 after W0: mb 1's 10, the sums' 5, F2's 12


def test_largest_fit_searches_a_monotone_rule():
    from pipedp.planner import largest_fit

    assert largest_fit(lambda b: 100 + 7 * b <= 1000) == 128
    assert largest_fit(lambda b: b <= 1) == 1
    assert largest_fit(lambda b: False) == 0
