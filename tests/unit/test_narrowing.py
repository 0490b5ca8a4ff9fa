"""The float32 sum narrowed to bf16 / fp16 inside its own storage (pipedp/train/narrowing.py): bit for bit
``.to(dtype)``, no copy of the tensor's size, and the unsafe cases fall back to a copy."""

import pytest
import torch

from pipedp.train.narrowing import narrow_in_storage, steps_without_temporaries


def _sums(n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(n)
    # values that round differently in bf16 and fp16, with overflow to inf in fp16
    return torch.randn(n, generator=g, dtype=torch.float32) * torch.logspace(-8, 6, n).float()


# the fast tier takes four corners of the grid (both dtypes, one element to a ragged 4099, pieces from 1 to
# bigger than the tensor); the other cases run with the slow tests (CI runs both)
CORNERS = {(torch.bfloat16, 1, 4), (torch.float16, 33, 1), (torch.bfloat16, 4099, 8), (torch.float16, 1000, 1 << 22)}
GRID = [
    pytest.param(dtype, n, piece, marks=() if (dtype, n, piece) in CORNERS else pytest.mark.slow)
    for dtype in (torch.bfloat16, torch.float16)
    for n in (1, 2, 3, 7, 8, 9, 31, 32, 33, 100, 257, 1000, 4099)
    for piece in (1, 4, 8, 1 << 22)
]


@pytest.mark.parametrize("dtype, n, piece", GRID)
def test_equal_to_a_copy_bit_for_bit(dtype, n, piece):
    total = _sums(n)
    expected = total.to(dtype)
    storage = total.untyped_storage().data_ptr()
    out = narrow_in_storage(total, dtype, piece)
    assert out.dtype == dtype and out.shape == total.shape
    assert out.untyped_storage().data_ptr() == storage  # in the sum's storage
    assert torch.equal(out.view(torch.int16), expected.view(torch.int16))  # bits (NaN-proof, -0 vs 0)


def test_shapes_are_kept():
    total = _sums(6 * 35).view(6, 35)
    expected = total.to(torch.bfloat16)
    assert torch.equal(narrow_in_storage(total, torch.bfloat16, piece=8), expected)


def _backwards(total: torch.Tensor, dtype: torch.dtype, piece: int) -> torch.Tensor:
    """A planted bug: the same pieces written from the end, so a piece's bf16 values overwrite float32
    values of an earlier piece before it is read (torch's overlap check does not see it: the bytes of each
    copy's source and destination are disjoint)."""
    n = total.numel()
    flat = total.view(-1)
    out = flat.view(dtype)[:n]
    for a in reversed(range(piece, n, piece)):
        out[a : a + piece].copy_(flat[a : a + piece])
    out[:piece].copy_(flat[:piece].to(dtype))
    return out.view(total.shape)


def test_the_planted_order_is_told_apart():
    total = _sums(64)
    expected = total.to(torch.bfloat16)
    assert not torch.equal(_backwards(total.clone(), torch.bfloat16, 8), expected)
    assert torch.equal(narrow_in_storage(total.clone(), torch.bfloat16, 8), expected)


def test_no_copy_of_the_tensors_size():
    n = 1 << 22
    total = _sums(n)
    expected = total.to(torch.bfloat16)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        out = narrow_in_storage(total, torch.bfloat16, piece=1 << 16)
    largest = max((e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0), default=0)
    assert largest <= 2 * (1 << 16)  # the first piece's bf16 temporary
    assert torch.equal(out, expected)
    # the planted bug "copy": the plain conversion allocates the whole bf16 tensor, which the profile sees
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        _sums(n).to(torch.bfloat16)
    assert max(e.cpu_memory_usage for e in prof.events()) >= 2 * n


@pytest.mark.parametrize(
    "make",
    [
        lambda: _sums(64)[:32],  # a view of a larger storage: other values live in the second half
        lambda: _sums(64)[8:],  # an offset
        lambda: _sums(64).view(8, 8).t(),  # not contiguous
        lambda: _sums(64)[:32].detach(),  # the same, without a _base: the storage is larger
        lambda: _sums(64)[8:].detach(),  # an offset, without a _base
        lambda: torch.empty(0),
    ],
)
def test_unsafe_tensors_are_copied(make):
    total = make()
    before = torch.empty(0, dtype=torch.uint8).set_(total.untyped_storage().__copy__())  # its storage's bytes
    expected = total.to(torch.bfloat16)
    out = narrow_in_storage(total, torch.bfloat16, piece=4)
    assert torch.equal(out, expected)
    after = torch.empty(0, dtype=torch.uint8).set_(total.untyped_storage())
    assert torch.equal(after, before)  # the storage it shares is untouched
    assert out.numel() == 0 or out.untyped_storage().data_ptr() != total.untyped_storage().data_ptr()


def test_an_alias_of_the_whole_storage_is_not_overwritten():
    # detach() shares the storage with no _base, no offset and the full size: only the use count tells
    total = _sums(64)
    alias = total.detach()
    expected = total.clone()
    out = narrow_in_storage(total, torch.bfloat16, piece=4)
    assert torch.equal(alias, expected) and torch.equal(out, expected.to(torch.bfloat16))
    del alias
    assert narrow_in_storage(expected, torch.bfloat16, 4).untyped_storage().data_ptr() == expected.data_ptr()


def test_not_a_narrowing_is_a_plain_conversion():
    total = _sums(10)
    assert narrow_in_storage(total, torch.float32) is total
    assert narrow_in_storage(total.double(), torch.bfloat16).dtype == torch.bfloat16


def test_which_optimizers_step_without_temporaries():
    p = [torch.nn.Parameter(torch.zeros(3))]
    assert steps_without_temporaries(torch.optim.SGD(p, lr=0.1, momentum=0.9))
    assert steps_without_temporaries(torch.optim.AdamW(p, fused=True))
    assert steps_without_temporaries(torch.optim.Adam(p, fused=True))
    assert not steps_without_temporaries(torch.optim.AdamW(p))
    assert not steps_without_temporaries(torch.optim.Adam(p, foreach=True))
    assert not steps_without_temporaries(torch.optim.RMSprop(p))
    for option in ({"weight_decay": 0.1}, {"nesterov": True, "momentum": 0.9}, {"maximize": True}):
        assert not steps_without_temporaries(torch.optim.SGD(p, lr=0.1, **option))  # a copy of every gradient
    # the groups' flags count: a state dict loaded from a run without the fused kernel turns it off
    fused, plain = torch.optim.AdamW(p, fused=True), torch.optim.AdamW(p)
    fused.load_state_dict(plain.state_dict())
    assert fused.param_groups[0]["fused"] is None and not steps_without_temporaries(fused)


@pytest.mark.parametrize(
    "optimizer, weight_decay", [("sgd", 0.0), ("sgd", 0.1), ("adamw", 0.0), ("adamw", 0.1), ("adam", 0.1)]
)
def test_the_planner_counts_a_copy_exactly_where_the_trainer_makes_one(optimizer, weight_decay):
    """The planner's model of the update (planner/static.py) and the trainer's choice (steps_without_temporaries on
    the optimizer the CLI builds) agree: narrowed in place, or a bf16 copy beside the sums."""
    from pipedp.cli.build import optimizer_factory
    from pipedp.cli.options import OptimizerConfig
    from pipedp.planner.static import static_bytes
    from pipedp.split.adapters import model_blocks

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)).to(torch.bfloat16)
    optim = OptimizerConfig(optimizer=optimizer, weight_decay=weight_decay)
    opt = optimizer_factory(optim, set(), list(model.parameters()))(list(model.parameters()))
    planned = static_bytes(model_blocks(model), optimizer, weight_decay=weight_decay)
    assert (planned.largest_copy == 0) == steps_without_temporaries(opt)
    assert steps_without_temporaries(opt) == (optimizer != "sgd" or weight_decay == 0)  # fused Adam on the CPU
