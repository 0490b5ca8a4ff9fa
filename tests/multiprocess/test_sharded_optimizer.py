"""ZeRO stage 1 (``shard_optimizer``): each replica steps the parameters it owns; the update, the checkpoints and
epsilon are the unsharded run's, and each rank holds about 1/replicas of the optimizer state."""

import shutil

import pytest
import torch
from oracles import max_relative_error
from workers import make_model, sharded_fit

from pipedp.runtime.launch import launch

pytestmark = pytest.mark.dist
MESH = {"stages": 2, "replicas": 2}


def test_sharded_adamw_equals_the_unsharded_run_holds_half_the_state_and_resumes_either_way(tmp_path):
    plain_dir = tmp_path / "plain"
    plain_state, plain_eps, plain_bytes, _ = zip(*launch(sharded_fit, 4, (MESH, 3, str(plain_dir)), timeout_s=300))
    sharded_dir = tmp_path / "sharded"
    runs = launch(sharded_fit, 4, (dict(MESH, shard_optimizer=True), 3, str(sharded_dir)), timeout_s=300)
    state, eps, held, local = zip(*runs)
    assert max_relative_error(state[0], plain_state[0]) < 1e-12
    assert max_relative_error(state[0], make_model().state_dict()) > 1e-3  # the steps really moved the weights
    assert eps == plain_eps
    for stage in (0, 1):  # replica 1 holds what replica 0 holds, bit for bit (each owner's broadcast)
        assert all(torch.equal(a, b) for a, b in zip(local[stage], local[2 + stage])) and local[stage]
    # ranks (replica, stage): 0 = (0, 0), 1 = (0, 1), 2 = (1, 0), 3 = (1, 1); each stage's state split in two
    print(f"optimizer state bytes per rank: unsharded {plain_bytes}, sharded {held}")  # (pytest -s shows it)
    for stage in (0, 1):
        mine, theirs = held[stage], held[2 + stage]
        assert mine + theirs == plain_bytes[stage] == plain_bytes[2 + stage]
        assert max(mine, theirs) < 0.75 * plain_bytes[stage], (mine, theirs, plain_bytes[stage])

    # the sharded run's checkpoint at step 2 holds the whole state by name: it resumes unsharded on one replica
    # (the update is the same; the batches are the same Poisson draws) and ends where the sharded run ended; the
    # unsharded run's checkpoint at step 2 resumes sharded (each replica loads the state of what it owns)
    for folder in (plain_dir, sharded_dir):
        for late in sorted(folder.glob("step-*"))[1:]:
            shutil.rmtree(late)  # keep step 2 only
    resumed = launch(sharded_fit, 2, ({"stages": 2}, 3, str(sharded_dir), True), timeout_s=300)
    assert max_relative_error(resumed[0][0], state[0]) < 1e-12
    assert resumed[0][1] == eps[0]
    resharded = launch(sharded_fit, 4, (dict(MESH, shard_optimizer=True), 3, str(plain_dir), True), timeout_s=300)
    assert max_relative_error(resharded[0][0], plain_state[0]) < 1e-12
    assert all(torch.equal(a, b) for a, b in zip(resharded[0][3], resharded[2][3]))
