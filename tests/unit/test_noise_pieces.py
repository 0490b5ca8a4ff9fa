"""The noise drawn a piece at a time, in place, equals Opacus's one whole draw (privacy/noise.py)."""

import pytest
import torch
from opacus.optimizers.optimizer import _generate_noise

from pipedp.privacy import noise
from pipedp.privacy.streams import Stream, name_key, stream_seed


def opacus_noise(shape, dtype, std, seed, step, name):
    generator = torch.Generator()
    generator.manual_seed(stream_seed(Stream.NOISE, seed, step, name_key(name)))
    return _generate_noise(std=std, reference=torch.zeros(shape, dtype=dtype), generator=generator)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("numel", [1, 15, 16, 17, 63, 64, 65, 79, 80, 81, 128, 200, 1000])
def test_pieces_equal_one_draw(monkeypatch, dtype, numel):
    monkeypatch.setattr(noise, "PIECE", 64)  # many pieces, every remainder case
    shape = (numel,) if numel % 5 else (numel // 5, 5)
    base = torch.randn(shape, dtype=dtype)
    got = base.clone()
    noise.add_noise([got], ["w"], 0.7, seed=3, step=11)
    assert torch.equal(got, base + opacus_noise(shape, dtype, 0.7, 3, 11, "w"))


def test_real_piece_size_equals_one_draw():
    shape = (2 * noise.PIECE // 1024 + 1, 1024)  # three pieces, the last one 1024 elements
    got = torch.zeros(shape)
    noise.add_noise([got], ["lm_head.weight"], 1.3, seed=0, step=5)
    assert torch.equal(got, opacus_noise(shape, torch.float32, 1.3, 0, 5, "lm_head.weight"))


def test_a_non_contiguous_sum_gets_one_draw():
    got = torch.zeros(40, 30).t()  # noise added to a transposed view, in its own (logical) order
    noise.add_noise([got], ["w"], 1.0, seed=1, step=0)
    assert torch.equal(got, opacus_noise((30, 40), torch.float32, 1.0, 1, 0, "w"))


def test_planted_misaligned_pieces_are_caught(monkeypatch):
    """Pieces that are not multiples of 16 draw other values: the comparison above would catch a
    piece size that breaks the equality."""
    monkeypatch.setattr(noise, "PIECE", 40)
    got = torch.zeros(200)
    noise.add_noise([got], ["w"], 1.0, seed=0, step=0)
    assert not torch.equal(got, opacus_noise((200,), torch.float32, 1.0, 0, 0, "w"))


def test_each_parameter_its_own_stream_and_secure_mode_in_place():
    a, b = torch.zeros(300), torch.zeros(300)
    noise.add_noise([a, b], ["a", "b"], 1.0, seed=0, step=0)
    assert not torch.equal(a, b)
    secure = torch.zeros(5000, dtype=torch.float64)
    view = secure
    noise.add_noise([secure], ["a"], 2.0, seed=0, step=0, secure_mode=True)
    assert secure is view and 1.6 < float(secure.std()) < 2.4


@pytest.mark.parametrize(
    "shape, dim, ranks",
    [((10, 12), 0, 2), ((10, 12), 1, 3), ((7, 9), 1, 3), ((40,), 0, 4), ((5, 6, 4), 1, 2), ((33, 5), 1, 5)],
)
def test_each_tensor_parallel_slice_gets_exactly_its_part_of_the_whole_noise(monkeypatch, shape, dim, ranks):
    """Pieces of 64 elements: slices whose rows straddle pieces, pieces spanning whole rows, the short last piece."""
    from pipedp.shards import Shard

    monkeypatch.setattr(noise, "PIECE", 64)
    whole = torch.zeros(shape, dtype=torch.float64)
    noise.add_noise([whole], ["w"], 1.0, 3, 2)
    for t in range(ranks):
        shard = Shard.even(shape, dim, t, ranks)
        mine = torch.zeros(shard.shape, dtype=torch.float64)
        noise.add_noise([mine], ["w"], 1.0, 3, 2, shards=[shard])
        assert torch.equal(mine, shard.of(whole))


@pytest.mark.parametrize("source", ["chacha20", "urandom"])
def test_secure_noise_is_standard_normal_times_std_from_either_source(monkeypatch, source):
    """Both secure sources give N(0, std^2): the mean within 5 standard errors, the std within 2% (2e5 draws:
    its standard error is 0.16%), the tails as a normal's (P(|z| > 3) = 0.27%), no two draws alike."""
    import math
    import os

    from pipedp.privacy import secure

    read = []
    real = os.urandom
    monkeypatch.setattr(os, "urandom", lambda n: read.append(n) or real(n))
    if source == "urandom":
        monkeypatch.setattr(secure, "Cipher", None)
    elif secure.Cipher is None:
        pytest.skip("the cryptography package is not installed")
    z = secure.secure_gaussian_like(torch.zeros(200_000, dtype=torch.float64), 3.0) / 3.0
    assert abs(float(z.mean())) < 5 / math.sqrt(z.numel()) and abs(float(z.std()) - 1) < 0.02
    assert 0.0022 < float((z.abs() > 3).double().mean()) < 0.0032
    assert not torch.equal(z, secure.secure_gaussian_like(torch.zeros(200_000, dtype=torch.float64), 3.0) / 3.0)
    # chacha20 reads a 256-bit key and a nonce from the OS per draw; urandom reads every bit (8 bytes per uniform)
    # chacha20: a fresh key and nonce per draw (the second draw reads them again)
    assert read[:4] == [32, 16, 32, 16] if source == "chacha20" else read[0] == 8 * 4 * 200_000


def test_secure_noise_sums_four_draws_per_coordinate(monkeypatch):
    """Holohan & Braghin's fix against floating-point attacks (as Opacus's secure mode): each coordinate is the
    sum of 2n = 4 Gaussians halved, so 4 standard normals are drawn per coordinate."""
    from pipedp.privacy import secure

    asked = []
    real = secure._standard_normal
    monkeypatch.setattr(secure, "_standard_normal", lambda count, device: asked.append(count) or real(count, device))
    secure.secure_gaussian_like(torch.zeros(10), 1.0)
    assert asked == [40]


def test_secure_noise_on_an_empty_tensor_is_nothing():
    from pipedp.privacy.sampling import poisson_indices

    empty = torch.zeros(0)
    noise.add_noise([empty], ["a"], 1.0, seed=0, step=0, secure_mode=True)
    assert empty.numel() == 0 and poisson_indices(0, 0.5, 0, 0, True).numel() == 0
