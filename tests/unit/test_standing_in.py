"""A stood-in (zero, stride-0) Linear weight gives exactly what a zero matrix gives, keeps the autograd graph
reaching the weight, and is never copied into a full matrix (split/hf_runs.py)."""

import contextlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from pipedp.split import hf_runs
from pipedp.split.hf_runs import reached_from, standing_in


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("autocast", [False, True])
def test_a_stood_in_linear_equals_a_zero_matrix(bias, autocast):
    layer = nn.Linear(5, 7, bias=bias)
    x = torch.randn(2, 3, 5, requires_grad=True)
    x.data[1, 2, 4] = float("nan")  # NaN rows stay NaN, as in the product
    zero_bias = torch.zeros(7) if bias else None
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        want = F.linear(x, torch.zeros(7, 5), zero_bias)
        with standing_in([layer], "cpu", real_too=True):
            got = layer(x)
            assert reached_from(got)(layer.weight)  # the stand-in, while it stands in
    assert got.dtype == want.dtype and got.shape == want.shape and got.is_contiguous()
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())


def test_the_stood_in_weight_is_never_copied_into_a_full_matrix(monkeypatch):
    layer = nn.Linear(2000, 2000, bias=False)  # 16 MB as a full float32 matrix

    def largest_allocation() -> int:
        with standing_in([layer], "cpu", real_too=True):
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                layer(torch.randn(2, 3, 2000))
        return max((e.cpu_memory_usage for e in prof.events()), default=0)

    assert largest_allocation() < 2000 * 2000 * 4 // 4
    monkeypatch.setattr(hf_runs, "_ZeroProducts", lambda stand_ins: contextlib.nullcontext())  # planted: no shortcut
    assert largest_allocation() >= 2000 * 2000 * 4
