"""The self-check across processes: its probes travel behind the gradient messages over gloo, and a
model it refuses is refused there too (the run ends, naming the stage's reason)."""

import subprocess
import sys
import time

import pytest
from workers import time_first_rank

from pipedp import RankFailedError
from pipedp.runtime.launch import launch


def test_a_time_first_model_is_refused_over_two_processes():
    with pytest.raises(RankFailedError, match="wrong though their sum over the micro-batch is right"):
        launch(time_first_rank, 2, timeout_s=120, op_timeout_s=60)


def test_a_wait_past_its_bound_ends_the_process_with_a_message():
    """bounded(): a blocking call whose own timeout never fires (a stale rendezvous) still ends."""
    code = (
        "import time\nfrom pipedp.runtime.launch import bounded\nwith bounded('joining', 0.2, grace=0): time.sleep(60)"
    )
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 75 and "joining did not finish within 0 s" in done.stderr
    assert time.monotonic() - start < 30
