"""The ranks' weight checksum, summed a piece at a time, equals the float64 sum of the weights; the sums over
replicas go in bounded buckets."""

import torch

from pipedp.runtime import distributed


def test_checksum_in_pieces_equals_the_float64_sum(monkeypatch):
    monkeypatch.setattr(distributed, "CHECKSUM_PIECE", 100)  # every tensor below spans several pieces
    torch.manual_seed(0)
    params = [torch.randn(37, 29).to(torch.bfloat16), torch.randn(1000), torch.randn(3, 5, 7, dtype=torch.float64)]
    want = sum(float(p.double().sum()) for p in params)
    got = distributed._checksum(params)
    assert abs(got - want) <= 1e-9 * sum(float(p.double().abs().sum()) for p in params)
    params[1][999] += 1.0  # a changed weight in the last piece changes the sum
    assert distributed._checksum(params) != got


def test_replica_sums_go_in_buckets_of_one_dtype_and_bounded_size(monkeypatch):
    monkeypatch.setattr(distributed, "BUCKET", 10)
    a, b, c = torch.zeros(4), torch.zeros(6), torch.zeros(3)
    big, half = torch.zeros(25), torch.zeros(2, dtype=torch.float64)
    buckets = distributed._buckets([a, b, c, big, half])
    assert [[id(t) for t in bucket] for bucket in buckets] == [[id(a), id(b)], [id(c)], [id(big)], [id(half)]]
