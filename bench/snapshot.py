"""Measure a commit, not a moving working tree: the benchmark commands re-run themselves in a snapshot.

The working tree is shared with engineers who change pipedp/ while a 30-minute regeneration runs (a
process spawned later would import newer code than an earlier one). By default ``bench.run_all`` and
``bench.scale suite`` therefore copy ``git archive HEAD`` (pipedp/, schedules/) and the working tree's
bench/ into a temporary folder, run there (PYTHONPATH first, so every spawned rank imports the same
code), write their results back into this checkout's bench/, and delete the copy. ``--tree work``
measures the working tree as it is instead (the section then says how many files were uncommitted).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from typing import List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV_COMMIT = "PIPEDP_BENCH_COMMIT"  # set inside a snapshot: the commit it holds


def inside() -> bool:
    return ENV_COMMIT in os.environ


def commit() -> str:
    """The measured commit: the snapshot's, else HEAD's."""
    if inside():
        return os.environ[ENV_COMMIT]
    return _git("rev-parse", "--short", "HEAD")


def uncommitted() -> str:
    """'' inside a snapshot (it holds HEAD exactly), else how many files of the measured code differ from HEAD."""
    if inside():
        return ""
    dirty = _git("status", "--porcelain", "--", "pipedp", "schedules")
    return f"{len(dirty.splitlines())} files of pipedp/ and schedules/ uncommitted" if dirty else ""


def _git(*args: str) -> str:
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return "?"
    return out.stdout.strip() or "?"


def rerun_in_snapshot(module: str, argv: List[str]) -> int:
    """Run ``python -m module argv`` in a copy of HEAD's pipedp/ and schedules/ with this tree's bench/."""
    head = _git("rev-parse", "--short", "HEAD")
    folder = tempfile.mkdtemp(prefix=f"pipedp-bench-{head}-")
    try:
        archive = subprocess.run(
            ["git", "archive", "HEAD", "pipedp", "schedules", "pyproject.toml"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        )
        subprocess.run(["tar", "-x", "-C", folder], input=archive.stdout, check=True)
        shutil.copytree(
            os.path.join(ROOT, "bench"),
            os.path.join(folder, "bench"),
            ignore=shutil.ignore_patterns("figures", "results", "RESULTS.md", "__pycache__"),
        )
        env = dict(os.environ, PYTHONPATH=folder + os.pathsep + os.environ.get("PYTHONPATH", ""))
        env[ENV_COMMIT] = head
        print(f"measuring commit {head} (HEAD) in {folder}; results go to {os.path.join(ROOT, 'bench')}", flush=True)
        return subprocess.run([sys.executable, "-m", module, *argv], cwd=folder, env=env).returncode
    finally:
        shutil.rmtree(folder, ignore_errors=True)
