"""Which replica owns each parameter under a sharded optimizer, and what the trainer refuses or drops for it."""

from types import SimpleNamespace

import pytest
import torch

from pipedp.errors import ConfigError
from pipedp.shards import owners
from pipedp.train.trainer import _shard_optimizers


def test_owners_balance_the_bytes_and_are_the_same_on_every_call():
    sizes = [400, 10, 300, 300, 10, 200, 7]
    got = owners(sizes, 3)
    assert got == owners(list(sizes), 3)
    loads = [sum(s for s, o in zip(sizes, got) if o == r) for r in range(3)]
    # largest first, each to the least loaded (the lowest index on a tie): 400 | 300 + 200 | 300 + 10 + 10 + 7
    assert loads == [400, 500, 327]
    assert max(loads) <= sum(sizes) / 3 + max(sizes)  # greedy's bound: never more than one tensor over the mean
    assert owners(sizes, 1) == [0] * len(sizes)
    assert set(owners([5] * 8, 4)) == {0, 1, 2, 3}


def _stage(*shapes):
    return SimpleNamespace(parameters=[torch.nn.Parameter(torch.zeros(s)) for s in shapes])


def test_a_sharded_optimizer_keeps_no_eager_state_of_parameters_others_own():
    stage = _stage((8, 8), (8,), (4, 4))
    opt = torch.optim.Adagrad(stage.parameters, lr=0.1)  # Adagrad makes its state at construction
    assert len(opt.state) == 3
    found = _shard_optimizers([opt], [stage], replicas=2, replica=1)
    assert found == [owners([256, 32, 64], 2)] == [[0, 1, 1]]
    assert [p in opt.state for p in stage.parameters] == [False, True, True]


def test_an_optimizer_that_steps_tensors_together_is_refused_by_name():
    """The planted case: LBFGS's one line search over every parameter would be cut into per-replica searches."""
    stage = _stage((3, 3))
    with pytest.raises(ConfigError, match=r"shard_optimizer with LBFGS: .*shard_optimizer=False"):
        _shard_optimizers([torch.optim.LBFGS(stage.parameters)], [stage], replicas=2, replica=0)
    assert _shard_optimizers([None], [_stage()], replicas=2, replica=0) == [[]]  # a stage with nothing to train
