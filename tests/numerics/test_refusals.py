"""Refusals that name the real reason, at construction, with the way out: Opacus's DPMultiheadAttention with
add_bias_kv=True, PEFT's LoHa, LoKr (in training mode) and prompt / prefix tuning, Llama-4's text model without its head;
and the ways out they name, against the loop oracle."""

import copy
import warnings

import pytest
import torch
import torch.nn as nn
from hf_families import hf_loss
from oracles import loop_clipped_sum, max_relative_error
from steps import class_loss, tiny_llama_config

import pipedp.runtime.capture as capture
import pipedp.split.adapters as adapters
import pipedp.split.hf_structure as hf_structure
from pipedp import PipelineDPTrainer, UnsupportedModelError
from pipedp.models import token_loss

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
opacus_layers = pytest.importorskip("opacus.layers")


def sgd(p):
    return torch.optim.SGD(p, lr=1.0)


def trainer(model, loss_fn, **options):
    settings = dict(stages=2, microbatches=2, noise_multiplier=0.0, max_grad_norm=0.05, expected_batch_size=1)
    settings.update(options)
    return PipelineDPTrainer(model, loss_fn, sgd, **settings)


def step_error(model, loss_fn, oracle_loss, x, y, **options):
    want = loop_clipped_sum(copy.deepcopy(model), oracle_loss, x, y, 0.05)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the undeclared sampling
        trainer(model, loss_fn, **options).step(x, y)
    return max_relative_error({k: before[k] - p.detach() for k, p in model.named_parameters()}, want)


# ---- 7a: DPMultiheadAttention(add_bias_kv=True) --------------------------------------------------------------
class Attention(nn.Module):
    def __init__(self, **options):
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.attn = opacus_layers.DPMultiheadAttention(8, 2, batch_first=True, **options)
        self.out = nn.Linear(8, 3)

    def forward(self, x):
        h = self.inp(x)
        return self.out(self.attn(h, h, h, need_weights=False)[0].mean(1))


def attention_data(n=4, t=4):  # t == n: the capture's shape check could not tell time from batch
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, t, 8, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g)


def test_dp_multihead_attention_with_add_bias_kv_is_refused_for_its_bias_layout():
    torch.manual_seed(0)
    with pytest.raises(
        UnsupportedModelError,
        match=r"'attn.seq_bias_k' \(Opacus SequenceBias.*add_bias_kv=True.*sequence-first.*whatever its batch_first"
        r".*use add_bias_kv=False, or freeze the bias",
    ):
        trainer(Attention(add_bias_kv=True).double(), class_loss, stages=1)


def test_planted_without_the_layout_rule_the_refusal_blames_batch_first(monkeypatch):
    monkeypatch.setattr(capture, "_refuse_sequence_first", lambda name, module: None)
    x, y = attention_data()
    with pytest.raises(UnsupportedModelError, match="batch_first=True"):  # the old advice, already followed
        trainer(Attention(add_bias_kv=True).double(), class_loss, stages=1).step(x, y)


@pytest.mark.parametrize("frozen_bias", [False, True])
def test_the_ways_out_of_add_bias_kv_are_exact(frozen_bias):
    torch.manual_seed(0)
    model = Attention(add_bias_kv=frozen_bias).double()
    if frozen_bias:
        model.attn.seq_bias_k.bias.requires_grad_(False)
        model.attn.seq_bias_v.bias.requires_grad_(False)
    x, y = attention_data()
    assert step_error(model, class_loss, class_loss, x, y) < 1e-10


# ---- 7b: PEFT methods ---------------------------------------------------------------------------------------
def peft_llama(config):
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(tiny_llama_config(tie_word_embeddings=False)).double()
    return peft.get_peft_model(base, config)


def tokens():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 40, (6, 8), generator=g), torch.randint(0, 40, (6, 8), generator=g)


WAY_OUT = r"use LoRA, IA3, VeRA or OFT"


@pytest.mark.parametrize("wrapped", [True, False])  # the PeftModel, or the model inside it
def test_loha_is_refused_by_name(wrapped):
    model = peft_llama(peft.LoHaConfig(r=2, target_modules=["q_proj"]))
    model = model if wrapped else model.base_model.model
    with pytest.raises(UnsupportedModelError, match=rf"q_proj' is a PEFT LoHa adapter.*autograd.Function.*{WAY_OUT}"):
        trainer(model, token_loss)


def test_lokr_in_training_mode_is_refused_by_name_and_exact_in_eval_mode():
    model = peft_llama(peft.LoKrConfig(r=2, target_modules=["q_proj", "v_proj"], init_weights=False))
    with pytest.raises(
        UnsupportedModelError, match=rf"q_proj' is a PEFT LoKr adapter in training mode.*eval mode.*{WAY_OUT}"
    ):
        trainer(model, token_loss)
    inner = model.base_model.model.eval()
    x, y = tokens()
    assert step_error(inner, token_loss, hf_loss, x, y) < 1e-8


@pytest.mark.parametrize(
    "config, method",
    [
        (lambda: peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3), "PROMPT_TUNING"),
        (lambda: peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3), "PREFIX_TUNING"),
        (
            lambda: peft.PromptEncoderConfig(task_type="CAUSAL_LM", num_virtual_tokens=3, encoder_hidden_size=8),
            "P_TUNING",
        ),
    ],
)
def test_prompt_learning_is_refused_by_name(config, method):
    with pytest.raises(UnsupportedModelError, match=rf"PEFT {method} \(prompt / prefix tuning\).*{WAY_OUT}"):
        trainer(peft_llama(config()), token_loss)


@pytest.mark.parametrize("kind", ["loha", "prompt"])
def test_planted_without_the_peft_rule_the_refusal_shows_internals(monkeypatch, kind):
    monkeypatch.setattr(adapters, "_refuse_peft_methods", lambda model: None)
    if kind == "loha":
        model, internals = peft_llama(peft.LoHaConfig(r=2, target_modules=["q_proj"])), "vmap"
    else:
        model = peft_llama(peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3))
        internals = "could not be traced"
    with pytest.raises(UnsupportedModelError, match=internals):
        x, y = tokens()
        trainer(model, token_loss).step(x, y)


# ---- 7c: Llama-4's text model --------------------------------------------------------------------------------
def llama4_config(**overrides):
    fields = dict(
        vocab_size=40,
        hidden_size=16,
        intermediate_size=32,
        intermediate_size_mlp=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        num_local_experts=2,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )
    fields.update(overrides)
    return transformers.Llama4TextConfig(**fields)


# Llama4ForCausalLM trains its experts exactly (tests/numerics/test_moe.py); its text model alone has no head
MOE = r"feed_forward \(Llama4TextMoe\) is a mixture of experts"


def test_llama4_text_model_without_a_head_is_refused_as_a_mixture_of_experts():
    with pytest.raises(UnsupportedModelError, match=rf"layers.0.{MOE}.*only inside a Hugging Face decoder"):
        trainer(transformers.Llama4TextModel(llama4_config()), token_loss)


def test_planted_without_the_base_model_lookup_the_refusal_says_no_base_model(monkeypatch):
    # Llama4ForCausalLM's base_model_prefix ("language_model") names no attribute: base_model is the model itself
    monkeypatch.setattr(hf_structure, "_base_model", lambda model: getattr(model, "base_model", model))
    monkeypatch.setattr(hf_structure, "refuse_experts", lambda *args: None)
    with pytest.raises(UnsupportedModelError, match="has no base model under its head"):
        trainer(transformers.Llama4ForCausalLM(llama4_config()), token_loss)


def test_a_dense_llama4_is_found_under_its_head_and_exact():
    torch.manual_seed(0)
    model = transformers.Llama4ForCausalLM(llama4_config(moe_layers=[])).double()
    x, y = tokens()
    assert step_error(model, token_loss, hf_loss, x, y) < 1e-10
