"""mypy over the seams (configured in pyproject.toml): both runtimes, both transports and their
pending reductions must conform to the Protocols in pipedp/runtime/protocols.py."""

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # a whole mypy run: with the slow tests, not the fast tier (CI runs both)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_mypy_checks_the_seams():
    out = subprocess.run([sys.executable, "-m", "mypy"], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
