"""Test tiers. ``python -m pytest -q -m "not exhaustive"`` (the README's command, as CI) runs every test but the
rest of the grids beyond their pairwise covering subsets (``-m exhaustive``: every pair of settings still meets in
CI; ``python -m pytest -q`` runs both). The fast tier, ``-m "not slow and not dist"``, is the unit tests (but the
mypy run and most of the narrowing grid, marked slow), the documentation's command lines, bad-input errors and the
pairwise subset of the Opacus parity grid — under a minute on 2 cores; ``dist`` tests start processes (gloo on loopback); ``slow`` is the rest: whole grids, every model
family, the CLI's jobs, the audit, the benchmarks' smoke runs.

Each test is also marked with its kind, its folder: ``unit`` (one module, no training run), ``numerics`` (results
against an oracle, in one process), ``multiprocess``, and ``end_to_end`` for the top level (the command line, the
docs, the benchmarks' smoke runs): ``-m unit`` runs one kind."""

import pathlib
import types

import pytest
import torch

ROOT = pathlib.Path(__file__).parent
FAST = {"unit", "test_docs.py", "test_errors.py", "test_parity_opacus.py"}  # folders or files of the fast tier


KINDS = {"unit", "numerics", "multiprocess"}  # a test's kind is its folder; the top level is end_to_end


def pytest_collection_modifyitems(config, items):
    for item in items:
        parts = pathlib.Path(str(item.fspath)).relative_to(ROOT).parts
        item.add_marker(getattr(pytest.mark, parts[0] if parts[0] in KINDS else "end_to_end"))
        if parts[0] == "multiprocess":  # every test there starts processes
            item.add_marker(pytest.mark.dist)
        elif not FAST & set(parts) or _runs_python_blocks(item):
            item.add_marker(pytest.mark.slow)


def _runs_python_blocks(item) -> bool:
    """The docs' Python blocks train models: the fast tier only parses the docs' command lines."""
    return item.fspath.basename == "test_docs.py" and item.name.startswith("test_python_blocks_run")


@pytest.fixture
def cli(capsys, monkeypatch):
    """Run ``pipedp ...`` in this process (no interpreter start-up: most jobs here run --inprocess); returns
    (exit code, stdout, stderr). The process-wide settings a real run makes are kept out of the test process."""
    import pipedp.runtime.process
    from pipedp.cli.main import main

    monkeypatch.setattr(pipedp.runtime.process, "settle_process", lambda: False)
    threads = torch.get_num_threads()

    def run(*args):
        capsys.readouterr()
        try:
            code = main(list(args))
        except SystemExit as exc:
            code = exc.code
        finally:
            torch.set_num_threads(threads)
        out, err = capsys.readouterr()
        return types.SimpleNamespace(returncode=code, stdout=out, stderr=err)

    return run
