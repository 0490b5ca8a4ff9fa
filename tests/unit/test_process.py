"""settle_process: the process-wide settings an application applies once its trainer is built."""

import platform
import subprocess
import sys

import pytest

CODE = """
import gc, pipedp
applied = pipedp.settle_process()
print(applied, gc.get_freeze_count() > 0)
"""


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_settle_process_freezes_the_heap_and_sets_glibc_thresholds():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True", "True"]  # mallopt accepted both thresholds; the built objects are frozen
