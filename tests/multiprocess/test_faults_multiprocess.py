"""Every fault ends the run cleanly, in bounded time, naming the rank at fault."""

import os
import signal
import subprocess
import sys
import time
from dataclasses import replace

import pytest
from workers import signal_at_step

from pipedp import RankFailedError
from pipedp.runtime.launch import launch

pytestmark = pytest.mark.dist
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_a_stopped_rank_ends_the_run_within_the_timeout_and_is_named():
    start = time.monotonic()
    with pytest.raises(RankFailedError, match=r"rank 1 failed: stopped \(SIGSTOP\) and stopped answering") as info:
        launch(signal_at_step, 2, ("SIGSTOP", 3.0), timeout_s=120, op_timeout_s=3.0)
    elapsed = time.monotonic() - start
    assert info.value.rank == 1
    assert "rank 0 then reported: TransportError" in str(info.value) and "got no" in str(info.value)
    assert elapsed < 3.0 + 25, f"took {elapsed:.0f}s"  # process start + timeout + the launcher's grace


def test_a_killed_rank_is_named_not_the_survivor():
    with pytest.raises(RankFailedError, match="rank 1 failed: killed by SIGKILL") as info:
        launch(signal_at_step, 2, ("SIGKILL", 30.0), timeout_s=120)
    assert info.value.rank == 1


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead too
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_killing_the_launcher_leaves_no_rank_alive(tmp_path):
    code = (
        "from pipedp.runtime.launch import launch; from workers import sleep_and_report_pid; "
        f"launch(sleep_and_report_pid, 2, ({str(tmp_path)!r},), timeout_s=600)"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests", "multiprocess")]))
    launcher = subprocess.Popen([sys.executable, "-c", code], env=env)
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("rank*.pid"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    pids = [int(p.read_text()) for p in tmp_path.glob("rank*.pid")]
    assert len(pids) == 2 and all(alive(p) for p in pids)
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(p) for p in pids), "ranks outlived their launcher"


def test_the_launcher_and_its_ranks_listen_on_loopback_only():
    from workers import report_listening_sockets

    addresses = launch(report_listening_sockets, 2, timeout_s=60)[0]
    assert addresses, "no listening socket found: the check would pass vacuously"
    assert set(addresses) == {"0100007F"}, addresses  # 127.0.0.1, little-endian hex in /proc/net/tcp


def test_the_ranks_rendezvous_through_a_private_file_and_nothing_listens_but_gloo_on_loopback():
    """Another user cannot open a folder of mode 0700 (testing that needs root: the bits are tested); the
    launcher listens on no port at all (the TCPStore it hosted took any local connection)."""
    from workers import report_rendezvous

    reports = launch(report_rendezvous, 2, timeout_s=60)
    path, mode, launcher_ports, rank_ports = reports[0]
    assert [r[0] for r in reports] == [path, path]  # one store for the job
    assert mode == 0o700, oct(mode)
    assert launcher_ports == []
    assert rank_ports and set(rank_ports) == {"0100007F"}, rank_ports  # gloo's pairs, on 127.0.0.1
    assert not os.path.exists(os.path.dirname(path)), "the rendezvous folder outlived the job"


def test_the_audit_over_processes_equals_the_in_process_one(tmp_path):
    from pipedp.audit.run import AuditConfig, AuditResult, audit_rank, run_audit

    config = AuditConfig(canaries=300, steps=4)
    distributed = replace(config, pipeline=replace(config.pipeline, transport="auto"))  # one stage per process
    over_processes = AuditResult.from_dict(launch(audit_rank, 2, (distributed,), timeout_s=300)[0])
    in_process = run_audit(config)
    assert over_processes.scores == in_process.scores  # the same noise, draw for draw
    assert over_processes.epsilon_lower_bound == in_process.epsilon_lower_bound
    assert over_processes.passed


def children(pid):
    """The pids of ``pid``'s child processes (Linux /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return out


def wait_until(condition, seconds):
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.2)
    return condition()


@pytest.mark.parametrize("phase", ["before the first step", "mid-training"])
def test_killing_torchrun_s_agent_stops_every_rank_and_frees_the_folder(tmp_path, phase):
    """torchrun starts its ranks in their own session: nothing but the ranks' own watch ends them when the
    agent is SIGKILLed. Planted: the agent killed while the ranks start, and once they have trained."""
    from pipedp.runtime.launch import free_port

    run = tmp_path / "run"
    train = ["-m", "pipedp", "train", "--stages", "2", "--device", "cpu", "--checkpoint-dir", str(run)]
    train += ["--timeout", "20", "--no-progress", "--threads", "1"]
    log = open(tmp_path / "torchrun.log", "w")
    agent = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())]
        + train
        + ["--steps", "100000", "--checkpoint-every", "1"],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=dict(os.environ, PYTHONPATH=ROOT),
        cwd=tmp_path,
    )
    try:
        assert wait_until(lambda: len(children(agent.pid)) == 2, 60), "torchrun started no ranks"
        ranks = children(agent.pid)
        if phase == "mid-training":
            assert wait_until(lambda: len(list(run.glob("step-*"))) >= 2, 180), (tmp_path / "torchrun.log").read_text()
        agent.kill()
        agent.wait()
        assert wait_until(lambda: not any(alive(p) for p in ranks), 60), "ranks outlived torchrun's agent"
    finally:
        agent.kill()
        log.close()
    text = (tmp_path / "torchrun.log").read_text()
    assert "torchrun's agent (pid" in text and "is gone" in text, text[-3000:]
    again = subprocess.run(
        [sys.executable] + train + ["--resume", "--steps", "1", "--inprocess"],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=ROOT),
        cwd=tmp_path,
        timeout=300,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert "in use by another job" not in again.stderr


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("bad_stage", [0, 1])
def test_a_failed_step_ends_with_one_named_error_on_every_rank_fast_and_the_run_recovers(schedule, bad_stage):
    """The failing stage drains the pass (abort headers in place of its messages), so its peer stops waiting
    at once; every rank raises the same StepFailedError naming the rank and its error, and the next step
    equals a run that never failed. Planted: a token id (stage 0) or a label (stage 1) past the vocabulary."""
    from workers import failed_step

    results = launch(failed_step, 2, (schedule, bad_stage), timeout_s=300)
    _dropped_and_recovered(results, bad_stage, "IndexError")


def _dropped_and_recovered(results, bad_stage, error):
    """One StepFailedError, the same on every rank, naming ``bad_stage`` and its ``error`` type, every rank fast;
    the next step equal to a run that never failed. Returns the error's text."""
    import torch

    errors = [r[0] for r in results]
    assert errors[0] is not None and errors == [errors[0]] * 2, errors  # one error, the same on every rank
    assert errors[0].startswith(f"StepFailedError: rank {bad_stage} (stage {bad_stage}) failed in a step: {error}")
    assert "every rank dropped the step" in errors[0]
    assert all(r[1] < 15 for r in results), [r[1] for r in results]  # the timeout is 30 s
    recovered, straight = results[0][2], results[0][3]
    assert recovered.keys() == straight.keys()
    assert all(torch.equal(recovered[k], straight[k]) for k in straight)
    return errors[0]


@pytest.mark.parametrize(
    "bad_stage,how,first",
    [(0, "noise", False), (1, "noise", False), (1, "start", False), (1, "probe", True), (1, "noise", True)],
)
def test_a_failure_before_an_action_starts_drops_the_step_not_the_run(bad_stage, how, first):
    """A stage draws the step's noise just before its first receive (stage 1: the first activation; stage 0:
    the first gradient), and stage 1's pass starts (the batch moved, probed, the state watched) before its first
    action, a receive (in the run's first step a self-checked one: its probe made then, on this stage alone
    failing). A draw or a start that runs out of memory has not started that action, so the stage drains
    the pass from it on and the run recovers, as for a failed computation (planted, the flag off: the run is
    refused). In the run's first, self-checked, step the draw comes before the first W, a computation drained
    either way: that case checks the recovery of a failed checked step, not the flag. Planted: it raises once."""
    from workers import failed_step

    what = {"noise": "drawing the noise", "start": "starting the pass", "probe": "probing"}[how]
    results = launch(failed_step, 2, ("1f1b", bad_stage, how, first), timeout_s=300)
    error = _dropped_and_recovered(results, bad_stage, "RuntimeError")
    assert f"planted: out of memory while {what}" in error


@pytest.mark.parametrize("bad_rank", [0, 1])
def test_a_pass_that_fails_before_its_state_exists_is_refused_by_name_not_drained(bad_rank):
    """Nothing of such a pass can be drained (Executor.failed_communicating, whatever its first action): the failing
    rank raises its own error, its peer a named one by the 10 s timeout, and both refuse every later step. Planted:
    PassState raises once."""
    from workers import failed_pass_state

    results = launch(failed_pass_state, 2, (bad_rank,), timeout_s=300)
    bad, peer = results[bad_rank], results[1 - bad_rank]
    assert bad["step"] == "RuntimeError: planted: the pass's state could not be made", bad["step"]
    report = f"rank {bad_rank} (stage {bad_rank}) failed in a step: RuntimeError: planted: the pass's state could not"
    assert peer["step"].startswith(f"StepFailedError: {report}"), peer["step"]
    for out in results:
        assert out["next step"].startswith(f"StepFailedError: {report}"), out["next step"]
        assert "refuses every later step" in out["next step"]
    assert peer["seconds"] < 30, peer["seconds"]


def test_a_rank_whose_update_fails_tells_the_others_and_every_later_call_is_refused(tmp_path, monkeypatch):
    from workers import failed_update

    monkeypatch.setenv("PIPEDP_TEST_DIR", str(tmp_path))
    first, second = launch(failed_update, 2, timeout_s=300)
    assert second["step"] == "RuntimeError: planted: this stage's update failed"
    report = "rank 1 (stage 1) failed in a step: RuntimeError: planted"
    assert first["step"].startswith(f"StepFailedError: {report}"), first["step"]
    for out in (first, second):
        for what in ("next step", "state_dict", "checkpoint"):
            assert out[what].startswith(f"StepFailedError: {report}"), (what, out[what])
            assert "refuses every later step" in out[what]
        assert out["seconds"] < 15, out["seconds"]  # the timeout is 30 s
