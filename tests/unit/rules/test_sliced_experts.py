"""DBRX's experts, row slices of [E h, d] matrices (privacy/rules/sliced_experts.py), against per-sample
autograd through the bank's own forward, one sample's tokens at a time, its gate, up and down projections each
trained or frozen."""

import pytest
import torch
from test_experts import matches

from pipedp.privacy.rules import register, rule_for
from pipedp.privacy.rules.sliced_experts import SLICED_EXPERTS

transformers = pytest.importorskip("transformers")


def dbrx_bank():
    from hf_families import build, family

    bank = build(family("dbrx")).transformer.blocks[0].ffn.experts
    register(type(bank), SLICED_EXPERTS)
    return bank


def oracle(bank, hidden, index, weights, backprops):
    """{param: [n, *shape]}: sample i's gradient by autograd through the bank's forward on its tokens alone."""
    params = [p for p in bank.parameters() if p.requires_grad]
    out = {p: [] for p in params}
    for i in range(hidden.shape[0]):
        output = bank(hidden[i : i + 1], index[i], weights[i])  # (DBRX's bank: [1, T, d] with [T, k] routing)
        grads = torch.autograd.grad((output * backprops[i : i + 1]).sum(), params, allow_unused=True)
        for p, g in zip(params, grads):
            out[p].append(torch.zeros_like(p) if g is None else g)
    return {p: torch.stack(gs) for p, gs in out.items()}


@pytest.mark.parametrize("frozen", [None, "w1", "w2"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_the_sliced_bank_matches_per_sample_autograd(k, frozen):
    bank = dbrx_bank()
    assert rule_for(bank).name == "sliced experts"
    if frozen:
        getattr(bank.mlp, frozen).requires_grad_(False)
    n, t, d = 3, 5, bank.hidden_size
    g = torch.Generator().manual_seed(k)
    hidden = torch.randn(n, t, d, generator=g, dtype=torch.float64)
    index = torch.rand(n, t, bank.num_experts, generator=g).argsort(-1)[..., :k]  # k distinct experts a token
    weights = torch.rand(n, t, k, generator=g, dtype=torch.float64) + 0.5
    backprops = torch.randn(n, t, d, generator=g, dtype=torch.float64)
    want = oracle(bank, hidden, index, weights, backprops)
    matches(bank, (hidden, index, weights), backprops, want)
