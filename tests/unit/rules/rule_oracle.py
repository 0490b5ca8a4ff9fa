"""The oracle every rule test uses: the layer run on one sample at a time, autograd's gradient of
<output, output-gradient> for that sample alone."""

import torch


def per_sample_autograd(layer, inputs, backprops):
    """{param: [n, *shape]} from n separate backward passes through the layer alone."""
    params = [p for p in layer.parameters(recurse=False) if p.requires_grad]
    out = {p: [] for p in params}
    for i in range(backprops.shape[0]):
        sample = tuple(a[i : i + 1] for a in inputs)
        grads = torch.autograd.grad((layer(*sample) * backprops[i : i + 1]).sum(), params, allow_unused=True)
        for p, g in zip(params, grads):
            out[p].append(torch.zeros_like(p) if g is None else g)
    return {p: torch.stack(gs) for p, gs in out.items()}


def check_rule(layer, inputs, backprops, tol=1e-10):
    """The registered rule's per-sample gradients, norms and clipped sum against the oracle."""
    from pipedp.privacy.per_sample import add_clipped_grad_sum, clipped_grad_sum, ghost_squared_norms, per_sample_grads

    want = per_sample_autograd(layer, inputs, backprops)
    got = per_sample_grads(layer, inputs, backprops)
    assert set(got) == set(want)
    for p in want:
        assert torch.allclose(got[p].reshape(want[p].shape), want[p], atol=tol, rtol=tol)
    norms = ghost_squared_norms(layer, inputs, backprops)
    if norms is not None:
        for p in want:
            assert torch.allclose(norms[p], want[p].reshape(len(want[p]), -1).pow(2).sum(1), atol=tol, rtol=tol)
    factors = torch.linspace(0.2, 1.0, backprops.shape[0], dtype=backprops.dtype)
    scaled = backprops * factors.reshape((-1,) + (1,) * (backprops.dim() - 1))
    summed = clipped_grad_sum(layer, inputs, scaled)
    added = {}  # the in-place path W takes: unscaled backprops and the factors, into empty then running sums
    add_clipped_grad_sum(layer, inputs, backprops, factors, added)
    start = {p: torch.full_like(g, 0.5) for p, g in added.items()}
    running = {p: g.clone() for p, g in start.items()}
    add_clipped_grad_sum(layer, inputs, backprops, factors, running)
    for p in want:
        expected = (want[p] * factors.reshape((-1,) + (1,) * p.dim())).sum(0)
        assert torch.allclose(summed[p], expected, atol=tol, rtol=tol)
        assert torch.allclose(added[p], expected, atol=tol, rtol=tol)
        assert torch.allclose(running[p] - start[p], expected, atol=tol, rtol=tol)
    return norms is not None
