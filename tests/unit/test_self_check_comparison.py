"""The self-check's comparison of one row's gradients (pipedp/runtime/self_check.py), alone: what it refuses,
and the one case it may not judge (a micro-batch holding a sample with a non-finite gradient)."""

import pytest
import torch
import torch.nn as nn

from pipedp.errors import UnsupportedModelError
from pipedp.runtime import self_check
from pipedp.runtime.self_check import Comparison


def _add(comparison, want, have):
    p = nn.Parameter(torch.zeros(3, dtype=torch.float64))
    squared = float(have.pow(2).sum()) if torch.isfinite(have).all() else float("nan")
    scale = float(want.norm())
    comparison.add(p, "w", ("layer", "Linear"), True, want, have, squared, scale)


def _no_sums():
    return {}, {}


def test_equal_gradients_pass_and_a_planted_difference_is_refused():
    ok = Comparison(0, torch.float64)
    _add(ok, torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64), torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64))
    ok.refuse_if_any(_no_sums)
    bad = Comparison(0, torch.float64)
    _add(bad, torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64), torch.tensor([1.0, 2.0, 3.1], dtype=torch.float64))
    with pytest.raises(UnsupportedModelError, match="stage 0: the gradient of w"):
        bad.refuse_if_any(_no_sums)


def test_a_non_finite_reference_is_a_mismatch_unless_a_sample_of_the_micro_batch_is_non_finite():
    nan = torch.tensor([float("nan"), 1.0, 1.0], dtype=torch.float64)
    have = torch.tensor([1.0, 1.0, 1.0], dtype=torch.float64)
    strict = Comparison(0, torch.float64)  # pipedp saw every norm finite: a NaN only autograd sees is a bug
    _add(strict, nan, have)
    with pytest.raises(UnsupportedModelError):
        strict.refuse_if_any(_no_sums)
    tainted = Comparison(1, torch.float64)
    tainted.non_finite_units = True  # a sample left out of the update made this row's reference NaN
    _add(tainted, nan, have)
    with pytest.warns(UserWarning, match="stage 1: the self-check could not verify w for this input shape"):
        tainted.refuse_if_any(_no_sums)


def test_a_parameter_with_a_finite_gradient_is_still_judged_beside_a_non_finite_one():
    """The row's scale (the absolute floor's unit) leaves the non-finite tensor out, so a finite parameter's
    agreement is not lost to a NaN floor, and its planted difference is still found."""
    nan = {nn.Parameter(torch.zeros(1)): torch.tensor([float("nan")], dtype=torch.float64)}
    finite = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    scale = Comparison.scale({**nan, nn.Parameter(torch.zeros(3)): finite})
    assert scale == float(finite.norm())
    tainted = Comparison(0, torch.float64)
    tainted.non_finite_units = True
    p = nn.Parameter(torch.zeros(3, dtype=torch.float64))
    tainted.add(p, "w", ("layer", "Linear"), True, finite, finite.clone(), float(finite.pow(2).sum()), scale)
    tainted.refuse_if_any(_no_sums)  # agreement: nothing to refuse
    tainted.add(p, "w", ("layer", "Linear"), True, finite, finite + 0.1, float(finite.pow(2).sum()), scale)
    with pytest.raises(UnsupportedModelError):
        tainted.refuse_if_any(_no_sums)


def test_norms_in_pieces_equal_the_whole_float64_norms(monkeypatch):
    monkeypatch.setattr(self_check, "PIECE", 7)  # several pieces, the last one short
    torch.manual_seed(0)
    want, have = torch.randn(5, 9), torch.randn(5, 9).to(torch.bfloat16)
    w, h = want.double(), have.double()
    expected = (float(w.norm()), float(h.norm()), float((h - w).norm()))
    for got, exact in zip(self_check._norms(want, have), expected):
        assert abs(got - exact) <= 1e-12 * exact
    size, _, error = self_check._norms(None, have)  # a gradient pipedp has and autograd does not
    assert size == 0 and abs(error - expected[1]) <= 1e-12 * expected[1]
    size, have_size, error = self_check._norms(want, None)
    assert have_size == 0 and abs(error - expected[0]) <= 1e-12 * expected[0] and size == error


def test_a_layer_computing_in_float32_in_a_float64_stage_is_judged_at_float32s_tolerance_and_no_looser():
    want = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    rounded = want * (1 + 1e-6)  # float32 rounding, as a router computing its logits in float32 gives
    planted = want * (1 + 1e-2)  # a bug

    def judged(have, computed_in):
        comparison = Comparison(0, torch.float64)
        p = nn.Parameter(torch.zeros(3, dtype=torch.float64))
        squared = float(have.pow(2).sum())
        comparison.add(p, "w", ("gate", "Router"), True, want, have, squared, float(want.norm()), computed_in)
        comparison.refuse_if_any(_no_sums)

    judged(rounded, {torch.float32})
    cases = ((rounded, None), (rounded, {torch.float64}), (rounded, {torch.float32, torch.float64}))
    for have, computed_in in (*cases, (planted, {torch.float32})):
        with pytest.raises(UnsupportedModelError, match="stage 0: the gradient of w"):
            judged(have, computed_in)
