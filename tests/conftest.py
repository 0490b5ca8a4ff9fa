"""Test tiers: ``-m "not slow and not dist"`` is the fast tier (unit tests and the pairwise grids, under a
minute); ``dist`` tests start processes (gloo on loopback); ``slow`` ones are the whole grids. The README's
test command runs them all, as CI does."""

import pathlib

import pytest


def pytest_collection_modifyitems(config, items):
    for item in items:  # every test under tests/multiprocess/ starts processes
        if "multiprocess" in pathlib.Path(str(item.fspath)).parts:
            item.add_marker(pytest.mark.dist)
