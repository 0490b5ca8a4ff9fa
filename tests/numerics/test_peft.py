"""PEFT through the pipeline, against the batch-size-1 loop oracle: LoRA on linear layers, LoRA on the
embedding (its tensors sit in ParameterDicts its layer reads itself), IA3; and the adapters PEFT reloads."""

import copy

import pytest
import torch

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from hf_families import hf_loss  # noqa: E402
from oracles import loop_clipped_sum, max_relative_error  # noqa: E402
from steps import tiny_llama_config  # noqa: E402

from pipedp import PipelineDPTrainer, UnsupportedModelError  # noqa: E402
from pipedp.models import token_loss  # noqa: E402


def peft_llama(config):
    torch.manual_seed(0)
    cfg = tiny_llama_config(tie_word_embeddings=False)
    return peft.get_peft_model(transformers.LlamaForCausalLM(cfg).double(), config).base_model.model


def lora_llama(targets, modules_to_save=None):
    config = peft.LoraConfig(r=4, target_modules=targets, init_lora_weights=False, modules_to_save=modules_to_save)
    return peft_llama(config)  # the LlamaForCausalLM with LoRA layers inside


def batch():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 40, (6, 8), generator=g), torch.randint(0, 40, (6, 8), generator=g)


@pytest.mark.parametrize("mode", ["ghost", "materialize", "keep"])
@pytest.mark.parametrize(
    "targets, saved",
    [(["q_proj", "v_proj", "down_proj"], None), ("all-linear", None), (["q_proj", "v_proj"], ["lm_head"])],
)
def test_lora_on_linear_layers_matches_the_loop_oracle(mode, targets, saved):
    model = lora_llama(targets, saved)
    x, y = batch()
    want = loop_clipped_sum(copy.deepcopy(model), hf_loss, x, y, 0.05)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    PipelineDPTrainer(
        model,
        token_loss,
        lambda p: torch.optim.SGD(p, lr=1.0),
        stages=2,
        microbatches=3,
        noise_multiplier=0.0,
        max_grad_norm=0.05,
        expected_batch_size=1,
        grad_mode=mode,
    ).step(x, y)
    got = {k: before[k] - p.detach() for k, p in model.named_parameters()}
    assert max_relative_error(got, want) < 1e-8
    assert any("lora_A" in k and float(v.abs().max()) > 0 for k, v in got.items())
    trained = ("lora", "modules_to_save")
    assert all(float(v.abs().max()) == 0 for k, v in got.items() if not any(t in k for t in trained))  # base frozen
    if saved:
        assert any("modules_to_save" in k and float(v.abs().max()) > 0 for k, v in got.items())


def dp_change(model, x, y, **kw):
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    options = dict(stages=2, microbatches=3, noise_multiplier=0.0, max_grad_norm=0.05, expected_batch_size=1)
    options.update(kw)
    PipelineDPTrainer(model, token_loss, lambda p: torch.optim.SGD(p, lr=1.0), **options).step(x, y)
    return {k: before[k] - p.detach() for k, p in model.named_parameters()}


@pytest.mark.parametrize("mode", ["ghost", "materialize"])
@pytest.mark.parametrize("stages", [2, 3])
def test_lora_on_the_embedding_matches_the_loop_oracle(mode, stages):
    model = lora_llama(["embed_tokens", "q_proj"])
    x, y = batch()
    want = loop_clipped_sum(copy.deepcopy(model), hf_loss, x, y, 0.05)
    got = dp_change(model, x, y, grad_mode=mode, stages=stages)
    assert max_relative_error(got, want) < 1e-8
    assert any("lora_embedding_A" in k and float(v.abs().max()) > 0 for k, v in got.items())


@pytest.mark.parametrize("feedforward", [[], ["down_proj"]])
def test_ia3_matches_the_loop_oracle(feedforward):
    config = peft.IA3Config(
        target_modules=["k_proj", "v_proj", "down_proj"], feedforward_modules=feedforward, init_ia3_weights=False
    )
    model = peft_llama(config)
    x, y = batch()
    want = loop_clipped_sum(copy.deepcopy(model), hf_loss, x, y, 0.05)
    got = dp_change(model, x, y)
    assert max_relative_error(got, want) < 1e-8
    assert any("ia3_l" in k and float(v.abs().max()) > 0 for k, v in got.items())


def test_a_lora_embedding_adapter_saved_after_training_reloads_in_peft(tmp_path):
    torch.manual_seed(0)
    cfg = tiny_llama_config()
    base = transformers.LlamaForCausalLM(cfg).double()
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["embed_tokens", "q_proj"]))
    trainer = PipelineDPTrainer(model, token_loss, stages=2, expected_batch_size=4, noise_multiplier=0.5)
    x, y = batch()
    trainer.step(x, y)
    trainer.save_pretrained(str(tmp_path / "adapter"))
    torch.manual_seed(0)
    fresh = transformers.LlamaForCausalLM(cfg).double()
    reloaded = peft.PeftModel.from_pretrained(fresh, str(tmp_path / "adapter"))
    trained = dict(model.named_parameters())
    for name, p in reloaded.named_parameters():
        if "lora_embedding" in name:
            assert torch.equal(p, trained[name])


def test_a_peft_model_is_accepted_directly_under_its_own_names():
    inner = lora_llama(["q_proj", "v_proj"])
    wrapped = copy.deepcopy(inner)
    torch.manual_seed(0)
    cfg = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    torch.manual_seed(0)
    model = peft.get_peft_model(transformers.LlamaForCausalLM(wrapped.config).double(), cfg)
    model.base_model.model.load_state_dict(inner.state_dict())  # the same weights as the inner-model run
    x, y = batch()
    want = loop_clipped_sum(copy.deepcopy(inner), hf_loss, x, y, 0.05)
    trainer = PipelineDPTrainer(
        model,
        token_loss,
        lambda p: torch.optim.SGD(p, lr=1.0),
        stages=2,
        microbatches=3,
        noise_multiplier=0.0,
        max_grad_norm=0.05,
        expected_batch_size=1,
    )
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    trainer.step(x, y)
    state = trainer.state_dict()
    assert list(state) == list(model.state_dict())  # the PeftModel's own names, all of them
    got = {k.removeprefix("base_model.model."): before[k] - p.detach() for k, p in model.named_parameters()}
    assert max_relative_error(got, want) < 1e-8


def test_save_pretrained_round_trips_a_model_and_an_adapter(tmp_path):
    x, y = batch()
    cfg = tiny_llama_config()
    torch.manual_seed(0)
    plain = transformers.LlamaForCausalLM(cfg).double()
    trainer = PipelineDPTrainer(
        plain,
        token_loss,
        lambda p: torch.optim.SGD(p, lr=0.5),
        stages=2,
        microbatches=2,
        noise_multiplier=1.0,
        expected_batch_size=6,
    )
    trainer.step(x, y)
    trainer.save_pretrained(str(tmp_path / "model"))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "model")).double()
    assert torch.equal(reloaded(x).logits, plain(x).logits)

    lora = peft.get_peft_model(
        copy.deepcopy(reloaded), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    trainer = PipelineDPTrainer(
        lora,
        token_loss,
        lambda p: torch.optim.SGD(p, lr=0.5),
        stages=2,
        microbatches=2,
        noise_multiplier=1.0,
        expected_batch_size=6,
    )
    trainer.step(x, y)
    trainer.save_pretrained(str(tmp_path / "adapter"))
    adapted = peft.PeftModel.from_pretrained(copy.deepcopy(reloaded), str(tmp_path / "adapter"))
    assert torch.equal(adapted(x).logits, lora(x).logits)
    assert not torch.equal(adapted(x).logits, reloaded(x).logits)  # the adapter really moved


def test_dora_is_refused_by_name():
    cfg = tiny_llama_config()
    model = peft.get_peft_model(
        transformers.LlamaForCausalLM(cfg), peft.LoraConfig(r=4, target_modules=["q_proj"], use_dora=True)
    )
    with pytest.raises(UnsupportedModelError, match=r"q_proj' is a DoRA adapter.*use plain LoRA"):
        PipelineDPTrainer(model, token_loss, stages=2, expected_batch_size=4)


def test_a_peft_model_around_a_traced_two_input_model_matches_the_loop_oracle():
    """PeftModel around a plain module (traced split, a dict of two inputs, tuples crossing the cut)."""
    from loop_models import MaskedNet

    torch.manual_seed(0)
    base = MaskedNet().double()
    model = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["fc", "mix"], init_lora_weights=False))
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 11, (5, 4), generator=g)
    x, y = {"ids": ids, "mask": torch.ones_like(ids)}, torch.randint(0, 11, (5, 4), generator=g)
    want = loop_clipped_sum(copy.deepcopy(base), token_loss, x, y, 0.05)
    before = {k: v.detach().clone() for k, v in base.named_parameters()}
    PipelineDPTrainer(
        model,
        token_loss,
        lambda p: torch.optim.SGD(p, lr=1.0),
        stages=2,
        microbatches=2,
        noise_multiplier=0.0,
        max_grad_norm=0.05,
        expected_batch_size=1,
    ).step(x, y)
    got = {k: before[k] - p.detach() for k, p in base.named_parameters()}
    assert max_relative_error(got, want) < 1e-10
    assert any("lora_A" in k and float(v.abs().max()) > 0 for k, v in got.items())
