"""The ranks' weight checksum, summed a piece at a time, equals the float64 sum of the weights."""

import types

import torch

from pipedp.runtime import distributed


def test_checksum_in_pieces_equals_the_float64_sum(monkeypatch):
    monkeypatch.setattr(distributed, "CHECKSUM_PIECE", 100)  # every tensor below spans several pieces
    torch.manual_seed(0)
    params = [torch.randn(37, 29).to(torch.bfloat16), torch.randn(1000), torch.randn(3, 5, 7, dtype=torch.float64)]
    want = sum(float(p.double().sum()) for p in params)
    got = distributed._checksum(types.SimpleNamespace(parameters=params))
    assert abs(got - want) <= 1e-9 * sum(float(p.double().abs().sum()) for p in params)
    params[1][999] += 1.0  # a changed weight in the last piece changes the sum
    assert distributed._checksum(types.SimpleNamespace(parameters=params)) != got
