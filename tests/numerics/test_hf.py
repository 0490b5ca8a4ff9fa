"""Hugging Face models beyond the family matrix (test_hf_families.py): plain token-id inputs, ties
(one stage, the cross term, per-stage clipping), eager attention in a DP step, several batch shapes
through one trainer, activation checkpointing, what the masks and windows change, checkpoints loaded
stage by stage from the meta device, and the refusals at construction. Every DP step is compared
with the loop oracle: batch-size-1 passes through the Hugging Face model itself."""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
from hf_families import CLIP, FAMILIES, build, dp_update, hf_loss, padded_batch, sequence_loss, tiny_config  # noqa: E402
from oracles import loop_clipped_sum, max_relative_error  # noqa: E402

from pipedp import BatchError, PipelineDPTrainer, UnsupportedModelError  # noqa: E402
from pipedp.models import token_loss  # noqa: E402
from pipedp.split.adapters import model_blocks  # noqa: E402
from pipedp.split.hf_loading import build_on_meta, load_pipeline_stage, resident_parameter_bytes  # noqa: E402
from pipedp.split.partition import partition  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:step\\(\\) got a batch whose sampling is not declared")
FAMILY = {f.name: f for f in FAMILIES}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def token_batch(n=7, seq=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 40, (n, seq), generator=g), torch.randint(0, 40, (n, seq), generator=g)


@pytest.mark.parametrize("name, stages", [("gpt2", 4), ("llama", 3), ("opt", 4), ("bloom (alibi)", 3)])
def test_plain_token_ids_match_the_loop_oracle(name, stages):
    """No input dict: the later stages recompute positions and masks from the hidden state's shape."""
    model = build(FAMILY[name])
    x, y = token_batch()
    want = loop_clipped_sum(copy.deepcopy(model), hf_loss, x, y, CLIP)
    assert max_relative_error(dp_update(model, token_loss, x, y, stages=stages), want) < 1e-12


def test_a_users_subclass_with_its_own_forward_is_split_as_its_family_and_matches_the_loop_oracle():
    """The adapter knows the family from the class the user's derives from, and drives the user's own forward."""
    family = build(FAMILY["llama"]).__class__

    class Rescaled(family):  # (no *ForCausalLM in its name)
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = 0.5 * out.logits + 1.0
            return out

    torch.manual_seed(0)
    model = Rescaled(build(FAMILY["llama"]).config).double()
    inputs, labels = padded_batch("left")
    plain = build(FAMILY["llama"])
    plain.load_state_dict(model.state_dict())  # the same weights without the user's rescaling
    want = loop_clipped_sum(copy.deepcopy(model), hf_loss, inputs, labels, CLIP)
    got = dp_update(model, token_loss, inputs, labels, stages=3)
    assert max_relative_error(got, want) < 1e-12
    assert max_relative_error(dp_update(plain, token_loss, inputs, labels, stages=3), want) > 1e-3  # (it matters)


def test_tied_weights_on_one_stage_match_the_loop_oracle():
    model = build(FAMILY["gpt2"], tie=True)
    x, y = token_batch()
    want = loop_clipped_sum(copy.deepcopy(model), hf_loss, x, y, CLIP)
    assert max_relative_error(dp_update(model, token_loss, x, y, stages=1, microbatches=2), want) < 1e-12


@pytest.mark.parametrize("name", ["gpt2", "gemma"])
def test_the_tie_cross_term_matters(name):
    """The tied step equals the tied oracle (test_hf_families), and differs from the untied one: the
    matrix's tied runs would catch a missing cross term."""
    model = build(FAMILY[name], tie=True)
    inputs, labels = padded_batch("right")
    got = dp_update(copy.deepcopy(model), token_loss, inputs, labels, stages=2)
    untied = copy.deepcopy(model)
    untied.lm_head.weight = torch.nn.Parameter(untied.get_input_embeddings().weight.detach().clone())
    other = loop_clipped_sum(untied, hf_loss, inputs, labels, CLIP)
    key = next(k for k in got if "embed" in k or "wte" in k)
    assert max_relative_error({key: got[key]}, {key: other[key]}) > 1e-3


def test_tied_weights_need_flat_clipping():
    with pytest.raises(UnsupportedModelError, match="tied weights across stages.*clipping='flat'"):
        PipelineDPTrainer(
            build(FAMILY["gpt2"], tie=True), token_loss, stages=2, expected_batch_size=4, clipping="per_stage"
        )


@pytest.mark.parametrize("mode", ["ghost", "materialize"])
def test_eager_attention_matches_the_loop_oracle(mode):
    """Right padding: eager attention's own output is NaN where a query sees no key (left padding)."""
    model = build(FAMILY["llama"], attention="eager")
    inputs, labels = padded_batch("right")
    want = loop_clipped_sum(copy.deepcopy(model), hf_loss, inputs, labels, CLIP)
    assert max_relative_error(dp_update(model, token_loss, inputs, labels, stages=3, grad_mode=mode), want) < 1e-12


def test_one_trainer_through_several_batch_shapes_matches_the_loop_oracle():
    """What a stage recomputes per micro-batch follows each batch's shape and masks (nothing stale)."""
    model = build(FAMILY["mistral (sliding window 4)"])
    trainer = PipelineDPTrainer(
        model,
        token_loss,
        lambda p: torch.optim.SGD(p, lr=1.0),
        stages=3,
        microbatches=3,
        noise_multiplier=0.0,
        max_grad_norm=CLIP,
        expected_batch_size=1,
    )
    for step, (side, length) in enumerate([("left", 8), ("right", 6), ("left", 5)]):
        inputs, labels = padded_batch(side, seed=step)
        inputs = {k: v[:, -length:] if side == "left" else v[:, :length] for k, v in inputs.items()}
        labels = labels[:, -length:] if side == "left" else labels[:, :length]
        want = loop_clipped_sum(copy.deepcopy(model), hf_loss, inputs, labels, CLIP)
        before = {k: v.detach().clone() for k, v in model.named_parameters()}
        trainer.step(inputs, labels)
        got = {k: before[k] - p.detach() for k, p in model.named_parameters()}
        assert max_relative_error(got, want) < 1e-12, (side, length)


@pytest.mark.parametrize("reentrant", [True, False])
def test_activation_checkpointing_non_reentrant_is_exact_reentrant_is_refused(reentrant):
    model = build(FAMILY["llama"])
    oracle_model = copy.deepcopy(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    x, y = token_batch()
    if reentrant:
        with pytest.raises(UnsupportedModelError, match="reentrant activation checkpointing.*use_reentrant': False"):
            PipelineDPTrainer(model, token_loss, stages=2, expected_batch_size=1)
        return
    want = loop_clipped_sum(oracle_model, hf_loss, x, y, CLIP)
    assert max_relative_error(dp_update(model, token_loss, x, y, stages=2), want) < 1e-12


def test_activation_checkpointing_is_refused_where_a_layers_calls_need_hooks():
    model = build(FAMILY["opt"])  # its feed-forward runs on [batch * seq, hidden] (hf_capturable.py)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with pytest.raises(UnsupportedModelError, match=r"model.decoder.layers.0: .*disable activation checkpointing"):
        PipelineDPTrainer(model, token_loss, stages=2, expected_batch_size=1)


def test_the_masks_and_the_sliding_window_change_the_models_output():
    """The test batches exercise what pipedp must reproduce: left padding changes the logits of the
    real tokens, and a window of 4 changes those of the 8-token sequences (test_hf_families shows the
    pipelined forward equal to the model's own with both)."""
    family = FAMILY["mistral (sliding window 4)"]
    model = build(family).eval()
    inputs, _ = padded_batch("left")
    real = inputs["attention_mask"].bool()
    masked = model(**inputs).logits
    assert not torch.allclose(masked[real], model(inputs["input_ids"]).logits[real])
    full = build(family.__class__("mistral", config={"sliding_window": None})).eval()
    assert not torch.allclose(masked[real], full(**inputs).logits[real])


def test_other_attention_implementations_are_refused_at_construction_by_name():
    model = build(FAMILY["llama"])
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(
        UnsupportedModelError, match="LlamaForCausalLM: attention implementation 'flex_attention'.*sdpa"
    ):
        PipelineDPTrainer(model, token_loss, stages=2, expected_batch_size=4)


def test_a_classifier_needs_its_token_ids_on_the_last_stage():
    model = build(FAMILY["llama"], "classification")
    trainer = PipelineDPTrainer(model, sequence_loss, stages=2, microbatches=2, expected_batch_size=4)
    with pytest.raises(BatchError, match="last token that is not padding.*as a dict"):
        trainer.step(token_batch(4)[0], torch.arange(4) % 3)


@pytest.mark.parametrize(
    "name, side, targets", [("llama", "right", ["q_proj", "v_proj", "down_proj"]), ("opt", "left", ["q_proj", "fc1"])]
)
def test_a_lora_classifier_with_its_score_saved_matches_the_loop_oracle(name, side, targets):
    """OPT's fc1 runs on [batch * seq, hidden] (hf_capturable.py): its LoRA layers too."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(
        task_type="SEQ_CLS",
        r=4,
        target_modules=targets,
        modules_to_save=["score"],
        init_lora_weights=False,
    )
    model = peft.get_peft_model(build(FAMILY[name], "classification"), config)
    inputs, _ = padded_batch(side)
    labels = torch.arange(len(inputs["input_ids"])) % 3
    want = loop_clipped_sum(copy.deepcopy(model), lambda out, y: sequence_loss(out.logits, y), inputs, labels, CLIP)
    got = dp_update(model, sequence_loss, inputs, labels, stages=3)
    assert max_relative_error(got, want) < 1e-12
    trained = {k for k, v in got.items() if float(v.abs().max()) > 0}
    assert trained and all("lora_" in k or "modules_to_save" in k for k in trained)
    assert any("modules_to_save" in k and "score" in k for k in trained)


LOADED = ["gpt2", "llama", "gemma", "gpt_neox", "opt", "falcon (parallel attention, alibi)", "bloom (alibi)"]


@pytest.mark.parametrize("name", LOADED)
def test_checkpoints_load_stage_by_stage(name, tmp_path):
    """Each stage materialized from the (sharded) checkpoint alone, its buffers not saved in checkpoints
    recomputed (rotary frequencies, Gemma's embedding scale), tied heads kept tied, renamed tensors
    found (GPT-NeoX saves its head as embed_out): the stages together give the whole model's logits."""
    family = FAMILY[name]
    tied = name in ("gpt2", "gemma")
    model = build(family, tie=tied).float()
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    whole = type(model).from_pretrained(tmp_path, attn_implementation=family.attention[0]).eval()
    stages = 3
    meta = partition(model_blocks(build_on_meta(str(tmp_path), family.attention[0])), stages, "params")
    shares = [sum(p.numel() * 4 for b in s for p in b.module.parameters()) for s in meta]
    inputs, _ = padded_batch("right" if family.eager_only else "left")
    out = inputs
    for stage in range(stages):
        part = load_pipeline_stage(str(tmp_path), stages, stage, "params", attn_implementation=family.attention[0])
        part.eval()
        assert resident_parameter_bytes(part) == shares[stage] < 0.8 * resident_parameter_bytes(whole)
        for block in partition(model_blocks(part), stages, "params")[stage]:
            out = block.module(out, side_inputs=inputs)
        if tied and stage == stages - 1:
            assert part.get_output_embeddings().weight is part.get_input_embeddings().weight
    assert torch.allclose(out, whole(**inputs).logits, rtol=0, atol=1e-6)


def test_a_classifier_checkpoint_loads_stage_by_stage(tmp_path):
    family = FAMILY["llama"]
    model = build(family, "classification").float()
    model.save_pretrained(tmp_path)
    whole = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path).eval()
    inputs, _ = padded_batch("right")
    out = inputs
    for stage in range(2):
        part = load_pipeline_stage(str(tmp_path), 2, stage, "params").eval()
        for block in partition(model_blocks(part), 2, "params")[stage]:
            out = block.module(out, side_inputs=inputs)
    assert out.shape == (len(inputs["input_ids"]), 3) and torch.allclose(out, whole(**inputs).logits, rtol=0, atol=1e-6)


def test_a_meta_model_without_its_rotary_buffers_is_refused_naming_the_way_out():
    """A model built on meta by hand has no value for the rotary frequencies checkpoints do not hold."""
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(tiny_config(FAMILY["llama"]))
    blocks = partition(model_blocks(model), 2, "params")
    hidden = torch.zeros(2, 4, 16)
    with pytest.raises(UnsupportedModelError, match="rotary_emb.inv_freq is on the meta device.*build_on_meta"):
        blocks[1][0].module(hidden, side_inputs=None)
