"""Reading safetensors straight into allocated tensors equals safetensors' own reader, and a damaged file
or a wrong shape is refused by name (split/safetensors_read.py)."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipedp.errors import CheckpointError
from pipedp.split.safetensors_read import read_into

TENSORS = {
    "bf16": torch.randn(7, 5).to(torch.bfloat16),
    "f32": torch.randn(3, 4, 2),
    "f64": torch.randn(6, dtype=torch.float64),
    "f16": torch.randn(2, 3).half(),
    "i64": torch.arange(9).reshape(3, 3),
    "bool": torch.tensor([True, False, True]),
    "scalar": torch.tensor(2.5),
    "empty": torch.zeros(0, 4),
}


@pytest.fixture
def stored(tmp_path):
    path = str(tmp_path / "w.safetensors")
    save_file(TENSORS, path, metadata={"format": "pt"})
    return path


def test_read_into_equals_safetensors(stored):
    want = load_file(stored)
    targets = {k: torch.empty_like(v).fill_(7) if v.numel() else torch.empty_like(v) for k, v in want.items()}
    read_into(stored, [(t, k) for k, t in targets.items()])
    for k, v in want.items():
        assert targets[k].dtype == v.dtype and torch.equal(targets[k], v), k


def test_another_dtype_or_layout_is_copied_through_safetensors(stored, tmp_path):
    as_f32 = torch.empty(7, 5)  # the file holds bf16: converted, as load_state_dict would
    read_into(stored, [(as_f32, "bf16")])
    assert torch.equal(as_f32, TENSORS["bf16"].float())
    other = str(tmp_path / "x.safetensors")
    save_file({"x": torch.arange(24.0).reshape(4, 2, 3)}, other)
    permuted = torch.empty(2, 3, 4).permute(2, 0, 1)  # shape (4, 2, 3), not contiguous: its bytes are not in order
    read_into(other, [(permuted, "x")])
    assert torch.equal(permuted, torch.arange(24.0).reshape(4, 2, 3))


def test_a_wrong_shape_is_refused_by_name(stored):
    with pytest.raises(CheckpointError, match=r"'f32'.*\(3, 4, 2\).*\(4, 3, 2\)"):
        read_into(stored, [(torch.empty(4, 3, 2), "f32")])


def test_a_truncated_file_is_refused(stored, tmp_path):
    cut = str(tmp_path / "cut.safetensors")
    with open(stored, "rb") as f, open(cut, "wb") as g:
        g.write(f.read()[:-8])  # the bytes of the tensor stored last end early
    with pytest.raises(CheckpointError, match="ends early"):
        read_into(cut, [(torch.empty_like(v), k) for k, v in TENSORS.items()])


@pytest.mark.parametrize(
    "name,dim,start,stop", [("bf16", 0, 2, 5), ("bf16", 1, 1, 4), ("f32", 1, 1, 3), ("f32", 2, 1, 2)]
)
def test_a_stored_slice_equals_the_whole_tensor_s_slice(stored, name, dim, start, stop):
    from pipedp.shards import Shard
    from pipedp.split.safetensors_read import Stored

    whole = load_file(stored)[name]
    part = Stored(stored, name).read(Shard(tuple(whole.shape), dim, start, stop), torch.float64)
    assert part.dtype == torch.float64 and part.is_contiguous()
    assert torch.equal(part, whole.narrow(dim, start, stop - start).double())


def test_a_stored_slice_of_another_shape_is_refused_by_name(stored):
    from pipedp.shards import Shard
    from pipedp.split.safetensors_read import Stored

    with pytest.raises(CheckpointError, match="'bf16': the weights hold shape"):
        Stored(stored, "bf16").read(Shard((8, 5), 0, 0, 4), torch.bfloat16)
