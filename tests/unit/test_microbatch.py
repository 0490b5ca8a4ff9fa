"""Milliseconds: how a logical batch becomes passes of static micro-batches, and privacy units of rows."""

import pytest
import torch

from pipedp import BatchError
from pipedp.privacy.units import Units
from pipedp.runtime.microbatch import make_pass, microbatch_size_for, pass_slices, replica_rows


def test_a_pass_is_padded_with_masked_copies_of_the_last_row():
    x, y = torch.arange(5.0).reshape(5, 1), torch.arange(5)
    batch = make_pass(x, y, microbatches=2, size=3)
    assert [m.tolist() for m in batch.masks] == [[1, 1, 1], [1, 1, 0]]
    assert batch.inputs[1][:, 0].tolist() == [3.0, 4.0, 4.0] and batch.targets[1].tolist() == [3, 4, 4]
    with pytest.raises(BatchError, match="do not fit"):
        make_pass(x, y, microbatches=2, size=2)


def test_dict_inputs_are_cut_row_wise():
    ids = torch.arange(12).reshape(6, 2)
    batch = make_pass({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, ids, microbatches=3, size=2)
    assert [b["input_ids"].tolist() for b in batch.inputs] == [[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[8, 9], [10, 11]]]


def test_passes_and_sizes():
    assert pass_slices(0, 4, None) == []
    assert pass_slices(10, 4, None) == [slice(0, 10)]
    assert pass_slices(10, 2, 3) == [slice(0, 6), slice(6, 10)]  # static micro-batches: several passes
    assert microbatch_size_for(10, 4, None) == 3 and microbatch_size_for(10, 4, 8) == 8


def test_replicas_take_contiguous_near_equal_rows():
    assert [replica_rows(10, 3, r) for r in range(3)] == [slice(0, 4), slice(4, 7), slice(7, 10)]


def test_units_fold_rows_into_positions_and_expand_back():
    units = Units(3)
    t = torch.arange(2 * 3 * 4 * 5.0).reshape(6, 4, 5)  # 2 units of 3 rows, 4 positions, 5 features
    assert units.fold(t).shape == (2, 12, 5) and torch.equal(units.fold(t)[1, :4], t[3])
    ids = torch.arange(12).reshape(6, 2)
    assert units.fold(ids).shape == (2, 6) and units.fold(torch.arange(6)).shape == (2, 3)
    assert units.expand(torch.tensor([1.0, 2.0])).tolist() == [1, 1, 1, 2, 2, 2]
    assert units.mask(torch.tensor([1.0, 0, 0, 0, 0, 0])).tolist() == [1, 0]
    assert units.group_sum(torch.ones(6, 2)).tolist() == [[3, 3], [3, 3]]
    assert units.row_index(torch.tensor([1])).tolist() == [3, 4, 5]
    with pytest.raises(BatchError, match="whole privacy units of 3 rows"):
        units.count(7)
