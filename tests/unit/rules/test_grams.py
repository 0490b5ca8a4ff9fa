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


def test_an_entry_holds_its_tensor_so_no_later_tensor_takes_its_address():
    # a privacy unit's folding copies a non-contiguous capture into a temporary freed after its layer; were the
    # entry keyed by that address alone, the next layer's copy of the same shape could land there and read it
    cache = GramCache()
    for seed in range(20):
        temporary = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(seed)).transpose(0, 1).reshape(2, 3, 4)
        torch.testing.assert_close(cache.gram(temporary, temporary), gram(temporary))
        del temporary


def test_an_output_gradient_two_layers_share_is_one_matrix():
    # a parallel residual (attention + MLP summed): autograd hands both layers one gradient tensor
    x = torch.randn(2, 3, 4, requires_grad=True)
    attention, mlp = torch.nn.Linear(4, 5), torch.nn.Linear(4, 5)
    outputs = [attention(x), mlp(x)]
    grads = torch.autograd.grad((outputs[0] + outputs[1]).square().sum(), outputs)
    assert grads[0].untyped_storage()._cdata == grads[1].untyped_storage()._cdata
    cache = GramCache()
    assert cache.gram(grads[0], grads[0]) is cache.gram(grads[1], grads[1])
