"""Several nodes under torchrun: two agents (``--nnodes 2``, one rank each, a c10d rendezvous on loopback, one
shared run folder) train the default job exactly as one agent with both ranks does: the checkpoints' tensors
are equal bit for bit. A run folder that is not one folder for every rank (node-local on each node) is refused
before the first step."""

import os
import re
import subprocess
import sys

import pytest
import torch

from pipedp import RankFailedError
from pipedp.runtime.launch import free_port, launch

pytestmark = pytest.mark.dist
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOB = ["-m", "pipedp", "train", "--stages", "2", "--steps", "2", "--seed", "3", "--no-progress",
       "--noise-multiplier", "1.0", "--max-grad-norm", "1.0", "--checkpoint-every", "2"]  # fmt: skip


def torchrun(args, folder, extra=()):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", *args, *JOB, "--checkpoint-dir", str(folder), *extra]
    return subprocess.Popen(
        command,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def descendants(pid):
    """Every process below ``pid`` (torchrun's workers run in their own sessions, so not in its process group)."""
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True, check=True).stdout
    children = {}
    for line in out.splitlines():
        child, parent = (int(v) for v in line.split())
        children.setdefault(parent, []).append(child)
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def tensors(folder):
    """Every tensor of the run's last checkpoint, by file and name (the safetensors files of its step folder)."""
    from safetensors.torch import load_file

    step = sorted(d for d in os.listdir(folder) if d.startswith("step-"))[-1]
    out = {}
    for root, _, names in os.walk(os.path.join(folder, step)):
        for name in names:
            if name.endswith(".safetensors"):
                for key, value in load_file(os.path.join(root, name)).items():
                    out[(os.path.relpath(os.path.join(root, name), folder), key)] = value
    return out


def test_two_agents_of_one_rank_each_equal_one_agent_of_two_ranks(tmp_path):
    port = free_port()
    rendezvous = ["--nnodes", "2", "--nproc_per_node", "1", "--rdzv-backend", "c10d",
                  "--rdzv-endpoint", f"127.0.0.1:{port}", "--max-restarts", "0"]  # fmt: skip
    agents = [torchrun(rendezvous, tmp_path / "nodes") for _ in range(2)]
    outputs = [a.communicate(timeout=300)[0] for a in agents]
    assert all(a.returncode == 0 for a in agents), "\n".join(o[-3000:] for o in outputs)
    one = torchrun(["--standalone", "--nproc_per_node", "2"], tmp_path / "one")
    output = one.communicate(timeout=300)[0]
    assert one.returncode == 0, output[-3000:]
    nodes, single = tensors(tmp_path / "nodes"), tensors(tmp_path / "one")
    assert nodes.keys() == single.keys() and len(nodes) > 10
    for key, value in single.items():
        assert torch.equal(nodes[key], value), key
    assert any(not torch.equal(v, torch.zeros_like(v)) for v in single.values())


def test_a_folder_other_ranks_do_not_see_is_refused_before_any_step(tmp_path):
    from workers import node_local_fit

    with pytest.raises(RankFailedError, match=r"ranks \[1\] do not see the files rank 0 writes there.*shared file"):
        launch(node_local_fit, 2, (str(tmp_path),), timeout_s=120)
    assert not list(tmp_path.glob("step-*")) and not list(tmp_path.glob(".tmp-*"))  # no step, no probe left


def test_a_killed_node_ends_the_other_within_the_timeout_naming_it_and_the_job_resumes(tmp_path):
    """Agent 2 (a node: its torchrun agent and its rank, not the node hosting the rendezvous) is SIGKILLed mid-run,
    after the first checkpoint; agent 1's rank ends within --timeout with pipedp's error saying it lost its peer,
    the newest complete checkpoint is kept, and two new agents with --resume finish the run."""
    import signal
    import time

    def agents(extra):
        port = free_port()
        rendezvous = ["--nnodes", "2", "--nproc_per_node", "1", "--rdzv-backend", "c10d",
                      "--rdzv-endpoint", f"127.0.0.1:{port}", "--max-restarts", "0"]  # fmt: skip
        host = torchrun(rendezvous, tmp_path, extra)  # the first agent hosts the rendezvous (its store)
        time.sleep(3)
        return [host, torchrun(rendezvous, tmp_path, extra)]

    first = agents(["--steps", "40", "--timeout", "20"])
    deadline = time.monotonic() + 240
    while not list(tmp_path.glob("step-*")) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert list(tmp_path.glob("step-*")), first[0].communicate(timeout=60)[0][-3000:]
    for pid in [*descendants(first[1].pid), first[1].pid]:  # the whole node: its rank, then its agent
        os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    output = first[0].communicate(timeout=120)[0]
    assert first[0].returncode != 0
    assert time.monotonic() - killed_at < 20 + 60, output[-3000:]  # the timeout, and the agent's teardown
    # pipedp's own error, not only torchrun's (a receive names the peer, "rank 0 (stage 0) got no ...: rank 1 stopped
    # answering"; a collective says its group lost a rank, "rank 0: the loss total ... (a rank stopped answering")
    assert re.search(r"pipedp: error: rank 0\b.*(rank 1 stopped answering|a rank stopped answering)", output), output
    assert list(tmp_path.glob("step-*"))  # the newest complete checkpoint is kept

    again = agents(["--steps", "40", "--timeout", "20", "--resume"])
    outputs = [a.communicate(timeout=600)[0] for a in again]
    assert all(a.returncode == 0 for a in again), "\n".join(o[-3000:] for o in outputs)
    assert sorted(p.name for p in tmp_path.glob("step-*"))[-1] == "step-00000040"
