"""The benchmark harness keeps working: a tiny configuration end to end."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.dist
def test_bench_qps_quick(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "bench.qps", "--quick", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
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
    out = subprocess.run(
        [
            sys.executable,
            "-m",
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
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "| torch-1f1b | 1 |" in out.stdout and "| pipedp-1f1b (flat, keep) | 1 |" in out.stdout
