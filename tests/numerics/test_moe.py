"""Mixtures of experts beyond the families matrix (tests/hf_families.py runs every MoE family against the
loop oracle): user-level units, LoRA on the attention and on the experts, one expert no token reaches,
top-1 and top-3 routing, bf16-free float32 with transformers' default (grouped) experts; the self-check
catching a routed pair given to the wrong sample; and the couplings refused by name."""

import copy
import dataclasses
import importlib.metadata
import os
import re
from unittest import mock

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
from hf_families import CLIP, FAMILIES, Family, build, family, hf_loss, padded_batch, tiny_config  # noqa: E402
from oracles import loop_clipped_sum, loop_unit_clipped_sum, max_relative_error  # noqa: E402
from steps import pipedp_clipped_sum  # noqa: E402

from pipedp import PipelineDPTrainer, UnsupportedModelError  # noqa: E402
from pipedp.models import token_loss  # noqa: E402
from pipedp.privacy.rules import expert_lora, sliced_experts  # noqa: E402
from pipedp.privacy.rules import experts as expert_rules  # noqa: E402
from pipedp.split import hf_experts  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:step\\(\\) got a batch whose sampling is not declared")


def mixtral(**overrides):
    torch.manual_seed(0)
    if "num_local_experts" in overrides:
        overrides["num_experts"] = overrides["num_local_experts"]  # (tiny_config sets both)
    config = tiny_config(Family("mixtral", config=overrides))
    return transformers.AutoModelForCausalLM.from_config(config, experts_implementation="eager").double()


def test_units_of_two_rows_match_the_unit_loop():
    model = mixtral()
    inputs, labels = padded_batch("right")
    inputs = {k: torch.cat([v, v.flip(0)])[:6] for k, v in inputs.items()}
    labels = torch.cat([labels, labels.flip(0)])[:6]
    want = loop_unit_clipped_sum(copy.deepcopy(model), hf_loss, inputs, labels, CLIP, rows=2)
    got = pipedp_clipped_sum(model, token_loss, inputs, labels, CLIP, stages=2, microbatches=1, unit_rows=2)
    assert max_relative_error(got, want) < 1e-12


@pytest.mark.parametrize("top_k, experts", [(1, 4), (3, 4), (2, 8)])
@pytest.mark.parametrize("mode", ["ghost", "materialize"])
def test_any_number_of_experts_per_token_matches_the_loop(top_k, experts, mode):
    model = mixtral(num_experts_per_tok=top_k, num_local_experts=experts)
    inputs, labels = padded_batch("left")
    want = loop_clipped_sum(copy.deepcopy(model), hf_loss, inputs, labels, CLIP)
    got = pipedp_clipped_sum(model, token_loss, inputs, labels, CLIP, stages=2, microbatches=2, grad_mode=mode)
    assert max_relative_error(got, want) < 1e-12


def unreached_experts(model, inputs):
    """The experts of layer 0 that no token of ``inputs`` is routed to."""
    seen = []
    hook = model.model.layers[0].mlp.gate.register_forward_hook(lambda m, a, out: seen.append(out[2]))
    with torch.no_grad():
        model(**inputs)
    hook.remove()
    return sorted(set(range(16)) - set(seen[0].reshape(-1).tolist()))


def test_an_expert_no_token_reaches_gets_no_gradient_but_its_noise():
    inputs, labels = padded_batch("right")
    model = mixtral(num_local_experts=16, num_experts_per_tok=1)
    idle = unreached_experts(model, inputs)
    assert idle  # (16 experts, 40 tokens, top-1)
    want = loop_clipped_sum(copy.deepcopy(model), hf_loss, inputs, labels, CLIP)
    got = pipedp_clipped_sum(model, token_loss, inputs, labels, CLIP, stages=2)
    assert max_relative_error(got, want) < 1e-12
    assert float(got["model.layers.0.mlp.experts.down_proj"][idle].abs().max()) == 0
    noised = mixtral(num_local_experts=16, num_experts_per_tok=1)
    moved = pipedp_clipped_sum(noised, token_loss, inputs, labels, CLIP, stages=2, noise_multiplier=1.0, seed=3)
    assert float(moved["model.layers.0.mlp.experts.down_proj"][idle].abs().min()) > 0


def test_lora_on_the_attention_with_frozen_experts_matches_the_loop():
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = peft.get_peft_model(mixtral(), config).base_model.model
    inputs, labels = padded_batch("right")
    want = loop_clipped_sum(copy.deepcopy(model), hf_loss, inputs, labels, CLIP)
    got = pipedp_clipped_sum(model, token_loss, inputs, labels, CLIP, stages=2, microbatches=2)
    assert max_relative_error(got, want) < 1e-12
    assert all(float(v.abs().max()) == 0 for k, v in got.items() if "lora" not in k)


def lora_on_the_experts(model, weights=("gate_up_proj", "down_proj"), attention=("q_proj", "o_proj"), **options):
    """PEFT's LoRA on the first expert bank's weights (``target_parameters``, which PEFT matches in every layer)
    and on the attention, both factors random so that every gradient is nonzero; the model under PEFT's wrappers."""
    peft = pytest.importorskip("peft")
    path, bank = next(
        (n, m) for n, m in model.named_modules() if isinstance(getattr(m, "down_proj", None), nn.Parameter)
    )
    inner = re.split(r"\.layers\.\d+\.", path, maxsplit=1)[-1]  # (the first MoE layer may not be layer 0)
    names = [w if hasattr(bank, w) else "up_proj" for w in weights]
    present = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}  # (low-rank q and o: DeepSeek-V4's q_b, o_b)
    attention = tuple(a if a in present else a.replace("_proj", "_b_proj") for a in attention)
    settings = dict(r=2, target_modules=list(attention), target_parameters=[f"{inner}.{w}" for w in names])
    config = peft.LoraConfig(**{**settings, "init_lora_weights": False, **options})
    return peft.get_peft_model(model, config).base_model.model


def test_lora_on_the_experts_weights_matches_the_loop_in_both_grad_modes_and_on_three_stages():
    for stages, mode, side in ((2, "ghost", "right"), (3, "materialize", "left")):
        model = lora_on_the_experts(mixtral())
        inputs, labels = padded_batch(side)
        want = loop_clipped_sum(copy.deepcopy(model), hf_loss, inputs, labels, CLIP)
        got = pipedp_clipped_sum(model, token_loss, inputs, labels, CLIP, stages=stages, microbatches=2, grad_mode=mode)
        assert max_relative_error(got, want) < 1e-12, (stages, mode)
        trained = [k for k, v in got.items() if float(v.abs().max()) > 0]
        assert any("experts.lora_A" in k for k in trained) and any("experts.base_layer.lora_B" in k for k in trained)
        assert all("lora" in k for k in trained)  # (the bank itself is frozen under PEFT)


def test_lora_on_one_expert_weight_with_the_bank_trained_too_matches_the_loop():
    model = lora_on_the_experts(mixtral(num_local_experts=8), weights=("down_proj",))
    for layer in model.model.layers:
        layer.mlp.experts.base_layer.gate_up_proj.requires_grad_(True)  # the bank beside its adapter
    inputs, labels = padded_batch("right")
    want = loop_clipped_sum(copy.deepcopy(model), hf_loss, inputs, labels, CLIP)
    got = pipedp_clipped_sum(model, token_loss, inputs, labels, CLIP, stages=2, microbatches=2)
    assert max_relative_error(got, want) < 1e-12
    assert float(got["model.layers.0.mlp.experts.base_layer.gate_up_proj"].abs().max()) > 0


# (Llama-4's too: every token through every expert; not DBRX's row slices, whose LoRA is refused by name, nor
# JetMoE's blocks replayed per sample, whose LoRA has its own test)
MOE_FAMILIES = [f for f in FAMILIES if f.experts and f.exact and f.model_type not in ("dbrx", "jetmoe")]


@pytest.mark.parametrize(
    "family", [pytest.param(f, id=f.name, marks=[pytest.mark.exhaustive] * f.slow) for f in MOE_FAMILIES]
)
def test_lora_on_the_experts_and_the_attention_of_every_moe_family_matches_the_loop(family):
    model = lora_on_the_experts(build(family))  # (build seeds: the factors are drawn alike whatever ran before)
    inputs, labels = padded_batch("left" if len(family.model_type) % 2 else "right")
    want = loop_clipped_sum(copy.deepcopy(model), hf_loss, inputs, labels, CLIP)
    got = pipedp_clipped_sum(model, token_loss, inputs, labels, CLIP, stages=2, microbatches=2)
    assert max_relative_error(got, want) < family.tolerance
    assert any(".lora_B." in k and "experts" in k and float(v.abs().max()) > 0 for k, v in got.items())
    attention = [float(v.abs().max()) for k, v in got.items() if ".lora_B." in k and "attn" in k]
    assert not attention or max(attention) > 0  # (the tiny Jamba has no attention layer)


@pytest.mark.parametrize("lora", [False, True], ids=["sinks trained", "LoRA on the experts and the attention"])
def test_gpt_oss_with_its_attention_sinks_matches_the_loop(lora):
    """GPT-OSS's attention owns trainable sinks and is called with keyword arguments: its rule replays it per
    sample with them (capture.Keywords), the sinks included; PEFT's LoRA leaves them frozen."""
    model = build(family("gpt_oss"))
    model = lora_on_the_experts(model) if lora else model
    inputs, labels = padded_batch("right")  # (eager attention only: no left padding)
    want = loop_clipped_sum(copy.deepcopy(model), hf_loss, inputs, labels, CLIP)
    got = pipedp_clipped_sum(model, token_loss, inputs, labels, CLIP, stages=2, microbatches=2)
    assert max_relative_error(got, want) < 1e-12
    if not lora:  # (the sinks, the router and the bank train)
        assert float(got["model.layers.0.self_attn.sinks"].abs().max()) > 0
        assert float(got["model.layers.0.mlp.router.weight"].abs().max()) > 0
        assert float(got["model.layers.0.mlp.experts.down_proj"].abs().max()) > 0


def plant_misattributed_factors(monkeypatch):
    """A planted bug in the LoRA factors' rule: the first pair of sample 0 counted as sample 1's."""
    real = expert_lora._with_factors

    def misattributed(proj, experts, factors):
        out = real(proj, experts, factors)
        for factor in out if len(experts) > 1 else []:
            factor.g[1, 0], factor.g[0, 0] = factor.g[0, 0].clone(), 0
        return out

    monkeypatch.setattr(expert_lora, "_with_factors", misattributed)


@pytest.mark.parametrize("init", [False, True], ids=["random factors", "peft's start (B zero)"])
def test_planted_a_factor_pair_given_to_the_wrong_sample_is_refused_at_construction(monkeypatch, init):
    """Checked against autograd with random factors when the model is built: with PEFT's own start (B = 0),
    A's gradient is zero at the first step, where the self-check alone could not see a wrong one."""
    plant_misattributed_factors(monkeypatch)
    model = lora_on_the_experts(mixtral(), init_lora_weights=init)
    with pytest.raises(UnsupportedModelError, match=r"model.layers.0.mlp .*per-sample gradients of .*lora_A.* differ"):
        PipelineDPTrainer(model, token_loss, stages=2, expected_batch_size=4)


def test_lora_on_wider_float32_experts_is_accepted_and_a_planted_misreading_still_refused(monkeypatch):
    """The construction checks compare norm-wise by the dtype's rounding: element-wise tolerances refused LoRA on
    a float32 bank 256 wide (large terms of random factors cancel), while a pair given to the wrong sample is
    still off by the size of the value."""

    def wide():
        model = mixtral(hidden_size=256, intermediate_size=896, num_attention_heads=4, num_key_value_heads=4)
        return lora_on_the_experts(model.float(), r=8)

    PipelineDPTrainer(wide(), token_loss, stages=2, expected_batch_size=4)
    plant_misattributed_factors(monkeypatch)
    with pytest.raises(UnsupportedModelError, match=r"per-sample gradients of .*lora_A.* differ"):
        PipelineDPTrainer(wide(), token_loss, stages=2, expected_batch_size=4)


def test_planted_a_write_into_an_adapted_expert_weight_in_a_later_forward_is_caught():
    """PEFT's fold sets the weight to itself at each call (its version counter moves): those sets are counted,
    and a real write beside them is still refused, at a step the self-check does not check."""
    model = lora_on_the_experts(mixtral(), weights=("down_proj",))
    outer = model.model.layers[0].mlp.experts
    bank = expert_lora.wrapped_bank(outer)
    leaking = []

    def leak(module, args):
        if leaking and torch.is_grad_enabled():
            with torch.no_grad():
                bank.down_proj.add_(1e-3 * args[0].detach().mean())  # a statistic of the private batch

    outer.register_forward_pre_hook(leak)  # (before PEFT's fold: inside it, down_proj is the folded copy)
    inputs, labels = padded_batch("right")
    trainer = PipelineDPTrainer(model, token_loss, stages=2, expected_batch_size=4, noise_multiplier=1.0)
    trainer.step(inputs, labels)
    trainer.step(inputs, labels)  # (the counted sets alone pass)
    leaking.append(True)
    with pytest.raises(UnsupportedModelError, match=r"training forward changes the parameters .*experts.base_layer"):
        trainer.step(inputs, labels)


def test_a_cli_target_naming_both_a_module_and_a_bank_weight_is_refused_and_a_longer_one_taken():
    from pipedp.train.lora import with_lora

    with pytest.raises(ValueError, match=r"\['down_proj'\] name both modules and an expert bank's weights"):
        with_lora(build(family("qwen2_moe")), 2, ["down_proj"], seed=0)
    model = with_lora(build(family("qwen2_moe")), 2, ["q_proj", "experts.down_proj"], seed=0)
    assert type(model.base_model.model.model.layers[0].mlp.experts).__name__ == "ParamWrapper"


def test_training_an_expert_weight_beside_its_own_adapter_is_refused_by_name():
    model = lora_on_the_experts(mixtral(), weights=("down_proj",))
    model.model.layers[0].mlp.experts.base_layer.down_proj.requires_grad_(True)
    with pytest.raises(UnsupportedModelError, match=r"'down_proj' is trained beside its own LoRA adapter.*freeze it"):
        PipelineDPTrainer(model, token_loss, stages=2, expected_batch_size=4)


def test_planted_a_misread_factor_layout_is_refused_at_construction(monkeypatch):
    def experts_major(self, dtype):  # B read as [E, out, r] rows, not PEFT's interleaved columns (i E + e)
        return self.b_weight.detach().to(dtype).reshape(self.b_weight.shape[0], self.experts, -1).transpose(0, 1)

    monkeypatch.setattr(expert_lora.Factors, "b", experts_major)
    with pytest.raises(UnsupportedModelError, match=r"model.layers.0.mlp .*does not compute the bank's weights plus"):
        PipelineDPTrainer(lora_on_the_experts(mixtral()), token_loss, stages=2, expected_batch_size=4)


def test_lora_states_on_the_experts_the_rule_does_not_read_are_refused_by_name():
    peft = pytest.importorskip("peft")
    model = lora_on_the_experts(mixtral())
    model.model.layers[0].mlp.experts.merge()
    with pytest.raises(UnsupportedModelError, match=r"model.layers.0.mlp .*'down_proj' has adapters .* merged"):
        PipelineDPTrainer(model, token_loss, stages=2, expected_batch_size=4)
    extra = peft.LoraConfig(r=2, target_parameters=["mlp.experts.down_proj"])
    wrapped = peft.get_peft_model(mixtral(), extra, adapter_name="a")
    wrapped.add_adapter("b", extra)
    wrapped.base_model.set_adapter(["a", "b"])
    with pytest.raises(UnsupportedModelError, match=r"'down_proj' has adapters \['a', 'b'\] active"):
        PipelineDPTrainer(wrapped.base_model.model, token_loss, stages=2, expected_batch_size=4)
    wrapped.base_model.set_adapter("a")
    wrapped.base_model.model.model.layers[1].mlp.experts.lora_B["b"].weight.requires_grad_(True)  # read by nothing
    with pytest.raises(UnsupportedModelError, match=r"\['lora_B.b.weight'\] .* not read by the active adapters"):
        PipelineDPTrainer(wrapped.base_model.model, token_loss, stages=2, expected_batch_size=4)


def test_float32_with_the_default_grouped_experts_trains_and_agrees_with_the_loop():
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(Family("mixtral")))
    assert model.config._experts_implementation != "eager"  # transformers' default kernel, as users get it
    inputs, labels = padded_batch("right")
    want = loop_clipped_sum(copy.deepcopy(model), hf_loss, inputs, labels, CLIP)
    got = pipedp_clipped_sum(model, token_loss, inputs, labels, CLIP, stages=2, microbatches=2)
    assert max_relative_error(got, want) < 1e-5


def test_planted_a_routed_pair_given_to_the_wrong_sample_is_caught_by_the_self_check(monkeypatch):
    real = expert_rules.pairs

    def misattributed(bank, inputs, backprops):
        experts, projections = real(bank, inputs, backprops)
        for proj in projections if len(experts) > 1 else []:  # the first pair of sample 0 counted as sample 1's
            proj.a[1, 0], proj.g[1, 0] = proj.a[0, 0], proj.g[0, 0]
            proj.a[0, 0], proj.g[0, 0] = 0, 0
        return experts, projections

    monkeypatch.setattr(expert_rules, "pairs", misattributed)
    model = mixtral()
    inputs, labels = padded_batch("right")
    with pytest.raises(
        UnsupportedModelError, match=r"norms of .*experts.gate_up_proj.* disagree with their per-sample"
    ):
        pipedp_clipped_sum(model, token_loss, inputs, labels, CLIP, stages=2, grad_mode="ghost")


@pytest.mark.parametrize(
    "overrides, refusal",
    [
        ({"output_router_logits": True}, "load-balancing loss.*statistics of the whole batch"),
        ({"router_jitter_noise": 0.1}, "router_jitter_noise=0.1 multiplies the hidden states by noise in place"),
    ],
)
def test_couplings_are_refused_at_construction_by_name(overrides, refusal):
    with pytest.raises(UnsupportedModelError, match=rf"MixtralForCausalLM: model.layers.0.mlp .*{refusal}"):
        PipelineDPTrainer(mixtral(**overrides), token_loss, stages=2, expected_batch_size=4)


def test_a_trainable_bias_balancing_parameter_is_refused_by_name():
    torch.manual_seed(0)
    config = tiny_config(Family("ernie4_5_moe", config={"head_dim": 8}))
    model = transformers.AutoModelForCausalLM.from_config(config, experts_implementation="eager")
    for name, p in model.named_parameters():
        if "e_score_correction_bias" in name:
            p.requires_grad_(True)
    with pytest.raises(UnsupportedModelError, match=r"moe_statics.e_score_correction_bias.*freeze them"):
        PipelineDPTrainer(model, token_loss, stages=2, expected_batch_size=4)


def routed(model, inputs):
    """The experts of the first MoE layer for every token."""
    seen = []
    block = next(layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts"))
    hook = block.gate.register_forward_hook(lambda m, a, out: seen.append(out[2]))
    with torch.no_grad():
        model(**inputs)
    hook.remove()
    return seen[0]


@pytest.mark.parametrize("model_type", ["minimax_m2", "hy_v3"])
def test_a_router_passed_its_score_correction_bias_matches_the_loop(model_type):
    """MiniMax-M2's and HY-V3's blocks pass their router a bias that chooses the experts (not trained): with a
    bias that changes which experts the tokens go to, the update is the loop oracle's (the construction check
    calls the router as the block does; the rule reads its hidden states only)."""
    row = family(model_type)
    torch.manual_seed(0)
    model = build(row)
    inputs, labels = padded_batch("left")
    unbiased = routed(model, inputs)
    g = torch.Generator().manual_seed(3)
    for layer in model.model.layers:
        bias = getattr(layer.mlp, "e_score_correction_bias", torch.zeros(0))  # (hy_v3's first layer is dense)
        bias.copy_(torch.rand(bias.shape, generator=g, dtype=bias.dtype))
    assert not torch.equal(routed(model, inputs), unbiased)  # the bias chooses other experts
    want = loop_clipped_sum(copy.deepcopy(model), hf_loss, inputs, labels, CLIP)
    got = pipedp_clipped_sum(model, token_loss, inputs, labels, CLIP, stages=2, microbatches=2)
    assert max_relative_error(got, want) < row.tolerance


def routers_passed(passed):
    """Mixtral's router and block forwards with the block passing its router ``passed(block, hidden)`` too;
    the router divides its logits by it when ``scales`` (a temperature) and only adds it to the scores
    that choose the experts otherwise (a score-correction bias)."""
    from transformers.models.mixtral import modeling_mixtral as mm

    def router_forward(self, hidden_states, extra, scales=False):
        logits = F.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)
        logits = logits / extra if scales else logits
        probs = torch.softmax(logits.float(), dim=-1)
        index = torch.topk(probs + (0 if scales else extra), self.top_k, dim=-1)[1]
        top = probs.gather(1, index)
        return logits, top / top.sum(dim=-1, keepdim=True), index

    def block_forward(self, hidden_states):
        b, t, d = hidden_states.shape
        h = hidden_states.view(-1, d)
        _, weights, index = self.gate(h, *passed(self, h))
        return self.experts(h, index, weights).reshape(b, t, d)

    return mock.patch.multiple(mm.MixtralTopKRouter, forward=router_forward), mock.patch.multiple(
        mm.MixtralSparseMoeBlock, forward=block_forward
    )


@pytest.mark.parametrize(
    "passed, refusal",
    [
        (lambda block, h: (block.temperature, True), "router's logits change with what its block passes it"),
        (lambda block, h: (h.sum(0), False), "a tensor besides the hidden states that is not the block's own"),
        (lambda block, h: (block.balance, False), "passes its router balance, a trainable tensor .* freeze it"),
    ],
    ids=["a temperature buffer", "a tensor computed in the forward", "a trainable bias"],
)
def test_planted_what_a_block_passes_its_router_besides_the_hidden_states_is_refused_unless_it_only_chooses(
    passed, refusal
):
    """The router's rule reads its hidden states only: what else its block passes it must be the block's own
    frozen tensor and leave the logits as they are (checked with it drawn at random: a temperature that is 1
    at construction would otherwise pass and train wrong gradients once changed, as the review of 2026-12-06
    showed). A frozen score-correction bias is accepted and matches the loop oracle."""
    model = mixtral()
    for layer in model.model.layers:
        layer.mlp.register_buffer("temperature", torch.tensor(1.0, dtype=torch.float64))
        layer.mlp.balance = nn.Parameter(torch.zeros(4, dtype=torch.float64))
        layer.mlp.register_buffer("correction", torch.rand(4, dtype=torch.float64))
    router, block = routers_passed(passed)
    with router, block, pytest.raises(UnsupportedModelError, match=rf"model.layers.0.mlp .*{refusal}"):
        PipelineDPTrainer(model, token_loss, stages=2, expected_batch_size=4)
    for layer in model.model.layers:
        layer.mlp.balance.requires_grad_(False)
    router, block = routers_passed(lambda block, h: (block.correction, False))
    with router, block:
        inputs, labels = padded_batch("right")
        want = loop_clipped_sum(copy.deepcopy(model), hf_loss, inputs, labels, CLIP)
        got = pipedp_clipped_sum(model, token_loss, inputs, labels, CLIP, stages=2, microbatches=2)
    assert max_relative_error(got, want) < 1e-12


def test_deepseek_v4_trains_every_part_a_gradient_reaches_and_its_indexer_gets_none():
    """DeepSeek-V4 (its matrix row's config): the hash router, the hyper-connections (three outputs carrying
    gradient, joined by the capture) and the attention's compressors all train, and match the loop oracle; its
    indexer picks compressed entries by top-k, so no gradient reaches it, in the oracle as in pipedp."""
    model = build(family("deepseek_v4"))
    inputs, labels = padded_batch("left")
    want = loop_clipped_sum(copy.deepcopy(model), hf_loss, inputs, labels, CLIP)
    got = pipedp_clipped_sum(model, token_loss, inputs, labels, CLIP, stages=2, microbatches=2)
    assert max_relative_error(got, want) < 1e-5  # (its hyper-connections, router and compressors compute in float32)
    trained = ("mlp.gate.weight", "attn_hc.fn", "ffn_hc.scale", "self_attn.compressor.position_bias", "self_attn.sinks")
    assert all(float(got[f"model.layers.0.{k}"].abs().max()) > 0 for k in trained)
    indexer = [k for k in got if ".indexer." in k]
    assert indexer and all(float(got[k].abs().max()) == 0 == float(want[k].abs().max()) for k in indexer)


def test_planted_a_hash_router_whose_logits_read_the_token_ids_is_refused():
    """The router's rule reads its logits as F.linear of the hidden states alone: a hash router whose logits
    move with the token ids (planted) is refused by name (its check draws the ids, twice)."""
    model = build(family("deepseek_v4"))
    router_type = type(model.model.layers[0].mlp.gate)
    real = router_type.forward

    def planted(self, hidden_states, input_ids):
        logits, weights, experts = real(self, hidden_states, input_ids)
        return logits + input_ids.reshape(-1, 1).to(logits.dtype) * 1e-3, weights, experts

    with mock.patch.object(router_type, "forward", planted):
        with pytest.raises(UnsupportedModelError, match="router's first output is not F.linear|logits change with"):
            PipelineDPTrainer(model, token_loss, stages=2, expected_batch_size=4)


def layer_routes(model, inputs, training: bool):
    """The experts layer 0's router picks for each token, the model in training mode or not."""
    seen = []
    hook = model.model.layers[0].mlp.router.register_forward_hook(lambda m, a, out: seen.append(out[2]))
    with torch.no_grad():
        model.train(training)(**inputs)
    hook.remove()
    model.train()
    return seen[0]


def test_phi_moe_s_sampled_routing_is_live_and_trains_with_torch_s_own_draws():
    """Phi-MoE's router samples its experts in training, one draw per token (no coupling of samples): the rules
    read the experts the forward drew and the router's gradient through the model's own backward. The families
    matrix checks it against the loop oracle with each token's draws keyed to its values (tests/keyed_draws.py);
    here the draws are shown to route otherwise than eval's top-2, and the real draws train with the self-check."""
    keyed_model = build(family("phimoe"))
    inputs, labels = padded_batch("right")
    sampled, top = layer_routes(keyed_model, inputs, True), layer_routes(keyed_model, inputs, False)
    assert int((sampled != top).any(-1).sum()) >= 10  # of 40 tokens
    model = build(dataclasses.replace(family("phimoe"), sampled=""))  # torch's own draws
    first, second = layer_routes(model, inputs, True), layer_routes(model, inputs, True)
    assert not torch.equal(first, second)
    got = pipedp_clipped_sum(model, token_loss, inputs, labels, CLIP, stages=2, microbatches=2)
    assert float(got["model.layers.0.mlp.router.weight"].abs().max()) > 0
    assert all(v.isfinite().all() for v in got.values())


@pytest.mark.parametrize("checkpointing", [False, True])
def test_phi_moe_with_torch_s_own_draws_matches_the_loop_drawing_in_the_same_order(checkpointing):
    """One stage, one sample per micro-batch, from one seed: pipedp's forwards draw the routing in the loop
    oracle's order, so torch's own draws give both the same experts, and the update is the oracle's. A path that
    drew again (a recomputation not replaying the forward's random state) would route otherwise and differ;
    activation checkpointing's recomputation replays it."""
    model = build(dataclasses.replace(family("phimoe"), sampled=""))  # torch's own draws
    inputs, labels = padded_batch("right")
    torch.manual_seed(8)  # (another seed routes otherwise: the comparison sees the draws)
    other = loop_clipped_sum(copy.deepcopy(model), hf_loss, inputs, labels, CLIP)
    torch.manual_seed(7)
    want = loop_clipped_sum(copy.deepcopy(model), hf_loss, inputs, labels, CLIP)
    assert max_relative_error(other, want) > 1e-6
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    trainer = PipelineDPTrainer(
        model, token_loss, lambda p: torch.optim.SGD(p, lr=1.0), noise_multiplier=0.0, max_grad_norm=CLIP,
        expected_batch_size=1, stages=1, microbatches=len(labels), activation_checkpointing=checkpointing,
    )  # fmt: skip
    torch.manual_seed(7)
    trainer.step(inputs, labels)
    got = {k: before[k] - p.detach() for k, p in model.named_parameters()}
    assert max_relative_error(got, want) < 1e-12


def test_planted_a_router_whose_training_logits_are_not_its_linear_s_is_refused():
    """The router's rule reads its first output as F.linear of its input: checked in training mode too, where a
    sampling router runs another code path (a planted one that scales its logits in training only)."""
    model = build(family("phimoe"))
    router_type = type(model.model.layers[0].mlp.router)
    real = router_type.forward

    def planted(self, hidden_states):
        logits, weights, experts = real(self, hidden_states)
        return (logits * 2 if self.training else logits), weights, experts

    with mock.patch.object(router_type, "forward", planted):
        model = build(dataclasses.replace(family("phimoe"), sampled=""))
        with pytest.raises(UnsupportedModelError, match="in training its router's first output is not F.linear"):
            PipelineDPTrainer(model, token_loss, stages=2, expected_batch_size=4)


def test_construction_leaves_every_module_in_its_own_training_mode():
    model = mixtral().train()
    for layer in model.model.layers:
        layer.mlp.experts.eval()  # (a user's choice below a block the checks run in eval mode)
        layer.mlp.gate.eval()
    PipelineDPTrainer(model, token_loss, stages=2, expected_batch_size=4)
    assert all(not layer.mlp.experts.training and not layer.mlp.gate.training for layer in model.model.layers)
    assert all(layer.mlp.training and layer.self_attn.training for layer in model.model.layers)


def test_planted_a_router_reading_its_linear_s_weight_outside_its_call_is_refused():
    """AFMoE's router computes its logits with a Linear child, captured as any Linear called on flattened
    tokens (from its calls): a router that computes them from the Linear's weight without calling it (a
    planted F.linear) is refused, not trained with no per-sample gradient."""
    model = build(family("afmoe"))
    router_type = type(next(layer.mlp.router for layer in model.model.layers if hasattr(layer.mlp, "router")))

    def planted(self, hidden_states, expert_bias):  # AFMoE's router, its Linear's weight read without a call
        logits = F.linear(hidden_states.view(-1, hidden_states.shape[-1]), self.gate.weight).to(torch.float32)
        scores = torch.sigmoid(logits)
        experts = torch.topk(scores + expert_bias, k=self.top_k, dim=1)[1]
        top = scores.gather(1, experts)
        return logits, top / (top.sum(-1, keepdim=True) + 1e-20) * self.route_scale, experts

    with mock.patch.object(router_type, "forward", planted):
        want = loop_clipped_sum(copy.deepcopy(model), hf_loss, *padded_batch("right"), CLIP)  # (it runs)
        assert all(v.isfinite().all() for v in want.values())
        with pytest.raises(UnsupportedModelError, match="read outside"):
            PipelineDPTrainer(model, token_loss, stages=2, expected_batch_size=4)


def test_dbrx_s_sliced_bank_with_lora_on_the_attention_and_frozen_matches_the_loop():
    """DBRX keeps its experts as row slices of [E h, d] matrices (rules/sliced_experts.py; the families matrix
    runs its full fine-tune): with LoRA on the attention beside the trained bank, and with the bank frozen."""
    for frozen in (False, True):
        model = build(family("dbrx"))
        if frozen:
            for block in model.transformer.blocks:
                block.ffn.requires_grad_(False)
        else:
            peft = pytest.importorskip("peft")
            config = peft.LoraConfig(r=2, target_modules=["Wqkv"], init_lora_weights=False)
            model = peft.get_peft_model(model, config).base_model.model
            for block in model.transformer.blocks:
                block.ffn.experts.requires_grad_(True)
        inputs, labels = padded_batch("left")
        want = loop_clipped_sum(copy.deepcopy(model), hf_loss, inputs, labels, CLIP)
        got = pipedp_clipped_sum(model, token_loss, inputs, labels, CLIP, stages=3, microbatches=2)
        assert max_relative_error(got, want) < 1e-12, frozen
        assert (float(got["transformer.blocks.0.ffn.experts.mlp.v1"].abs().max()) > 0) != frozen


def test_dbrx_s_bank_is_one_layer_with_its_mlp_whatever_the_routing():
    """DBRX's bank calls its mlp once per expert on that expert's rows (sorted by token, of any count): the mlp is
    part of the bank's layer, not a module on flattened tokens, for the split's probes too. Before, where the
    random routing of the token-order check gave an expert rows of both samples, the mlp was refused (4 of 12
    weight draws)."""
    config = tiny_config(family("dbrx"), False)
    for seed in range(12):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config).double()
        PipelineDPTrainer(model, token_loss, stages=2, expected_batch_size=4)


def test_planted_dbrx_s_misread_slices_and_noise_and_adapters_on_its_bank_are_refused(monkeypatch):
    """Refused at construction: the gate and up slices read swapped (a planted misreading: the bank's own
    forward disagrees), noise multiplied into the hidden states (moe_jitter_eps), PEFT's LoRA on the slices."""
    peft = pytest.importorskip("peft")
    with monkeypatch.context() as planted:
        planted.setattr(sliced_experts, "NAMES", ("v1", "w1", "w2"))
        with pytest.raises(UnsupportedModelError, match=r"transformer.blocks.0.ffn .*do not compute what pipedp"):
            PipelineDPTrainer(build(family("dbrx")), token_loss, stages=2, expected_batch_size=4)
    model = build(family("dbrx"))
    for block in model.transformer.blocks:
        block.ffn.router.moe_jitter_eps = 0.01
    with pytest.raises(UnsupportedModelError, match=r"ffn_config.moe_jitter_eps=0.01 multiplies the hidden states"):
        PipelineDPTrainer(model, token_loss, stages=2, expected_batch_size=4)
    config = peft.LoraConfig(r=2, target_parameters=["ffn.experts.mlp.w1"], init_lora_weights=False)
    model = peft.get_peft_model(build(family("dbrx")), config).base_model.model
    with pytest.raises(UnsupportedModelError, match=r"PEFT's adapters on its experts \(mlp\), which are not a fused"):
        PipelineDPTrainer(model, token_loss, stages=2, expected_batch_size=4)


def test_planted_a_dbrx_pair_given_to_the_wrong_sample_is_caught_by_the_self_check(monkeypatch):
    real = sliced_experts.sliced_pairs

    def misattributed(bank, inputs, backprops):
        experts, projections = real(bank, inputs, backprops)
        for proj in projections if len(experts) > 1 else []:  # the first pair of sample 0 counted as sample 1's
            proj.g[1, 0], proj.g[0, 0] = proj.g[0, 0].clone(), 0
        return experts, projections

    monkeypatch.setattr(sliced_experts, "sliced_pairs", misattributed)
    with pytest.raises(UnsupportedModelError, match=r"norms of .*experts.mlp.w1.* disagree with their per-sample"):
        pipedp_clipped_sum(build(family("dbrx")), token_loss, *padded_batch("right"), CLIP, stages=2, grad_mode="ghost")


@pytest.mark.parametrize("self_check", [True, False])
def test_planted_a_block_flattening_its_tokens_sequence_major_is_refused_at_construction(self_check):
    """Per-sample capture reads a router's and a bank's flattened tokens batch-major (row i T + t is sample i's
    token t). A block flattening them [T, batch] (planted) computes the same outputs but would give each row's
    gradient to another sample: refused by name at construction by autograd on random hidden states, whether or
    not the self-check runs."""
    model = mixtral()
    block_type = type(model.model.layers[0].mlp)

    def sequence_major(self, hidden_states):
        batch, length, width = hidden_states.shape
        flat = hidden_states.transpose(0, 1).reshape(-1, width)  # row t batch + i
        _, weights, index = self.gate(flat)
        out = self.experts(flat, index, weights)
        return out.reshape(length, batch, width).transpose(0, 1)

    inputs, labels = padded_batch("right")
    want = loop_clipped_sum(copy.deepcopy(model), hf_loss, inputs, labels, CLIP)
    with mock.patch.object(block_type, "forward", sequence_major):
        again = loop_clipped_sum(copy.deepcopy(model), hf_loss, inputs, labels, CLIP)  # (the same function)
        assert max_relative_error(again, want) < 1e-12
        with pytest.raises(UnsupportedModelError, match=r"mlp.gate \(MixtralTopKRouter\) is called on the tokens"):
            PipelineDPTrainer(model, token_loss, stages=2, expected_batch_size=4, self_check=self_check)


def test_planted_a_bank_read_in_the_wrong_layout_is_refused_at_construction():
    model = mixtral()
    for layer in model.model.layers:
        layer.mlp.experts.is_transposed = True  # the rule would read [E, out, in] weights as [E, in, out]
    with pytest.raises(UnsupportedModelError, match="do not compute what pipedp.s per-sample rule reads"):
        PipelineDPTrainer(model, token_loss, stages=2, expected_batch_size=4)


def test_a_block_frozen_whole_trains_what_is_around_it_whatever_its_layout():
    """The refusals' remedy ("freeze the whole block") lifts them: a planted bank no rule could read, frozen with
    its router, is accepted, and the rest of the model matches the loop oracle (review of 2026-12-04)."""
    model = mixtral()
    for layer in model.model.layers:
        layer.mlp.experts.is_transposed = True  # the layout the construction check refuses when it is trained
        layer.mlp.requires_grad_(False)
    inputs, labels = padded_batch("right")
    want = loop_clipped_sum(copy.deepcopy(model), hf_loss, inputs, labels, CLIP)
    got = pipedp_clipped_sum(model, token_loss, inputs, labels, CLIP, stages=2, microbatches=2)
    assert max_relative_error(got, want) < 1e-12
    model.model.layers[1].mlp.gate.weight.requires_grad_(True)  # one trainable router: the block is checked
    with pytest.raises(UnsupportedModelError, match="model.layers.1.mlp .*do not compute what pipedp.s"):
        PipelineDPTrainer(model, token_loss, stages=2, expected_batch_size=4)


def test_a_router_that_needs_more_than_the_hidden_states_is_refused_by_name():
    model = mixtral()
    gate = model.model.layers[0].mlp.gate
    original = type(gate).forward

    class NeedsIds(type(gate)):
        def forward(self, hidden_states, input_ids):  # (DeepSeek-V4's hash router reads the token ids)
            return original(self, hidden_states)

    gate.__class__ = NeedsIds
    with pytest.raises(UnsupportedModelError, match=r"model.layers.0.mlp .*cannot be called on the hidden states"):
        PipelineDPTrainer(model, token_loss, stages=2, expected_batch_size=4)


def test_tensor_parallel_experts_are_refused_by_name():
    from pipedp.parallel.plan import tensor_parallel_plan
    from pipedp.split.adapters import model_blocks

    model = mixtral(num_key_value_heads=2)
    with pytest.raises(UnsupportedModelError, match=r"layer 'model.layers.0.mlp.experts' is planned 'moe_tp_experts'"):
        tensor_parallel_plan(model, model_blocks(model), 2)


# ---- from a saved folder: transformers merges the per-expert tensors it saved into banks on loading ----------
def saved_chat_mixtral(folder):
    from test_cli_finetune import tiny_chat_llama

    tiny_chat_llama(transformers, folder)  # its tokenizer, and the special tokens' ids
    llama = transformers.AutoConfig.from_pretrained(folder)
    ids = {k: getattr(llama, k) for k in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")}
    config = transformers.MixtralConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        num_local_experts=4,
        num_experts_per_tok=2,
        **ids,
    )
    torch.manual_seed(0)
    transformers.MixtralForCausalLM(config).save_pretrained(folder)
    return str(folder)


def test_each_stage_loads_its_banks_from_a_saved_folder(tmp_path):
    import safetensors

    from pipedp.split.hf_loading import load_local_model, load_pipeline_stage

    folder = saved_chat_mixtral(tmp_path / "mixtral")
    whole = dict(load_local_model(folder).named_parameters())
    stored_keys = list(safetensors.safe_open(os.path.join(folder, "model.safetensors"), "pt").keys())
    assert any(".experts.0." in k for k in stored_keys)  # saved per expert: transformers merges them on loading
    read: list = []
    real = safetensors.safe_open

    class Recording:  # the stored tensors a stage reads (the loader opens the file per tensor)
        def __init__(self, *args, **kwargs):
            self.f = real(*args, **kwargs)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def get_tensor(self, key):
            read.append(key)
            return self.f.get_tensor(key)

        def keys(self):
            return self.f.keys()

    loaded = set()
    with mock.patch.object(safetensors, "safe_open", Recording):
        for stage in range(2):
            read.clear()
            model = load_pipeline_stage(folder, 2, stage)
            held = {name for name, p in model.named_parameters() if not p.is_meta}
            for name in held:
                assert torch.equal(dict(model.named_parameters())[name], whole[name]), name
            loaded |= held
            other = 1 - stage  # the other stage's layer: none of its stored tensors read
            assert read and not [k for k in read if f"layers.{other}." in k], read
    assert loaded == set(whole)  # every tensor on one stage or the other


def test_pipedp_train_runs_a_saved_mixture_of_experts_over_two_processes(tmp_path):
    import json
    import subprocess
    import sys

    from test_cli_finetune import chats

    folder = saved_chat_mixtral(tmp_path / "mixtral")
    data = chats(tmp_path / "chats.jsonl", 24)
    argv = ["train", "--model", folder, "--data", str(data), "--stages", "2", "--steps", "3", "--batch-size", "8"]
    argv += ["--checkpoint-dir", str(tmp_path / "run"), "--max-grad-norm", "0.5", "--noise-multiplier", "1.0"]
    done = subprocess.run([sys.executable, "-m", "pipedp", *argv], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "launching 2 processes" in done.stdout
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 3


def llama4(**overrides):
    torch.manual_seed(0)
    return build(Family("llama4_text", config=overrides, experts=True))


def test_llama4_every_token_through_every_expert_matches_the_loop_with_units_and_lora_on_the_attention():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(llama4(), peft.LoraConfig(r=2, target_modules=["q_proj"])).base_model.model
    for name, p in model.named_parameters():
        p.requires_grad_(p.requires_grad or "feed_forward" in name)  # the experts and the router trained too
    inputs, labels = padded_batch("left")
    inputs = {k: torch.cat([v, v.flip(0)])[:6] for k, v in inputs.items()}
    labels = torch.cat([labels, labels.flip(0)])[:6]
    want = loop_unit_clipped_sum(copy.deepcopy(model), hf_loss, inputs, labels, CLIP, rows=2)
    got = pipedp_clipped_sum(model, token_loss, inputs, labels, CLIP, stages=3, microbatches=1, unit_rows=2)
    assert max_relative_error(got, want) < 1e-7  # (its router's sigmoid is computed in float32)
    assert float(got["model.layers.0.feed_forward.experts.gate_up_proj"].abs().max()) > 0


def test_planted_llama4_experts_read_without_their_expert_first_order_are_caught_by_the_self_check(monkeypatch):
    from pipedp.runtime import capture

    real = capture.fold_tokens
    monkeypatch.setattr(capture, "fold_tokens", lambda t, rows, experts=1: real(t, rows))  # [E n T] read as [n T E]
    inputs, labels = padded_batch("right")
    with pytest.raises(UnsupportedModelError, match=r"experts.gate_up_proj.* (disagree|not all seen|split)"):
        pipedp_clipped_sum(llama4(), token_loss, inputs, labels, CLIP, stages=2, grad_mode="ghost")


def test_planted_llama4_bank_layouts_and_routers_and_lora_on_its_experts_are_refused_at_construction(monkeypatch):
    from pipedp.privacy.rules import dense_experts

    with monkeypatch.context() as patched:
        patched.setattr(dense_experts, "_gated", lambda bank, z: z.chunk(2, -1)[0] * bank.act_fn(z.chunk(2, -1)[1]))
        with pytest.raises(UnsupportedModelError, match=r"feed_forward .*do not compute what pipedp's per-sample"):
            PipelineDPTrainer(llama4(), token_loss, stages=2, expected_batch_size=4)
    for _what, forward in (
        ("a cosine router", lambda self, h: self.__class__.__bases__[0].forward(self, h / self.weight.norm())),
        ("a transformed input", lambda self, h: self.__class__.__bases__[0].forward(self, 3 * h)),
    ):
        model = llama4()
        router = model.model.layers[0].feed_forward.router
        router.__class__ = type("Planted", (type(router),), {"forward": forward})
        with pytest.raises(UnsupportedModelError, match=r"feed_forward .*router \(Planted\)"):
            PipelineDPTrainer(model, token_loss, stages=2, expected_batch_size=4)


def test_lora_on_llama4s_experts_matches_the_loop_in_both_grad_modes_on_three_stages_and_with_units():
    """PEFT reads Llama-4's [E, in, out] weights as [E, out, in]: B's factor meets the input first
    (rules/expert_lora.py); both factors of both weights train, and match the loop oracle."""
    for stages, mode, side, rows in ((2, "ghost", "right", 1), (3, "materialize", "left", 2)):
        # (rank 8 in ghost mode: each expert's T^2 Gram weighs less than its smallest factor, so ghost norms run)
        model = lora_on_the_experts(llama4(), r=8 if mode == "ghost" else 2)
        inputs, labels = padded_batch(side)
        if rows == 2:  # (units of 2 rows: 6 rows, each sample with its mirror)
            inputs = {k: torch.cat([v, v.flip(0)])[:6] for k, v in inputs.items()}
            labels = torch.cat([labels, labels.flip(0)])[:6]
        if rows == 1:
            want = loop_clipped_sum(copy.deepcopy(model), hf_loss, inputs, labels, CLIP)
        else:
            want = loop_unit_clipped_sum(copy.deepcopy(model), hf_loss, inputs, labels, CLIP, rows=rows)
        got = pipedp_clipped_sum(
            model, token_loss, inputs, labels, CLIP, stages=stages, microbatches=1, grad_mode=mode, unit_rows=rows
        )
        assert max_relative_error(got, want) < 1e-7, (stages, mode)  # (its router's sigmoid is in float32)
        trained = [k for k, v in got.items() if float(v.abs().max()) > 0]
        for factor in ("experts.lora_A", "experts.lora_B", "experts.base_layer.lora_A", "experts.base_layer.lora_B"):
            assert any(factor in k for k in trained), factor  # (both weights' adapters: down_proj's wraps the other)


def test_frozen_expert_adapters_beside_a_trained_router_are_no_layer_and_match_the_loop():
    """Nothing below PEFT's wrappers trains: no rule reads them and the construction check skips them (it
    crashed on an empty set of trained tensors); the router still trains exactly."""
    for build_model, router in ((llama4, "feed_forward.router"), (mixtral, "mlp.gate")):
        model = lora_on_the_experts(build_model())
        for name, p in model.named_parameters():
            p.requires_grad_(router in name)
        inputs, labels = padded_batch("right")
        want = loop_clipped_sum(copy.deepcopy(model), hf_loss, inputs, labels, CLIP)
        got = pipedp_clipped_sum(model, token_loss, inputs, labels, CLIP, stages=2, microbatches=2)
        assert max_relative_error(got, want) < 1e-7
        trained = [k for k, v in got.items() if float(v.abs().max()) > 0]
        assert trained and all(router in k for k in trained)


@pytest.mark.parametrize("plant", ["a pair given to the wrong sample", "the factors read in PEFT's order"])
def test_planted_llama4_factor_readings_are_refused_at_construction(monkeypatch, plant):
    """PEFT starts B at zero, where A's gradient is zero at the first step: the reading is checked against
    autograd with random factors when the model is built."""
    if plant == "a pair given to the wrong sample":
        plant_misattributed_factors(monkeypatch)
    else:  # the standard reading of a [E, out, in] weight: input and output-gradient not exchanged
        monkeypatch.setattr(expert_lora, "_exchanged", lambda proj: proj)
    model = lora_on_the_experts(llama4())
    with pytest.raises(
        UnsupportedModelError, match=r"feed_forward \(Llama4TextMoe\): PEFT's LoRA on its experts .*(differ|cannot)"
    ):
        PipelineDPTrainer(model, token_loss, stages=2, expected_batch_size=4)


def test_expert_adapters_of_an_older_peft_are_refused_naming_the_version(monkeypatch):
    """PEFT 0.18 and 0.19 store the expert banks' factors in shapes pipedp's rule does not read (its reading fails
    with a shape error): refused at construction, naming the installed PEFT and the one to install. Planted here
    (PEFT 0.20+ in CI): the reading fails as it does under 0.19, and 0.19 is the installed version."""

    def old_shapes(*args, **kwargs):
        raise RuntimeError(
            "The size of tensor a (16) must match the size of tensor b (64) at non-singleton dimension 2"
        )

    real_version = importlib.metadata.version
    monkeypatch.setattr(hf_experts, "low_rank", old_shapes)
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.19.0" if name == "peft" else real_version(name))
    model = lora_on_the_experts(mixtral())
    inputs, labels = padded_batch("right")
    with pytest.raises(UnsupportedModelError, match=r"pip install 'peft>=0\.20' \(PEFT 0\.19\.0 is installed"):
        pipedp_clipped_sum(model, token_loss, inputs, labels, CLIP, stages=2, microbatches=2)


@pytest.mark.parametrize("plant", ["the adapter term dropped", "another expert's factors"])
@pytest.mark.parametrize("bank", ["mixtral", "llama4"])
def test_planted_adapter_terms_of_the_recomputed_pairs_are_refused_at_construction(monkeypatch, bank, plant):
    """The rule applies each expert's W_e + s B_e A_e as x W_e^T + s (x A_e^T) B_e^T (never forming the sum); the
    construction check compares that reading with PEFT's own forward, with random factors."""
    real = hf_experts.low_rank

    def planted(names, adapters, dtype):
        terms = real(names, adapters, dtype)
        if plant == "the adapter term dropped":
            return tuple(None for _ in terms)
        return tuple(  # (the shapes stay right: the comparison with PEFT's forward must see the values differ)
            None if t is None else expert_rules.LowRank(t.a.roll(1, 0), t.b.roll(1, 0), t.scaling) for t in terms
        )

    monkeypatch.setattr(hf_experts, "low_rank", planted)
    model = lora_on_the_experts(mixtral() if bank == "mixtral" else llama4())
    with pytest.raises(UnsupportedModelError, match=r"PEFT's LoRA on its experts .*does not compute"):
        PipelineDPTrainer(model, token_loss, stages=2, expected_batch_size=4)


def jetmoe_with_lora():
    """The tiny JetMoE with PEFT's LoRA on its experts' weights ([E, out, in], target_parameters) and its attention's
    key-value projection (inside its mixture-of-attention-experts block), both factors random."""
    peft = pytest.importorskip("peft")
    targets = ["mlp.input_linear.weight", "mlp.output_linear.weight"]
    config = peft.LoraConfig(r=2, target_modules=["kv_proj"], target_parameters=targets, init_lora_weights=False)
    return peft.get_peft_model(build(family("jetmoe")), config).base_model.model


@pytest.mark.parametrize("mode", ["ghost", "materialize"])
def test_jetmoe_s_blocks_replayed_per_sample_match_the_loop_with_lora_on_their_experts(mode):
    """JetMoE's experts are called on the tokens sorted by expert, and its attention is itself a mixture of experts:
    no closed-form rule reads them, so each block is one layer replayed one sample at a time (rules/generic.py
    LOOPED). With LoRA on the experts and the attention, 3 stages, left padding: the loop oracle's update, every
    adapter trained."""
    model = jetmoe_with_lora()
    inputs, labels = padded_batch("left")
    want = loop_clipped_sum(copy.deepcopy(model), hf_loss, inputs, labels, CLIP)
    got = pipedp_clipped_sum(model, token_loss, inputs, labels, CLIP, stages=3, microbatches=2, grad_mode=mode)
    assert max_relative_error(got, want) < 1e-12
    adapters = [k for k in got if ".lora_" in k]
    assert len(adapters) == 18 and all(float(got[k].abs().max()) > 0 for k in adapters)


def capped(real):
    """JetMoE's router with an expert capacity (planted): each expert keeps its first tokens of the micro-batch up to
    half a fair share, the others' gates zeroed, so a sample's output depends on the others'."""

    def forward(self, hidden_states):
        index_sorted_experts, batch_index, batch_gates, expert_size, logits = real(self, hidden_states)
        capacity = max(1, hidden_states.shape[0] * self.top_k // self.num_experts // 2)
        kept = torch.cat([torch.arange(n) < capacity for n in expert_size]).to(batch_gates.dtype)
        return index_sorted_experts, batch_index, batch_gates * kept, expert_size, logits

    return forward


@pytest.mark.parametrize("self_check", [True, False])
def test_planted_an_expert_capacity_in_a_block_replayed_per_sample_is_refused_at_its_first_call(self_check):
    """A block replayed one sample at a time is exact only if a sample alone gives its rows of the batch: at the
    block's first call the first and the last sample are replayed alone and compared, self-check or not; a router
    dropping tokens beyond an expert capacity (planted) is refused there, naming the block."""
    model = build(family("jetmoe"))
    router_type = type(model.model.layers[0].mlp.router)
    inputs, labels = padded_batch("right")
    with mock.patch.object(router_type, "forward", capped(router_type.forward)):
        with pytest.raises(
            UnsupportedModelError, match=r"layer 'model.layers.0.(mlp|self_attention)' \(JetMoe.*alone do"
        ):
            pipedp_clipped_sum(model, token_loss, inputs, labels, CLIP, stages=2, microbatches=2, self_check=self_check)


def test_planted_a_per_sample_replay_giving_each_gradient_to_another_sample_is_caught_by_the_self_check(monkeypatch):
    from pipedp.privacy.rules import generic

    def rolled(layer, inputs, backprops):
        return {p: g.roll(1, 0) for p, g in generic.looped_grads(layer, inputs, backprops).items()}

    monkeypatch.setattr(hf_experts, "LOOPED", dataclasses.replace(generic.LOOPED, grads=rolled))
    inputs, labels = padded_batch("right")
    with pytest.raises(UnsupportedModelError, match=r"disagree with their per-sample gradients.*\(JetMoe"):
        pipedp_clipped_sum(build(family("jetmoe")), token_loss, inputs, labels, CLIP, stages=2, microbatches=2)


def test_a_dropout_inside_a_block_replayed_per_sample_is_refused_at_its_first_call():
    """A block replayed one sample at a time must draw no random numbers (its replays would draw other masks than
    its forward): its forward run twice from two random states is compared at its first call, self-check or not;
    a dropout in JetMoE's attention (planted) is refused naming it."""
    model = build(family("jetmoe"))
    for layer in model.model.layers:
        layer.self_attention.attention_dropout = 0.5
    inputs, labels = padded_batch("right")
    with pytest.raises(UnsupportedModelError, match=r"layer 'model.layers.0.self_attention' .*draws random numbers"):
        pipedp_clipped_sum(model, token_loss, inputs, labels, CLIP, stages=2, microbatches=2, self_check=False)


def test_a_frozen_block_does_not_undo_the_per_sample_replay_of_a_trained_one_of_its_class():
    """The rules are registered per class: JetMoE's layer 1 frozen whole beside a trained layer 0 and 2 (the
    common "freeze some layers") keeps their blocks replayed per sample; exact."""
    model = build(family("jetmoe"))
    model.model.layers[1].requires_grad_(False)
    inputs, labels = padded_batch("left")
    want = loop_clipped_sum(copy.deepcopy(model), hf_loss, inputs, labels, CLIP)
    got = pipedp_clipped_sum(model, token_loss, inputs, labels, CLIP, stages=2, microbatches=2)
    assert max_relative_error(got, want) < 1e-9


def test_zaya_s_embedding_scales_on_its_base_model_are_refused_by_name_and_frozen_the_rest_matches_the_loop():
    """ZAYA's base model scales the embeddings with parameters of its own, read by its forward outside any module:
    no stage would hold them (they would not train), so they are refused by name while trainable. Frozen, the rest
    matches the loop oracle: its decoder layers pass the router states on to the next layer's router beside the
    hidden state (a stream that crosses stages: 3 stages here), and its router is an MLP, so each mixture-of-experts
    block is replayed per sample, its router states joined to its output."""
    model = build(dataclasses.replace(family("zaya"), frozen=()))
    with pytest.raises(UnsupportedModelError, match=r"model.input_hidden_states_scale, .* would not train; freeze it"):
        PipelineDPTrainer(model, token_loss, stages=2, expected_batch_size=4)
    model = build(family("zaya"))
    inputs, labels = padded_batch("left")
    want = loop_clipped_sum(copy.deepcopy(model), hf_loss, inputs, labels, CLIP)
    got = pipedp_clipped_sum(model, token_loss, inputs, labels, CLIP, stages=3, microbatches=2)
    assert max_relative_error(got, want) < 1e-12
    # (the stream carries gradient: layer 1's router reads layer 0's router states through its own scale)
    assert float(got["model.layers.1.mlp.gate.router_states_scale"].abs().max()) > 0


def test_zaya_splits_on_meta_its_base_model_s_own_scales_stood_in():
    """Built on meta (as a stage is loaded from a folder), ZAYA's dry run stands in the scales its base model holds
    itself, beside its parts' tensors."""
    from pipedp.split.adapters import model_blocks
    from pipedp.split.hf_loading import build_on_meta

    model = build_on_meta(tiny_config(family("zaya")))
    for name in family("zaya").frozen:
        model.get_parameter(name).requires_grad_(False)
    assert len(model_blocks(model)) == 5  # embeddings, 3 layers, head


def test_planted_a_forward_reading_the_last_layer_s_stream_after_the_layers_is_refused():
    """pipedp's head block reads the hidden state only: a ZAYA forward adding the last layer's router states into the
    final norm's input (planted, its source rewritten) is refused by the dry run, naming why."""
    import inspect
    import textwrap

    module = importlib.import_module("transformers.models.zaya.modeling_zaya")
    source = textwrap.dedent(inspect.getsource(module.ZayaModel.forward))
    source = source[source.index("def forward") :]
    final = "hidden_states = self.norm(hidden_states.to(dtype=self.norm.weight.dtype))"
    assert final in source
    planted = "hidden_states = self.norm((hidden_states + prev_router_hidden_states.sum(-1, keepdim=True)).float())"
    namespace: dict = {}
    exec(source.replace(final, planted), vars(module), namespace)
    with mock.patch.object(module.ZayaModel, "forward", namespace["forward"]):
        with pytest.raises(UnsupportedModelError, match=r"reads the last decoder layer's output beyond the hidden"):
            PipelineDPTrainer(build(family("zaya")), token_loss, stages=2, expected_batch_size=4)
