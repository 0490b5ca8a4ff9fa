"""PEFT's LoRA on an expert bank's weights (privacy/rules/expert_lora.py) against per-sample autograd
through PEFT's own wrapped bank, one sample's tokens at a time, as the bank's rule is tested."""

import pytest
import torch
from test_dense_experts import llama4_moe, oracle
from test_experts import block, check, matches, routed

from pipedp.privacy.rules import rule_for
from pipedp.privacy.rules.expert_lora import is_lora_wrapper, wrapped_bank

peft = pytest.importorskip("peft")


def adapted(family: str, weights=("gate_up_proj", "down_proj"), **config):
    """The family's first bank under PEFT's LoRA wrappers (random factors, rank 2), and its router."""
    router, bank = block(family, **config)
    holder = torch.nn.Module()
    holder.experts = bank
    names = [w if hasattr(bank, w) else "up_proj" for w in weights]
    lora = peft.LoraConfig(r=2, target_parameters=[f"experts.{w}" for w in names], init_lora_weights=False)
    return router, peft.get_peft_model(holder, lora).base_model.model.experts


@pytest.mark.parametrize(
    "family, weights",
    [
        ("mixtral", ("gate_up_proj", "down_proj")),  # [E, out, in], two nested wrappers
        ("mixtral", ("down_proj",)),
        ("aria_text", ("gate_up_proj", "down_proj")),  # transposed [E, in, out]
    ],
)
def test_the_factors_match_per_sample_autograd_through_peft(family, weights):
    router, outer = adapted(family, weights)
    assert is_lora_wrapper(outer) and not is_lora_wrapper(wrapped_bank(outer))
    assert rule_for(outer).name == "experts+lora" and rule_for(outer).holds_below
    hidden, index, route = routed(router)
    with torch.no_grad():
        out = outer(hidden.reshape(-1, hidden.shape[-1]), index.reshape(-1, index.shape[-1]), route.reshape(-1, 2))
    check(outer, (hidden, index, route), torch.randn_like(out).reshape(hidden.shape))


def test_the_bank_beside_its_factors_matches_too():
    router, outer = adapted("mixtral", ("down_proj",))
    wrapped_bank(outer).gate_up_proj.requires_grad_(True)
    hidden, index, route = routed(router)
    check(outer, (hidden, index, route), torch.randn_like(hidden))


@pytest.mark.parametrize("weights", [("gate_up_proj", "down_proj"), ("down_proj",)])
def test_peft_lora_on_the_bank_every_token_passes_through_matches_per_sample_autograd(weights):
    """PEFT reads the [E, in, out] weights as [E, out, in] (privacy/rules/expert_lora.py): both factors of each
    adapted weight, and the bank's other weight trained beside them, against autograd through PEFT's wrappers."""
    moe = llama4_moe()
    holder = torch.nn.Module()
    holder.experts = moe.experts
    lora = peft.LoraConfig(r=2, target_parameters=[f"experts.{w}" for w in weights], init_lora_weights=False)
    outer = peft.get_peft_model(holder, lora).base_model.model.experts
    if weights == ("down_proj",):
        moe.experts.gate_up_proj.requires_grad_(True)  # (PEFT froze it; no adapter on it)
    assert rule_for(outer).name == "experts (every token)+lora"
    count, n, t = moe.num_experts, 3, 4
    routed = torch.randn(n, count, t, moe.experts.hidden_size, dtype=torch.float64)  # [n, E, T, d]
    backprops = torch.randn_like(routed)
    params = [p for p in outer.parameters() if p.requires_grad]
    assert len(params) == 2 * len(weights) + (len(weights) == 1)
    want = oracle(lambda i: outer(routed[i].reshape(count * t, -1)).reshape(count, t, -1), params, n, backprops)
    folded = [v.transpose(1, 2).reshape(n, t * count, -1) for v in (routed, backprops)]
    matches(outer, (folded[0],), folded[1], want, rtol=1e-9)
