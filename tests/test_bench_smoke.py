"""The benchmark harness keeps working: tiny configurations end to end (seconds each)."""

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args, timeout=300, env=None):
    out = subprocess.run(
        [sys.executable, "-m", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=None if env is None else dict(os.environ, **env),
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out


@pytest.mark.dist
def test_bench_qps_quick(tmp_path):
    out = _run("bench.qps", "--quick", "--out", str(tmp_path))
    assert "| pipedp-1f1b-ghost | 2 |" in out.stdout
    result = json.loads((tmp_path / "qps-tiny-p2.json").read_text())
    names = {r["name"] for r in result["rows"]}
    assert {
        "plain",
        "opacus-hooks",
        "opacus-ghost",
        "naive-split",
        "torch-gpipe",
        "torch-1f1b",
        "pipedp-1f1b-ghost",
        "pipedp-gpipe-materialize",
    } <= names
    assert all(r["qps"] > 0 for r in result["rows"])
    assert (tmp_path / "qps-tiny-p2.png").exists()


@pytest.mark.dist
def test_bench_cpu_time_quick():
    out = _run(
        "bench.cpu_time",
        "--preset",
        "tiny",
        "--microbatches",
        "2",
        "--warmup",
        "1",
        "--reps",
        "1",
        "--grad-mode",
        "keep",
    )
    assert "| torch-1f1b | 1 |" in out.stdout and "| pipedp-1f1b (flat, keep) | 1 |" in out.stdout


@pytest.mark.dist
def test_run_all_quick_writes_a_dated_section_newest_first(tmp_path):
    results = tmp_path / "RESULTS.md"
    results.write_text("# Benchmark results\n\nintro\n\n## 2000-01-01 00:00 — harness\n\nold section\n")
    _run(
        "bench.run_all",
        "--quick",
        "--tree",
        "work",
        "--only",
        "dp-cost,self-check",
        "--results",
        str(results),
        "--figures",
        str(tmp_path),
        timeout=400,
    )
    text = results.read_text()
    assert text.index("quick: smoke-test sizes") < text.index("old section")  # newest first
    for figure in ("| dp-cost/tiny |", "| naive/tiny |", "| self-check/tiny |", "| self-check-steady/tiny |"):
        assert figure in text
    assert "commit `" in text and "python -m bench.questions dp-cost --preset tiny" in text
    assert "**Where the time goes**" in text  # the overhead profile
    data = json.loads((tmp_path / "quick.json").read_text())
    assert all(f["median"] > 0 for r in data["results"] for f in r["figures"])
    assert (tmp_path / "quick.png").exists()


def test_gpu_check_skips_without_cuda():
    out = _run("bench.gpu_check", env={"CUDA_VISIBLE_DEVICES": ""})
    assert "skipped" in out.stdout and "| check |" not in out.stdout


def test_gpu_check_code_path_on_the_cpu():
    out = _run("bench.gpu_check", "--device", "cpu", "--quick", timeout=400, env={"CUDA_VISIBLE_DEVICES": ""})
    assert "| FAIL |" not in out.stdout
    assert out.stdout.count("| pass |") >= 10  # float64 and bf16 parity, two devices in one process
    assert "| parity gpt: 2 processes over gloo, ghost, 1f1b, m=3 | cpu | float64 | pass |" in out.stdout
    assert "| stalled rank over gloo: named error within the timeout | cpu | float32 | pass |" in out.stdout
    assert "| peak memory: pipedp 1 stage vs planner | cpu | float32 | info |" in out.stdout
    for contender in ("plain", "opacus-ghost", "pipedp-1stage-ghost", "pipedp-1stage-keep"):  # the harness ran
        assert f"| harness tiny: {contender} | cpu | float32 | info |" in out.stdout


@pytest.mark.dist
def test_scale_writes_a_sharded_folder_and_fine_tunes_it_stage_by_stage(tmp_path):
    folder = tmp_path / "tiny"
    out = _run("bench.scale", "write", "tiny-llama", str(folder), "--layers", "2", "--shard-mib", "1")
    info = json.loads(out.stdout)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert info["shards"] >= 1 and set(index["weight_map"].values()) <= set(os.listdir(folder))
    assert json.loads((folder / "config.json").read_text())["num_hidden_layers"] == 2
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(str(folder))("the farmer")["input_ids"]
    out = _run("bench.scale", "run", str(folder), "--mode", "lora", "--stages", "2", "--steps", "2", timeout=400)
    assert "| tiny, 2 layers |" in out.stdout and "first step" in out.stdout


@pytest.mark.dist
def test_scale_suite_plans_each_run_then_runs_it_and_deletes_the_folder(tmp_path):
    out = _run(
        "bench.scale",
        "suite",
        "--configs",
        "tiny-llama",
        "--modes",
        "lora",
        "--steps",
        "1",
        "--no-record",
        "--tree",
        "work",
        "--root",
        str(tmp_path),
        timeout=400,
    )
    assert re.search(r"tiny-llama \(2 layers\) lora, 2 stages, self_check=True \(needs ~\d+ GiB", out.stdout)
    assert "| tiny-llama, 2 layers | 0.0 GiB | lora | 2 | on |" in out.stdout
    assert os.listdir(tmp_path) == []  # the folder written for the suite is gone


@pytest.mark.dist
def test_bench_memory_sweep_quick(tmp_path):
    out = _run("bench.memory_sweep", "--microbatches", "2,4", "--microbatch-size", "1", "--out", str(tmp_path))
    for contender in ("torch-1f1b", "pipedp-1f1b", "pipedp-dp-zb", "pipedp-1f1b-keep"):
        assert re.search(rf"\| {contender} \| \d+ / \d+ \| \d+ / \d+ \| [\d.]+ \|", out.stdout), contender


def test_the_flop_bound_of_a_hugging_face_preset():
    """bench.questions dp-cost prints each figure's FLOP ratio: its plain step calls the whole Hugging Face model
    (a ModelOutput, not logits); it crashed after the rounds on the Mixtral slice."""
    from bench.overhead import flop_bound

    got = flop_bound("tiny-mixtral", "ghost")
    assert 0 < got["plain_flops"] < got["dp_flops"] and 0 < got["bound"] < 1
    # the experts' grouped products counted: the banks' forward and backward alone (2 x 3 products of k pairs per
    # token through d x 3 ffn weights) outweigh everything else plain multiplies at this size
    from bench.presets import PRESETS

    cfg = PRESETS["tiny-mixtral"].build().config
    x, _ = PRESETS["tiny-mixtral"].make_batch(PRESETS["tiny-mixtral"].batch, 0)
    banks = 6 * x.numel() * cfg.num_experts_per_tok * 3 * cfg.hidden_size * cfg.intermediate_size
    assert got["plain_flops"] > banks * cfg.num_hidden_layers


def test_gram_rate_times_each_product():
    from bench.gram_rate import rates

    row = rates(2, 4, 8)
    assert set(row) == {"width", "gram", "gram from [width, T]", "the same with its copy", "weight product"}
    assert row["width"] == 8 and all(v > 0 for k, v in row.items() if k != "width")


def test_rule_shares_finds_each_piece_inside_a_dp_step():
    from bench.rule_shares import measure

    got = measure("tiny", reps=1)
    pieces = {"LayerNorm rule in I", "its layer_norm recompute", "Linear sum(1) in I", "Linear sum(1) in W"}
    assert pieces <= set(got["shares"]) and all(0 < got["shares"][k] < 1 for k in pieces)
