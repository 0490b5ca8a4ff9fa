"""Llama-4's experts (every token through every expert) and its scoring router
(privacy/rules/dense_experts.py) against per-sample autograd through the modules' own forwards."""

import pytest
import torch
from test_experts import matches

from pipedp.privacy.rules import register, rule_for
from pipedp.privacy.rules.dense_experts import DENSE_EXPERTS, SCORING_ROUTER

transformers = pytest.importorskip("transformers")


def llama4_moe():
    from hf_families import Family, tiny_config

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(Family("llama4_text"))).double()
    moe = model.model.layers[0].feed_forward
    register(type(moe.router), SCORING_ROUTER), register(type(moe.experts), DENSE_EXPERTS)
    return moe


def oracle(call, params, n, backprops):
    """{param: [n, *shape]}: sample i's gradient by autograd through ``call(i)``."""
    out = {p: [] for p in params}
    for i in range(n):
        grads = torch.autograd.grad((call(i) * backprops[i]).sum(), params, allow_unused=True)
        for p, g in zip(params, grads):
            out[p].append(torch.zeros_like(p) if g is None else g)
    return {p: torch.stack(gs) for p, gs in out.items()}


def test_the_bank_every_token_passes_through_matches_per_sample_autograd():
    moe = llama4_moe()
    bank, count, n, t = moe.experts, moe.num_experts, 3, 4
    assert rule_for(bank).name == "experts (every token)"
    hidden = torch.randn(n, t, bank.hidden_size, dtype=torch.float64)
    scores = moe.router(hidden.reshape(n * t, -1))[0].detach().reshape(n, t, count)  # zero where not routed
    routed = hidden.unsqueeze(1) * scores.permute(0, 2, 1).unsqueeze(-1)  # [n, E, T, d]: sample i, expert e
    backprops = torch.randn_like(routed)
    params = [bank.gate_up_proj, bank.down_proj]
    want = oracle(lambda i: bank(routed[i].reshape(count * t, -1)).reshape(count, t, -1), params, n, backprops)
    # the capture's fold: [E n T, d] flattened expert-first, held [n, T E, d]
    folded = [v.transpose(1, 2).reshape(n, t * count, -1) for v in (routed, backprops)]
    matches(bank, (folded[0],), folded[1], want, rtol=1e-9)


def test_the_scoring_router_matches_per_sample_autograd_through_its_own_forward():
    moe = llama4_moe()
    router, n, t = moe.router, 3, 4
    assert rule_for(router).name == "router (scores)"
    hidden = torch.randn(n, t, router.in_features, dtype=torch.float64)
    backprops = torch.randn(n, t, router.out_features, dtype=torch.float64)
    want = oracle(lambda i: router(hidden[i])[0], [router.weight], n, backprops)
    with torch.no_grad():
        logits = router(hidden.reshape(n * t, -1))[1].reshape(n, t, -1)  # (the capture keeps the forward's own)
    matches(router, (hidden, logits), backprops, want, rtol=1e-9)
