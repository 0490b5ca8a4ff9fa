"""The mixture-of-experts rules (router and fused expert bank) against per-sample autograd through the
bank's own forward, one sample's tokens at a time (the rules read [n, T, ...]; the bank takes [T, ...])."""

import pytest
import torch

from pipedp.privacy.per_sample import clipped_grad_sum, ghost_squared_norms, per_sample_grads
from pipedp.privacy.rules import EXPERTS, ROUTER, register, rule_for

transformers = pytest.importorskip("transformers")


def block(family: str, **config):
    from hf_families import Family, tiny_config

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        tiny_config(Family(family, config=config)), experts_implementation="eager"
    ).double()
    moe = next(m for m in model.modules() if hasattr(m, "experts"))
    router = moe.gate if hasattr(moe, "gate") else moe.router
    register(type(router), ROUTER), register(type(moe.experts), EXPERTS)
    return router, moe.experts


def routed(router, n=4, t=5):
    hidden = torch.randn(n, t, router.weight.shape[1], dtype=torch.float64)
    _, weights, index = router(hidden.reshape(n * t, -1))
    return hidden, index.reshape(n, t, -1), weights.detach().reshape(n, t, -1)


def oracle(layer, inputs, backprops):
    """{param: [n, *shape]}: each sample's tokens through the layer alone, flattened as the block calls it."""
    params = [p for p in layer.parameters() if p.requires_grad]
    out = {p: [] for p in params}
    for i in range(backprops.shape[0]):
        output = layer(*(a[i] for a in inputs))
        output = output[0] if isinstance(output, tuple) else output
        grads = torch.autograd.grad((output * backprops[i]).sum(), params, allow_unused=True)
        for p, g in zip(params, grads):
            out[p].append(torch.zeros_like(p) if g is None else g)
    return {p: torch.stack(gs) for p, gs in out.items()}


def check(layer, inputs, backprops):
    matches(layer, inputs, backprops, oracle(layer, inputs, backprops))


def matches(layer, inputs, backprops, want, rtol=1e-10):
    """The rule's per-sample gradients, ghost norms and clipped sum of [n, P, ...] backprops against ``want``."""
    got = per_sample_grads(layer, inputs, backprops)
    assert set(got) == set(want)
    for p in want:
        assert torch.allclose(got[p], want[p], atol=1e-12, rtol=rtol)
    norms = ghost_squared_norms(layer, inputs, backprops)
    assert norms is not None
    for p in want:
        assert torch.allclose(norms[p], want[p].reshape(len(want[p]), -1).pow(2).sum(1), atol=1e-12, rtol=rtol)
    factors = torch.linspace(0.2, 1.0, backprops.shape[0], dtype=backprops.dtype)
    summed = clipped_grad_sum(layer, inputs, backprops * factors.reshape(-1, 1, 1))
    for p in want:
        assert torch.allclose(summed[p], (want[p] * factors.reshape((-1,) + (1,) * p.dim())).sum(0), atol=1e-12)


@pytest.mark.parametrize(
    "family, config",
    [
        ("mixtral", {}),  # gate_up [E, 2h, d] concatenated, SiLU gate
        ("mixtral", {"num_experts_per_tok": 1}),
        ("mixtral", {"num_experts_per_tok": 3}),
        ("aria_text", {}),  # transposed [E, d, 2h]
        ("gpt_oss", {}),  # transposed, interleaved gate and up, biases, a clamped gate
    ],
)
def test_the_bank_and_its_router_match_per_sample_autograd(family, config):
    router, bank = block(family, **config)
    assert rule_for(bank).name == "experts" and rule_for(router).name == "router"
    hidden, index, weights = routed(router)
    check(bank, (hidden, index, weights), torch.randn_like(hidden))
    logits = router(hidden.reshape(-1, hidden.shape[-1]))[0]
    check(router, (hidden,), torch.randn(*hidden.shape[:2], logits.shape[-1], dtype=torch.float64))


def test_a_frozen_projection_is_left_out():
    router, bank = block("mixtral")
    bank.gate_up_proj.requires_grad_(False)
    hidden, index, weights = routed(router)
    check(bank, (hidden, index, weights), torch.randn_like(hidden))
