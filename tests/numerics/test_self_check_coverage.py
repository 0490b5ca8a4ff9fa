"""The self-check cannot pass vacuously: a shape is checked with its rows per micro-batch, a check that
compared fewer than two finite samples does not count, every row of the checked micro-batch is compared, and
a loss that reads other samples is refused. Each with the planted old rule, under which the case trained."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from steps import class_loss

from pipedp import PipelineDPTrainer, UnsupportedModelError
from pipedp.privacy import rules
from pipedp.privacy.rules import linear
from pipedp.runtime import self_check
from pipedp.runtime.stage_check import StageCheck


class Centred(nn.Module):
    """A hand-written batch norm: each row minus the micro-batch's mean (zero on a one-row micro-batch)."""

    def forward(self, x):
        return x - x.mean(0, keepdim=True)


class MixesTwoRows(nn.Module):
    """Row 1 reads row 3 (of 5): not a row the old check (first, middle, last) compared."""

    def forward(self, x):
        if x.shape[0] < 5:
            return x
        return torch.cat([x[:1], x[1:2] + 0.5 * x[3:4], x[2:]])


def trainer(mixer, microbatches=4, **kw):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), mixer, nn.Tanh(), nn.Linear(6, 3)).double()
    options = dict(stages=2, microbatches=microbatches, noise_multiplier=0.0, max_grad_norm=1.0)
    options.update(expected_batch_size=4, sampling="poisson", sample_rate=0.1, **kw)
    return PipelineDPTrainer(model, class_loss, lambda p: torch.optim.SGD(p, lr=0.1), **options)


def batch(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g)


def test_a_first_step_of_one_row_micro_batches_does_not_check_wider_ones(monkeypatch):
    t = trainer(Centred())
    t.step(*batch(4))  # 4 micro-batches of one row: nothing mixes, exact
    with pytest.raises(UnsupportedModelError, match="its forward mixes samples"):
        t.step(*batch(8))  # micro-batches of 2 rows: a new signature, checked
    # planted: the old signature (shapes without their rows) marks the wide micro-batches checked
    monkeypatch.setattr(self_check, "signature", lambda x: (tuple(x.shape[1:]), x.dtype))
    t = trainer(Centred())
    t.step(*batch(4))
    t.step(*batch(8))  # trained: off the oracle, unseen


def test_a_check_of_one_real_sample_is_done_again(monkeypatch):
    """A fixed micro-batch of 2 rows holding one real sample (and a padding row) compares one sample: the shape
    stays unchecked, and the next step checks it again (with the planted old rule, it was marked checked)."""
    t = trainer(nn.Identity(), microbatches=1, microbatch_size=2)
    t.step(*batch(1))
    assert not any(stage.check.checked for stage in t.runtime.local_stages)
    t.step(*batch(2))
    assert all(stage.check.checked for stage in t.runtime.local_stages)
    monkeypatch.setattr(StageCheck, "conclude", lambda self, conclusive: self.checked.update(self.checking))
    t = trainer(nn.Identity(), microbatches=1, microbatch_size=2)
    t.step(*batch(1))
    assert all(stage.check.checked for stage in t.runtime.local_stages)


def test_a_sample_with_a_non_finite_gradient_leaves_the_shape_unchecked(monkeypatch):
    """Its NaN reaches every row's own gradient, so nothing is verified: the next step checks again, and a
    planted wrong layer rule (per-sample gradients 1.1x) is caught there."""
    wrong = rules.LayerRule("linear", lambda *a: {p: 1.1 * g for p, g in linear.grads(*a).items()}, linear.weight)
    monkeypatch.setitem(rules.RULES, nn.Linear, wrong)
    t = trainer(nn.Identity(), microbatches=1, grad_mode="materialize")
    x, y = batch(3)
    x[1] = float("nan")
    with pytest.warns(UserWarning, match="could not verify"):
        t.step(x, y)
    with pytest.raises(UnsupportedModelError, match="wrong|disagree|not all seen"):
        t.step(*batch(3))


def test_every_row_of_the_checked_micro_batch_is_compared(monkeypatch):
    t = trainer(MixesTwoRows(), microbatches=1)
    with pytest.raises(UnsupportedModelError, match="its forward mixes samples: the output of rows 1..1"):
        t.step(*batch(5))
    monkeypatch.setattr(self_check, "units_to_check", lambda mask: (0, 2, 4))  # planted: the old first/middle/last
    trainer(MixesTwoRows(), microbatches=1).step(*batch(5))  # trained, 0.24 off the oracle as reported


def in_batch_contrastive(out, y):
    """InfoNCE against the in-batch targets: sample i's loss reads every other sample's target."""
    targets = F.one_hot(y, 3).to(out.dtype)
    logits = out @ targets.t()
    return F.cross_entropy(logits, torch.arange(len(y)), reduction="none")


def test_a_loss_that_reads_other_samples_is_refused(monkeypatch):
    def build():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()
        return PipelineDPTrainer(
            model, in_batch_contrastive, stages=2, microbatches=2, noise_multiplier=0.0, expected_batch_size=4
        )

    with pytest.raises(UnsupportedModelError, match="loss_fn reads other samples.*InfoNCE"):
        build().step(*batch(6))
    monkeypatch.setattr(self_check, "refuse_coupled_loss", lambda *a: None)  # planted: no loss check
    build().step(*batch(6))  # the gradient check passes it: one record moves the others' losses


def test_a_loss_that_fails_on_one_sample_alone_is_refused():
    def needs_the_batch(out, y):
        assert len(y) > 1, "needs at least two samples"
        return class_loss(out, y)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    t = PipelineDPTrainer(model, needs_the_batch, stages=1, microbatches=1, expected_batch_size=4)
    with pytest.raises(UnsupportedModelError, match="loss_fn fails on one sample's outputs and targets alone"):
        t.step(*batch(4))


class LastReadsFirst(nn.Module):
    """The micro-batch's last row reads its first: with padding at the end, no real row shows it."""

    def forward(self, x):
        return x if x.shape[0] < 2 else torch.cat([x[:-1], x[-1:] + 0.5 * x[:1]])


def test_a_check_with_padding_rows_is_done_again_on_a_full_micro_batch():
    t = trainer(LastReadsFirst(), microbatches=1, microbatch_size=4)
    t.step(*batch(2))  # two real rows and two padding rows: the flow into row 3 is not seen
    assert not any(stage.check.checked for stage in t.runtime.local_stages)
    with pytest.raises(UnsupportedModelError, match="its forward mixes samples: the output of rows 3..3"):
        t.step(*batch(4))


@pytest.mark.parametrize("frozen_embedding", [False, True])
def test_a_mixing_before_every_trainable_parameter_is_refused(frozen_embedding, monkeypatch):
    """Each sample's gradient is right for its loss, but that loss reads every other sample's input: only the
    forward computed per sample alone shows it (the gradient comparison has nothing upstream to compare)."""
    torch.manual_seed(0)
    if frozen_embedding:  # the LoRA-like shape: a frozen embedding, then the mixing, then what trains
        embedding = nn.Embedding(10, 4)
        embedding.weight.requires_grad_(False)
        model = nn.Sequential(embedding, Centred(), nn.Flatten(), nn.Linear(12, 3)).double()
        g = torch.Generator().manual_seed(2)
        x, y = torch.randint(0, 10, (4, 3), generator=g), torch.randint(0, 3, (4,), generator=g)
    else:
        model = nn.Sequential(Centred(), nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()
        x, y = batch(4)

    def build():
        return PipelineDPTrainer(
            copy.deepcopy(model), class_loss, stages=2, microbatches=1, noise_multiplier=0.0, expected_batch_size=4
        )

    with pytest.raises(UnsupportedModelError, match="stage [01]: its forward mixes samples"):
        build().step(x, y)
    monkeypatch.setattr(StageCheck, "refuse_mixed_samples", lambda *a: None)  # planted: the gradient check alone
    build().step(x, y)  # trained: one record moves the others' gradients


def test_a_random_loss_is_not_refused_but_said_unverifiable():
    def sampled_negatives(out, y):  # random, but each sample's own
        noise = 0.01 * torch.randn_like(out)
        return class_loss(out + noise, y)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    t = PipelineDPTrainer(model, sampled_negatives, stages=1, microbatches=1, expected_batch_size=4)
    with pytest.warns(UserWarning, match="loss_fn draws random numbers"):
        t.step(*batch(4))


class CouplesInFloat32(nn.Module):
    """Each row moved by ``share`` of the batch's mean (no gradient through it: as rounding, not as a function of
    the others), computed in float32 (``float32=True``, as a float64 model's router may compute its logits) or in
    float64. A ``share`` of 1e-6 is what float32 rounding does downstream of a cast that differs by an ulp between
    the micro-batch and the row alone (Laguna's and Kolibri-1's routers, tests/numerics/test_moe.py)."""

    def __init__(self, share: float, float32: bool, constant: bool = False):
        super().__init__()
        self.share, self.float32, self.constant = share, float32, constant

    def forward(self, x):
        h = x.float() if self.float32 else x
        if self.constant:  # a float32 constant, made from no tensor: nothing of the data computed in float32
            h = h * torch.tensor(1.0)
        return (h + self.share * h.mean(0).abs().detach()).to(x.dtype)


@pytest.mark.parametrize(
    "share, float32, constant, refused",
    [
        (1e-6, True, False, False),  # float32 rounding, in a float64 model: judged at FLOAT32_INSIDE (1e-5)
        (1e-6, False, False, True),  # the same in float64: float64's tolerance still holds
        (1e-6, False, True, True),  # ... beside a float32 constant, which computes nothing of the data in float32
        (1e-4, True, False, True),  # planted: a coupling above float32's rounding, computed in float32, is refused
    ],
)
def test_a_float64_forward_computing_in_float32_is_judged_at_float32s_rounding_and_no_looser(
    share, float32, constant, refused
):
    t = trainer(CouplesInFloat32(share, float32, constant), microbatches=1)
    if refused:
        with pytest.raises(UnsupportedModelError, match="its forward mixes samples"):
            t.step(*batch(4))
    else:
        t.step(*batch(4))
