"""GramCache: one Gram matrix per captured input, never one shared by two different inputs."""

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from pipedp.privacy.rules.grams import GramCache, gram


def test_one_input_read_twice_is_computed_once():
    cache, a = GramCache(), torch.randn(2, 3, 4)
    assert cache.gram(a, a) is cache.gram(a, a)


def test_two_inputs_of_one_shape_get_their_own_matrices():
    cache, a, b = GramCache(), torch.randn(2, 3, 4), torch.randn(2, 3, 4)
    torch.testing.assert_close(cache.gram(a, a), gram(a))
    torch.testing.assert_close(cache.gram(b, b), gram(b))


def test_fake_tensors_of_one_shape_get_their_own_matrices():
    # the planner simulates on fake tensors, whose data_ptr() all read 0: a key on it would merge them
    with FakeTensorMode():
        cache, a, b = GramCache(), torch.randn(2, 3, 4), torch.randn(2, 3, 4)
        assert cache.gram(a, a) is not cache.gram(b, b)


def test_a_converted_capture_is_keyed_by_the_dtype_of_the_arithmetic():
    cache, captured = GramCache(), torch.randn(2, 3, 4, dtype=torch.bfloat16)
    wide = cache.gram(captured, captured.double())
    assert wide.dtype == torch.float64
    assert cache.gram(captured, captured.float()).dtype == torch.float32
