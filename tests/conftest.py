"""Test tiers. ``python -m pytest -q`` (the README's command, as CI) runs everything. The fast tier,
``-m "not slow and not dist"``, is the unit tests, the documentation's command lines, bad-input
errors and the pairwise subset of the Opacus parity grid — under a minute on 2 cores; ``dist`` tests
start processes (gloo on loopback); ``slow`` is the rest: whole grids, every model family, the CLI's
jobs, the audit, the benchmarks' smoke runs."""

import pathlib

import pytest

ROOT = pathlib.Path(__file__).parent
FAST = {"unit", "test_docs.py", "test_errors.py", "test_parity_opacus.py"}  # folders or files of the fast tier


def pytest_collection_modifyitems(config, items):
    for item in items:
        parts = pathlib.Path(str(item.fspath)).relative_to(ROOT).parts
        if parts[0] == "multiprocess":  # every test there starts processes
            item.add_marker(pytest.mark.dist)
        elif not FAST & set(parts) or _runs_python_blocks(item):
            item.add_marker(pytest.mark.slow)


def _runs_python_blocks(item) -> bool:
    """The docs' Python blocks train models: the fast tier only parses the docs' command lines."""
    return item.fspath.basename == "test_docs.py" and item.name.startswith("test_python_blocks_run")
