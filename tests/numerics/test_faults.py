"""Faults end cleanly and nothing runs that shouldn't: NaN/inf data, non-finite updates, bad losses
and arguments (hostile checkpoint folders: test_checkpoint_attacks.py). The NaN update is checked
against Opacus on the batch without the bad sample (the independent oracle)."""

import pytest
import torch
from oracles import max_relative_error, opacus_step
from steps import class_data, class_loss, class_trainer, classifier

from pipedp import BatchError, ConfigError, NonFiniteError, PipeDPError, PipelineDPTrainer


def data(n=60, seed=0):
    return class_data(n, 8, 4, seed)


def trainer(**kw):
    return class_trainer(classifier(), lambda p: torch.optim.SGD(p, lr=0.2), **kw)


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_a_non_finite_sample_is_left_out_exactly(poison):
    x, y = data(13)
    bad = x.clone()
    bad[5, 2] = poison
    t = trainer(noise_multiplier=0.0, max_grad_norm=0.05, expected_batch_size=12, microbatches=4)
    with pytest.warns(UserWarning, match="1 sample\\(s\\) had a non-finite gradient norm"):
        t.step(bad, y)
    assert t.last_dropped_samples == 1
    assert all(torch.isfinite(v).all() for v in t.state_dict().values())
    keep = torch.arange(13) != 5  # the oracle: Opacus on the batch without the bad sample
    want = opacus_step(classifier(), x[keep], y[keep], token_model=False, mode="hooks", max_grad_norm=0.05, lr=0.2)
    assert max_relative_error(t.state_dict(), want) < 1e-10


@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
def test_a_non_finite_sample_over_sequences_is_left_out_exactly(clipping):
    """Sequences: the layers keep their per-sample gradients from I to W, where the bad row must add
    exactly nothing (0 * NaN is NaN). Oracle: the loop of batch-size-1 passes without that sample."""
    import copy

    from loop_models import LoopNet
    from oracles import loop_clipped_sum

    from pipedp.models import token_loss as seq_loss

    torch.manual_seed(0)
    net = LoopNet().double()
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(7, 6, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (7, 6), generator=g)
    bad = x.clone()
    bad[3, 2, 1] = float("nan")
    keep = torch.arange(7) != 3
    units = [n for n, m in net.named_modules() if list(m.parameters(recurse=False))]
    groups = [((u + ".",), 0.05) for u in units] if clipping == "per_layer" else None
    want = loop_clipped_sum(copy.deepcopy(net), seq_loss, x[keep], y[keep], 0.05, groups=groups)
    before = {k: v.detach().clone() for k, v in net.named_parameters()}
    norm = {u: 0.05 for u in units} if clipping == "per_layer" else 0.05
    t = PipelineDPTrainer(
        net,
        seq_loss,
        lambda p: torch.optim.SGD(p, lr=1.0),
        stages=2,
        microbatches=2,
        noise_multiplier=0.0,
        max_grad_norm=norm,
        clipping=clipping,
        expected_batch_size=1,
    )
    with pytest.warns(UserWarning, match="1 sample\\(s\\) had a non-finite gradient norm"):
        t.step(bad, y)
    got = {k: before[k] - p.detach() for k, p in net.named_parameters()}
    assert max_relative_error(got, want) < 1e-10


def test_a_non_finite_update_is_refused_before_it_lands():
    with pytest.raises(ConfigError, match="optimizer option lr=inf is not finite"):
        PipelineDPTrainer(
            classifier(), class_loss, lambda p: torch.optim.SGD(p, lr=float("inf")), expected_batch_size=8
        )
    t = PipelineDPTrainer(
        classifier(),
        class_loss,
        lambda p: torch.optim.SGD(p, lr=1e308, weight_decay=1e308),
        stages=2,
        microbatches=2,
        noise_multiplier=0.0,
        expected_batch_size=8,
    )
    with pytest.raises(NonFiniteError, match=r"step 1, stage \d: the value after the optimizer step of .*weight"):
        t.step(*data(8))  # finite options that overflow: the last line of defence
    huge = PipelineDPTrainer(
        classifier(),
        class_loss,
        lambda p: torch.optim.SGD(p, lr=0.1),
        stages=2,
        microbatches=2,
        noise_multiplier=1e308,
        max_grad_norm=1e10,
        expected_batch_size=8,
    )
    before = {k: v.clone() for k, v in huge.state_dict().items()}
    with pytest.raises(NonFiniteError, match=r"step 1, stage \d: the noisy clipped gradient of"):
        huge.step(*data(8))  # the noise overflows: refused before the optimizer step
    assert all(torch.equal(before[k], v) for k, v in huge.state_dict().items())


@pytest.mark.parametrize(
    "bad_loss, message",
    [
        (lambda out, y: class_loss(out, y).detach(), "does not depend on the model"),
        (lambda out, y: class_loss(out, y).long(), "is not floating point"),
    ],
)
def test_a_loss_that_cannot_train_is_refused(bad_loss, message):
    t = PipelineDPTrainer(classifier(), bad_loss, stages=2, microbatches=2, expected_batch_size=8)
    with pytest.raises(BatchError, match=message):
        t.step(*data(8))


def test_fit_refuses_mismatched_data_and_a_negative_cap():
    x, y = data(60)
    with pytest.raises(PipeDPError, match="60 inputs but 100 targets"):
        trainer().fit((x, torch.cat([y, y[:40]])), steps=1)
    with pytest.raises(PipeDPError, match="max_logical_batch: must be >= 1"):
        trainer().fit((x, y), steps=1, max_logical_batch=-3)


def test_huge_but_finite_parameters_whose_sum_overflows_are_not_refused():
    """The finiteness check sums each tensor first; a finite tensor whose float32 sum overflows
    must pass (the exact per-element check decides), and one NaN among them must still be named."""
    net = classifier()
    first = next(net.parameters())
    with torch.no_grad():
        first.fill_(torch.finfo(first.dtype).max / 2)  # finite; its sum overflows to inf
    t = PipelineDPTrainer(
        net,
        class_loss,
        lambda p: torch.optim.SGD(p, lr=0.0),
        stages=2,
        microbatches=2,
        noise_multiplier=0.0,
        expected_batch_size=8,
    )
    t.step(*data(8))  # lr 0: the parameters stay finite, and the step is not refused
    assert bool(torch.isfinite(first).all()) and float(first.detach().sum()) == float("inf")
    with torch.no_grad():
        first[0, 0] = float("nan")
    with pytest.raises(NonFiniteError, match=r"step 2, stage 0: the value after the optimizer step of .*weight"):
        t.step(*data(8))
