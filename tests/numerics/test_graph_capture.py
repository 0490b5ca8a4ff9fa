"""Any module split at pipe_split() points through graph capture; clear errors otherwise."""

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from loop_models import LoopNet
from oracles import loop_clipped_sum, max_relative_error
from torch.distributed.pipelining import pipe_split

from pipedp import PipelineDPTrainer, SplitModel, UnsupportedModelError
from pipedp.models import token_loss

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
    trainer = PipelineDPTrainer(
        model,
        loss,
        lambda p: torch.optim.SGD(p, lr=1.0),
        stages=stages,
        microbatches=2,
        noise_multiplier=0.0,
        max_grad_norm=0.2,
        expected_batch_size=1,
    )
    trainer.step(x, y)
    got = {k: before[k] - p.detach() for k, p in net.named_parameters()}
    assert max_relative_error(got, want) < 1e-8
    assert set(trainer.state_dict()) == set(model.state_dict())


def test_two_tensors_across_a_split_point_is_refused():
    with pytest.raises(
        UnsupportedModelError,
        match="takes 2 tensors.*only one tensor may cross a marked split point.*without SplitModel",
    ):
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


seq_loss = token_loss  # per-sample mean over positions


def loop_net():
    torch.manual_seed(0)
    return LoopNet().double()


@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("mode", ["ghost", "materialize"])
def test_a_module_list_model_splits_automatically_and_matches_the_loop_oracle(stages, mode):
    model = loop_net()
    trainer = PipelineDPTrainer(
        model,
        seq_loss,
        lambda p: torch.optim.SGD(p, lr=1.0),
        stages=stages,
        microbatches=3,
        noise_multiplier=0.0,
        max_grad_norm=0.05,
        expected_batch_size=1,
        grad_mode=mode,
    )
    assert list(trainer.state_dict()) == list(model.state_dict())  # the model's own names
    g = torch.Generator().manual_seed(1)
    for n, t in ((9, 6), (5, 11)):  # one trainer, other batch sizes and sequence lengths
        x, y = torch.randn(n, t, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (n, t), generator=g)
        want = loop_clipped_sum(copy.deepcopy(model), seq_loss, x, y, 0.05)
        before = {k: v.detach().clone() for k, v in model.named_parameters()}
        trainer.step(x, y)
        got = {k: before[k] - p.detach() for k, p in model.named_parameters()}
        assert max_relative_error(got, want) < 1e-10


def test_the_automatic_split_equals_the_hand_made_one():
    auto, by_hand = loop_net(), loop_net()
    by_hand.pipeline_blocks = lambda: (
        [("inp", by_hand.inp)] + [(f"layers.{i}", m) for i, m in enumerate(by_hand.layers)] + [("out", by_hand.out)]
    )
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(8, 4, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (8, 4), generator=g)
    for model in (auto, by_hand):
        PipelineDPTrainer(
            model,
            seq_loss,
            lambda p: torch.optim.SGD(p, lr=1.0),
            stages=2,
            microbatches=2,
            noise_multiplier=1.0,
            max_grad_norm=0.05,
            expected_batch_size=8,
            seed=3,
        ).step(x, y)
    assert max_relative_error(auto.state_dict(), by_hand.state_dict()) < 1e-12


def test_what_cannot_be_traced_is_refused_by_name():
    class Branchy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(5, 5), torch.nn.Linear(5, 3)

        def forward(self, x):
            return self.b(self.a(x) if x.sum() > 0 else x)  # control flow on a tensor's value

    with pytest.raises(UnsupportedModelError, match="could not be traced.*pipeline_blocks"):
        PipelineDPTrainer(Branchy(), seq_loss, stages=2, expected_batch_size=4)


class ConvResidual(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv, self.norm = torch.nn.Conv2d(c, c, 3, padding=1), torch.nn.GroupNorm(2, c)

    def forward(self, x, scale=1.0):
        return x + scale * torch.relu(self.norm(self.conv(x)))


class SmallCNN(torch.nn.Module):
    """Images, GroupNorm, residual blocks called with a keyword argument, a loop: no marks."""

    def __init__(self):
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.blocks = torch.nn.ModuleList([ConvResidual(4) for _ in range(3)])
        self.head = torch.nn.Linear(4, 5)

    def forward(self, x):
        h = self.stem(x)
        for block in self.blocks:
            h = block(h, scale=0.5)
        return self.head(h.mean((2, 3)))


@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("mode", ["ghost", "materialize"])
def test_a_small_cnn_with_keyword_blocks_splits_automatically(stages, mode):
    torch.manual_seed(0)
    model = SmallCNN().double()
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(6, 3, 8, 8, generator=g, dtype=torch.float64), torch.randint(0, 5, (6,), generator=g)
    want = loop_clipped_sum(copy.deepcopy(model), lambda o, t: F.cross_entropy(o, t, reduction="none"), x, y, 0.05)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    PipelineDPTrainer(
        model,
        lambda o, t: F.cross_entropy(o, t, reduction="none"),
        lambda p: torch.optim.SGD(p, lr=1.0),
        stages=stages,
        microbatches=2,
        noise_multiplier=0.0,
        max_grad_norm=0.05,
        expected_batch_size=1,
        grad_mode=mode,
    ).step(x, y)
    got = {k: before[k] - p.detach() for k, p in model.named_parameters()}
    assert max_relative_error(got, want) < 1e-10
