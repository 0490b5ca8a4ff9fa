"""Any module split at pipe_split() points through graph capture; clear errors otherwise."""
import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.pipelining import pipe_split

from oracles import loop_clipped_sum, max_relative_error
from pipedp import PipelineDPTrainer, UnsupportedModelError
from pipedp import SplitModel

warnings.filterwarnings("ignore", category=FutureWarning)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 12)
        self.mid = nn.ModuleList([nn.Linear(12, 12) for _ in range(2)])
        self.norm = nn.LayerNorm(12)
        self.out = nn.Linear(12, 3)

    def forward(self, x):
        x = torch.tanh(self.inp(x))
        pipe_split()
        for layer in self.mid:
            x = x + torch.tanh(layer(x))
        pipe_split()
        return self.out(self.norm(x))


class Skip(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        h = self.a(x)
        pipe_split()
        return self.b(h + x)  # x crosses the split point next to h


def loss(out, y):
    return F.cross_entropy(out, y, reduction="none")


@pytest.mark.parametrize("stages", [2, 3])
def test_captured_stages_match_the_loop_oracle(stages):
    torch.manual_seed(0)
    net = Net().double()
    x, y = torch.randn(7, 6, dtype=torch.float64), torch.randint(0, 3, (7,))
    want = loop_clipped_sum(copy.deepcopy(net), loss, x, y, 0.2)
    model = SplitModel(net, x[:2])
    before = {k: v.detach().clone() for k, v in net.named_parameters()}
    trainer = PipelineDPTrainer(model, loss, lambda p: torch.optim.SGD(p, lr=1.0), stages=stages, microbatches=2,
                                noise_multiplier=0.0, max_grad_norm=0.2, expected_batch_size=1)
    trainer.step(x, y)
    got = {k: before[k] - p.detach() for k, p in net.named_parameters()}
    assert max_relative_error(got, want) < 1e-8
    assert set(trainer.state_dict()) == set(model.state_dict())


def test_two_tensors_across_a_split_point_is_refused():
    with pytest.raises(UnsupportedModelError, match="takes 2 tensors.*only one tensor may cross a split point"):
        PipelineDPTrainer(SplitModel(Skip(), torch.randn(2, 4)), loss, stages=2, expected_batch_size=2)


def test_no_split_points():
    with pytest.raises(UnsupportedModelError, match="no split points.*pipe_split"):
        PipelineDPTrainer(SplitModel(nn.Linear(3, 3), torch.randn(2, 3)), loss, stages=2, expected_batch_size=2)


def test_untraceable_model_names_the_problem():
    class DataDependent(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(3, 3)

        def forward(self, x):
            if x.sum() > 0:  # Python control flow on data
                x = x * 2
            pipe_split()
            return self.a(x)

    with pytest.raises(UnsupportedModelError, match="graph capture of DataDependent failed"):
        PipelineDPTrainer(SplitModel(DataDependent(), torch.randn(2, 3)), loss, stages=2, expected_batch_size=2)
