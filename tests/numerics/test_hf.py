"""Hugging Face GPT-2 and Llama: split forward equals the whole model; DP step equals the
batch-size-1 loop oracle; tied weights; checkpoints loaded stage by stage from the meta device."""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
from oracles import loop_clipped_sum, max_relative_error  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM  # noqa: E402

from pipedp import PipelineDPTrainer, UnsupportedModelError  # noqa: E402
from pipedp.models import token_loss  # noqa: E402
from pipedp.split.adapters import model_blocks  # noqa: E402
from pipedp.split.hf_loading import build_on_meta, load_pipeline_stage, resident_parameter_bytes  # noqa: E402
from pipedp.split.partition import partition  # noqa: E402

VOCAB, SEQ = 40, 8


def gpt2():
    torch.manual_seed(0)
    cfg = GPT2Config(
        vocab_size=VOCAB,
        n_positions=16,
        n_embd=16,
        n_layer=4,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(cfg).double()


def llama():
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    return LlamaForCausalLM(cfg).double()


def batch(n=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n, SEQ), generator=g), torch.randint(0, VOCAB, (n, SEQ), generator=g)


@pytest.mark.parametrize("build", [gpt2, llama])
@pytest.mark.parametrize("stages", [2, 4])
def test_split_forward_equals_whole_model(build, stages):
    model = build()
    x, y = batch()
    whole = model(x).logits
    blocks = partition(model_blocks(model, untie_weights=True), stages, "params")
    out = x
    for stage in blocks:
        for b in stage:
            out = b.module(out)
    assert torch.allclose(out, whole, rtol=0, atol=1e-12)
    assert torch.allclose(token_loss(out, y), token_loss(whole, y), atol=1e-12)


@pytest.mark.parametrize("build", [gpt2, llama])
@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("mode", ["ghost", "materialize"])
def test_dp_step_matches_the_loop_oracle(build, stages, mode):
    model = build()
    x, y = batch()
    trainer = PipelineDPTrainer(
        model,
        token_loss,
        lambda p: torch.optim.SGD(p, lr=1.0),
        stages=stages,
        microbatches=3,
        noise_multiplier=0.0,
        max_grad_norm=0.3,
        expected_batch_size=1,
        grad_mode=mode,
        untie_weights=True,
    )
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    oracle_model = copy.deepcopy(model)  # untied by the trainer: the oracle trains the same untied model
    want = loop_clipped_sum(oracle_model, lambda out, t: token_loss(out.logits, t), x, y, 0.3)
    trainer.step(x, y)
    got = {k: before[k] - p.detach() for k, p in model.named_parameters()}
    assert max_relative_error(got, want) < 1e-8


def test_gpt2_tied_weights_on_one_stage_match_the_loop_oracle():
    model = gpt2()
    assert model.lm_head.weight is model.transformer.wte.weight
    x, y = batch()
    want = loop_clipped_sum(copy.deepcopy(model), lambda out, t: token_loss(out.logits, t), x, y, 0.3)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    PipelineDPTrainer(
        model,
        token_loss,
        lambda p: torch.optim.SGD(p, lr=1.0),
        stages=1,
        microbatches=2,
        noise_multiplier=0.0,
        max_grad_norm=0.3,
        expected_batch_size=1,
    ).step(x, y)
    got = {k: before[k] - p.detach() for k, p in model.named_parameters()}
    assert max_relative_error(got, want) < 1e-8


@pytest.mark.parametrize("build", [gpt2, llama])
@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("mode", ["ghost", "materialize"])
def test_tied_embedding_across_stages_matches_the_tied_loop_oracle(build, stages, mode):
    model = build()
    model.lm_head.weight = model.get_input_embeddings().weight  # tied, as GPT-2 and Llama-3.2 ship
    model.config.tie_word_embeddings = True
    x, y = batch()
    want = loop_clipped_sum(copy.deepcopy(model), lambda out, t: token_loss(out.logits, t), x, y, 0.3)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    PipelineDPTrainer(
        model,
        token_loss,
        lambda p: torch.optim.SGD(p, lr=1.0),
        stages=stages,
        microbatches=3,
        noise_multiplier=0.0,
        max_grad_norm=0.3,
        expected_batch_size=1,
        grad_mode=mode,
    ).step(x, y)
    got = {k: before[k] - p.detach() for k, p in model.named_parameters()}
    assert max_relative_error(got, want) < 1e-8
    assert model.lm_head.weight is model.get_input_embeddings().weight  # still one tensor
    untied = copy.deepcopy(build())  # the cross term matters: DP-SGD on the untied model differs
    untied.lm_head.weight = torch.nn.Parameter(untied.get_input_embeddings().weight.detach().clone())
    other = loop_clipped_sum(untied, lambda out, t: token_loss(out.logits, t), x, y, 0.3)
    name = "transformer.wte.weight" if build is gpt2 else "model.embed_tokens.weight"
    assert max_relative_error({name: got[name]}, {name: other[name]}) > 1e-3


def test_tied_weights_need_flat_clipping():
    model = gpt2()
    with pytest.raises(UnsupportedModelError, match="tied weights across stages.*clipping='flat'"):
        PipelineDPTrainer(model, token_loss, stages=2, expected_batch_size=4, clipping="per_stage")


@pytest.mark.parametrize("build", [gpt2, llama])
def test_checkpoint_loads_stage_by_stage(build, tmp_path):
    model = build().float()
    model.config.tie_word_embeddings = False if build is llama else True
    # sharded safetensors with an index file
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    whole = type(model).from_pretrained(tmp_path)
    stages = 2
    total = resident_parameter_bytes(whole)
    blocks_meta = partition(model_blocks(build_on_meta(str(tmp_path)), untie_weights=True), stages, "params")
    shares = [sum(p.numel() * 4 for b in s for p in b.module.parameters()) for s in blocks_meta]
    for stage in range(stages):
        part = load_pipeline_stage(str(tmp_path), stages, stage, untie_weights=True)
        resident = resident_parameter_bytes(part)
        assert resident == shares[stage] and resident < 0.8 * total
        loaded = {k: v for k, v in part.state_dict().items() if not v.is_meta}
        for k, v in loaded.items():
            want = whole.state_dict()[k if k in whole.state_dict() else "transformer.wte.weight"]
            assert torch.equal(v, want), k
    # every stage materialised, the pipelined model gives the whole model's logits
    x, _ = batch()
    blocks = [
        partition(
            model_blocks(load_pipeline_stage(str(tmp_path), stages, s, untie_weights=True), untie_weights=True),
            stages,
            "params",
        )[s]
        for s in range(stages)
    ]
    out = x
    for stage in blocks:
        for b in stage:
            out = b.module(out)
    assert torch.allclose(out, whole(x).logits, atol=1e-5)


@pytest.mark.parametrize("reentrant", [True, False])
def test_activation_checkpointing_non_reentrant_is_exact_reentrant_is_refused(reentrant):
    model = llama()
    model.train()
    oracle_model = copy.deepcopy(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    x, y = batch()
    make = lambda: PipelineDPTrainer(
        model,
        token_loss,
        lambda p: torch.optim.SGD(p, lr=1.0),
        stages=2,  # noqa: E731
        microbatches=3,
        noise_multiplier=0.0,
        max_grad_norm=0.3,
        expected_batch_size=1,
        untie_weights=True,
    )
    if reentrant:
        with pytest.raises(UnsupportedModelError, match="reentrant activation checkpointing.*use_reentrant': False"):
            make()
        return
    trainer = make()
    oracle_model.lm_head.weight = torch.nn.Parameter(oracle_model.lm_head.weight.detach().clone())
    want = loop_clipped_sum(oracle_model, lambda out, t: token_loss(out.logits, t), x, y, 0.3)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    trainer.step(x, y)
    got = {k: before[k] - p.detach() for k, p in model.named_parameters()}
    assert max_relative_error(got, want) < 1e-8


def padded_batch(side):
    """7 sequences of lengths 3..8, padded on the ``side``; labels -100 on the padding."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(1, VOCAB, (7, SEQ), generator=g)
    labels = torch.randint(1, VOCAB, (7, SEQ), generator=g)
    mask = torch.zeros(7, SEQ, dtype=torch.long)
    for i, length in enumerate([8, 3, 5, 8, 4, 6, 7]):
        cols = slice(0, length) if side == "right" else slice(SEQ - length, SEQ)
        mask[i, cols] = 1
    ids = ids.masked_fill(mask == 0, 0)
    labels = labels.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask}, labels


@pytest.mark.parametrize("build", [gpt2, llama])
@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("mode", ["ghost", "materialize"])
def test_padded_batches_with_attention_masks_match_the_loop_oracle(build, side, mode):
    model = build()
    inputs, labels = padded_batch(side)
    oracle_model = copy.deepcopy(model)
    oracle_model.lm_head.weight = torch.nn.Parameter(oracle_model.lm_head.weight.detach().clone())  # untied
    params = dict(oracle_model.named_parameters())
    want = {k: torch.zeros_like(p) for k, p in params.items()}
    for i in range(7):  # the oracle: the whole model, one padded sequence at a time, with its mask
        oracle_model.zero_grad(set_to_none=True)
        out = oracle_model(input_ids=inputs["input_ids"][i : i + 1], attention_mask=inputs["attention_mask"][i : i + 1])
        token_loss(out.logits, labels[i : i + 1]).sum().backward()
        norm = torch.sqrt(sum((p.grad**2).sum() for p in params.values() if p.grad is not None))
        for k, p in params.items():
            if p.grad is not None:
                want[k] += min(1.0, 0.3 / (float(norm) + 1e-6)) * p.grad
    trainer = PipelineDPTrainer(
        model,
        token_loss,
        lambda p: torch.optim.SGD(p, lr=1.0),
        stages=3,
        microbatches=3,
        noise_multiplier=0.0,
        max_grad_norm=0.3,
        expected_batch_size=1,
        grad_mode=mode,
        untie_weights=True,
    )
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    trainer.step(inputs, labels)
    got = {k: before[k] - p.detach() for k, p in model.named_parameters()}
    assert max_relative_error(got, want) < 1e-8
    if side == "left":  # there the masks matter (right padding sits behind the causal mask anyway)
        unmasked = copy.deepcopy(oracle_model)
        assert (
            max_relative_error(
                got, loop_clipped_sum(unmasked, lambda o, t: token_loss(o.logits, t), inputs["input_ids"], labels, 0.3)
            )
            > 1e-4
        )


def family(model_type, attn="sdpa", **extra):
    torch.manual_seed(0)
    common = dict(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    if model_type in ("gemma", "gemma2"):
        common["head_dim"] = 8
    cfg = transformers.AutoConfig.for_model(model_type, **{**common, **extra})
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).double()


FAMILIES = [
    ("mistral", {"sliding_window": None}),
    ("mistral", {"sliding_window": 8}),
    ("qwen2", {}),
    ("qwen3", {}),
    ("phi3", {}),
    ("gemma", {}),
    ("gpt_neox", {}),
]


@pytest.mark.parametrize("model_type, extra", FAMILIES)
@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("mode", ["ghost", "materialize"])
@pytest.mark.parametrize("tied", [False, True])
def test_llama_like_families_match_the_loop_oracle(model_type, extra, stages, mode, tied):
    model = family(model_type, tie_word_embeddings=tied, **extra)
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tied
    x, y = batch()
    want = loop_clipped_sum(copy.deepcopy(model), lambda out, t: token_loss(out.logits, t), x, y, 0.3)
    trainer = PipelineDPTrainer(
        model,
        token_loss,
        lambda p: torch.optim.SGD(p, lr=1.0),
        stages=stages,
        microbatches=3,
        noise_multiplier=0.0,
        max_grad_norm=0.3,
        expected_batch_size=1,
        grad_mode=mode,
    )
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    trainer.step(x, y)
    got = {k: before[k] - p.detach() for k, p in model.named_parameters()}
    assert max_relative_error(got, want) < 1e-8


def test_a_sliding_window_shorter_than_the_sequence_is_refused_and_other_families_by_name():
    short = family("mistral", sliding_window=4)  # SEQ = 8 > 4
    trainer = PipelineDPTrainer(short, token_loss, stages=2, microbatches=2, expected_batch_size=4, untie_weights=True)
    with pytest.raises(UnsupportedModelError, match="sliding window of 4 tokens, shorter than these sequences"):
        trainer.step(*batch())
    capped = family("gemma2", attn="eager", final_logit_softcapping=30.0)  # logits capped after the head
    with pytest.raises(UnsupportedModelError, match=r"Gemma2ForCausalLM \(model_type 'gemma2'\) is not one of"):
        PipelineDPTrainer(capped, token_loss, stages=2, expected_batch_size=4)
