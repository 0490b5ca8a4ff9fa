"""GramCache: one Gram matrix per captured tensor several layers read (an input, an output-gradient), never one
shared by two different tensors."""

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from pipedp.privacy.rules.grams import GramCache, gram, shared_storages
from pipedp.privacy.rules.linear import LINEAR


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


def test_a_parallel_residuals_two_projections_compute_one_output_gradient_gram():
    # attention and MLP outputs summed: autograd hands both projections one gradient tensor; the Linear rule reads
    # its Gram from the cache (and its input's: both read x), and each norm is still the per-sample gradient's
    x = torch.randn(2, 6, 8, dtype=torch.float64, requires_grad=True)  # (T^2 <= 8 x 8: ghost norms)
    attention, mlp = torch.nn.Linear(8, 8).double(), torch.nn.Linear(8, 8).double()
    outputs = [attention(x), mlp(x)]
    grads = torch.autograd.grad((outputs[0] + outputs[1]).square().sum(), outputs)
    a = x.detach()
    cache = GramCache(shared_storages([a, grads[0], a, grads[1]]))
    norms = [LINEAR.norms(layer, [a], g, cache) for layer, g in zip((attention, mlp), grads)]
    assert len(cache._grams) == 2  # one input Gram, one output-gradient Gram
    for layer, g, got in zip((attention, mlp), grads, norms):
        per_sample = torch.einsum("nto,nti->noi", g, a)  # sum_t g_t a_t^T of each sample
        torch.testing.assert_close(got[layer.weight], per_sample.pow(2).sum((1, 2)))


def test_only_tensors_several_layers_read_keep_their_gram():
    a, b = torch.randn(2, 3, 4), torch.randn(2, 3, 4)
    cache = GramCache(shared_storages([a, b, b]))
    assert cache.gram(a, a) is not cache.gram(a, a)  # read by one layer: computed, not held
    assert cache.gram(b, b) is cache.gram(b, b)
    assert len(cache._grams) == 1
