import itertools

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

from pipedp import PipelineConfig
from pipedp.errors import PartitionError, UnsupportedModelError
from pipedp.split.adapters import model_blocks
from pipedp.split.partition import Tie, balanced_split, find_ties, partition, uniform_split


def brute_force_best(costs, stages):
    n = len(costs)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = (0,) + cuts + (n,)
        best = min(best, max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])))
    return best


@given(costs=st.lists(st.integers(0, 50), min_size=1, max_size=9), data=st.data())
@settings(max_examples=100, deadline=None)
def test_balanced_split_is_optimal_and_contiguous(costs, data):
    stages = data.draw(st.integers(1, len(costs)))
    ranges = balanced_split(costs, stages)
    assert [i for r in ranges for i in r] == list(range(len(costs)))
    assert all(len(r) >= 1 for r in ranges)
    assert max(sum(costs[i] for i in r) for r in ranges) == brute_force_best(costs, stages)


def test_uniform_split():
    assert [len(r) for r in uniform_split(7, 3)] == [3, 2, 2]


def test_more_stages_than_blocks():
    with pytest.raises(PartitionError, match="cannot split 3 blocks into 4 stages"):
        uniform_split(3, 4)


def test_params_balance_puts_the_heavy_block_alone():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(100, 100), nn.Linear(2, 2))
    stages = partition(model_blocks(model), 2, "params")
    assert [b.name for b in stages[1]] == ["2", "3"] or [b.name for b in stages[0]] == ["0", "1", "2"]
    assert [b.name for b in stages[0]] == ["0", "1"]


def test_an_embedding_tied_to_the_head_is_found_other_sharing_refused():
    a, b = nn.Embedding(10, 4), nn.Linear(4, 10, bias=False)
    b.weight = a.weight
    stages = partition(model_blocks(nn.Sequential(a, nn.Tanh(), b)), 2, "uniform")
    assert find_ties(stages) == [Tie("0.weight", "2.weight")]
    c, d = nn.Linear(4, 4), nn.Linear(4, 4)
    d.weight = c.weight  # two linear layers sharing a weight across stages: no exact rule for that
    with pytest.raises(PartitionError, match="one tensor used on several stages.*untie"):
        partition(model_blocks(nn.Sequential(c, nn.Tanh(), d)), 2, "uniform")


def test_unknown_model_without_split_points():
    class Opaque(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x):
            return self.lin(x)

    blocks = model_blocks(Opaque())  # one block: the whole forward, for one stage
    assert len(blocks) == 1 and partition(blocks, 1)[0] == blocks
    with pytest.raises(UnsupportedModelError, match="don't know how to split Opaque.*run it on one stage"):
        partition(blocks, 2)


class Repeated(nn.Module):
    """Few parameters, much compute: one small layer applied many times."""

    def __init__(self, times):
        super().__init__()
        self.lin, self.times = nn.Linear(32, 32), times

    def forward(self, x):
        for _ in range(self.times):
            x = torch.tanh(self.lin(x))
        return x


def test_measured_cost_split_beats_uniform_in_the_simulator():
    from pipedp import measured_costs
    from pipedp.split.balance import report
    from schedules import Kind, build, simulate

    torch.manual_seed(0)
    model = nn.Sequential(Repeated(96), Repeated(96), *[nn.Linear(32, 32) for _ in range(6)])
    blocks = model_blocks(model)
    costs = measured_costs(torch.randn(16, 32), repeats=3)(blocks)
    assert costs[0] > 5 * costs[-1]  # ~40x the compute: a margin no scheduling hiccup on a shared machine closes

    def makespan(stage_blocks):
        stage_costs = report(stage_blocks, costs).stage_costs
        table = [{Kind.F: c, Kind.I: c, Kind.W: c} for c in stage_costs]
        return simulate(build("1f1b", 2, 8), table).makespan

    uniform = partition(blocks, 2, "uniform")
    measured = partition(blocks, 2, costs)
    assert [len(s) for s in uniform] == [4, 4]
    assert report(measured, costs).imbalance < report(uniform, costs).imbalance
    assert makespan(measured) < makespan(uniform)


def test_compute_balance_counts_an_embedding_as_a_lookup():
    """The default: an embedding does no matrix work, so it does not get a stage to itself."""
    model = nn.Sequential(nn.Embedding(10_000, 16), nn.Linear(16, 256), nn.Linear(256, 256), nn.Linear(256, 16))
    by_params = partition(model_blocks(model), 2, "params")
    by_compute = partition(model_blocks(model), 2)
    assert [b.name for b in by_params[0]] == ["0"]  # 160k parameters, no multiply-add
    assert [b.name for b in by_compute[1]] == ["2", "3"] or [b.name for b in by_compute[1]] == ["3"]
    assert len(by_compute[0]) >= 2  # the lookup rides with the next block
    assert PipelineConfig().balance == "compute"
