"""Which layers tensor parallelism splits, and what it refuses at construction, by name (no processes: the split
itself runs in tests/multiprocess/test_tensor_parallel.py)."""

import dataclasses

import pytest
import torch

transformers = pytest.importorskip("transformers")
from loop_models import GatedNet  # noqa: E402
from steps import tiny_llama_config  # noqa: E402

from pipedp import PipelineDPTrainer  # noqa: E402
from pipedp.errors import ConfigError, UnsupportedModelError  # noqa: E402
from pipedp.models import GPTConfig, tiny_gpt, token_loss  # noqa: E402
from pipedp.parallel.plan import COLUMN, HEAD, ROW, VOCAB, WHOLE, tensor_parallel_plan  # noqa: E402
from pipedp.split.adapters import model_blocks  # noqa: E402


def llama(**overrides):
    torch.manual_seed(0)
    fields = dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    fields.update(overrides)
    return transformers.LlamaForCausalLM(tiny_llama_config(**fields)).eval()


def phi(**overrides):
    torch.manual_seed(0)
    fields = dict(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4)
    fields.update(overrides)
    return transformers.PhiForCausalLM(transformers.PhiConfig(**fields)).eval()


def scaled_tied_llama():
    """A head tied to an embedding that is not a plain nn.Embedding (as Gemma's scaled one)."""

    class Scaled(torch.nn.Embedding):
        pass

    model = llama(tie_word_embeddings=True)
    model.model.embed_tokens.__class__ = Scaled
    return model


class FunctionalDropout(torch.nn.Module):
    def forward(self, x):
        return torch.nn.functional.dropout(x, 0.1, self.training)


def plan_of(model, size=2):
    return tensor_parallel_plan(model, model_blocks(model), size)


def test_a_llama_is_split_by_transformers_own_plan_with_a_vocabulary_parallel_embedding_and_head():
    plan = plan_of(llama())
    layer = "model.layers.1."
    assert {k: v for k, v in plan.items() if k.startswith(layer)} == {
        layer + "self_attn.q_proj": COLUMN,
        layer + "self_attn.k_proj": COLUMN,
        layer + "self_attn.v_proj": COLUMN,
        layer + "self_attn.o_proj": ROW,
        layer + "mlp.gate_proj": COLUMN,
        layer + "mlp.up_proj": COLUMN,
        layer + "mlp.down_proj": ROW,
    }
    assert plan["model.embed_tokens"] == VOCAB and plan["lm_head"] == HEAD
    assert not any("norm" in k for k in plan)  # held whole by every rank, counted once
    assert plan_of(llama(), size=1) == {}
    assert plan_of(phi())["model.layers.0.self_attn.dense"] == ROW  # Phi without its per-head norms: accepted
    tied = plan_of(llama(tie_word_embeddings=True))  # one weight, cut along the vocabulary for both
    assert tied["model.embed_tokens"] == VOCAB and tied["lm_head"] == HEAD


@pytest.mark.parametrize(
    "model, size, match",
    [
        (lambda: llama(num_key_value_heads=1), 2, "num_key_value_heads=1"),
        (lambda: llama(), 3, "num_attention_heads=4"),
        (lambda: llama(vocab_size=41), 2, "num_embeddings=41"),
        (lambda: scaled_tied_llama(), 2, "tied to a Scaled, which pipedp does not split"),
        (lambda: llama(attention_dropout=0.1).train(), 2, "attention_dropout"),
        (lambda: phi(qk_layernorm=True), 2, r"q_layernorm\.weight' is held whole by every rank but lives in"),
        (lambda: torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh()), 2, "nothing in Sequential can be split"),
        (lambda: GatedNet(hidden=15, vocab=13), 2, "nothing in GatedNet can be split"),  # widths 2 does not divide
        (lambda: torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.1)), 2, r"dropout \('1'\)"),
        (lambda: torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.AlphaDropout(0.1)), 2, r"dropout \('1'\)"),
        (lambda: torch.nn.Sequential(torch.nn.Linear(4, 4), FunctionalDropout()), 2, r"dropout \(dropout in block '1'"),
    ],
)
def test_what_cannot_be_split_exactly_is_refused_by_name(model, size, match):
    m = model()
    with pytest.raises(UnsupportedModelError, match=match):
        plan_of(m, size)


def test_a_model_without_transformers_plan_is_placed_by_the_pass_over_its_blocks_graphs():
    """Column- then row-parallel where only elementwise operations lie between two Linears; whole elsewhere: an
    attention's projections (a reshape into heads), a head whose output is the model's, an MLP whose hidden features
    are scaled by a value every rank holds whole."""
    gpt = tiny_gpt(GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=2, n_layers=2))
    assert plan_of(gpt) == {
        "0.tok": VOCAB,
        "0.pos": VOCAB,
        "1.fc": COLUMN,
        "1.out": ROW,
        "2.fc": COLUMN,
        "2.out": ROW,
    }
    split = {"up": COLUMN, "down": ROW, "w1": COLUMN, "w3": COLUMN, "w2": ROW}
    traced = plan_of(GatedNet())  # traced into blocks: its forward is a loop over a ModuleList
    assert traced == {"embed": VOCAB, **{f"blocks.{i}.{k}": v for i in (0, 1) for k, v in split.items()}}
    scaled = plan_of(GatedNet(scaled=True))  # hidden * gate(x): that MLP whole, the gated one still split
    assert scaled == {"embed": VOCAB, **{f"blocks.{i}.{k}": split[k] for i in (0, 1) for k in ("w1", "w3", "w2")}}


def test_one_linear_under_two_names_called_twice_stays_whole():
    """``a`` and ``b`` one module: fed a whole value as ``a``, a slice as ``b``; it cannot be both halves."""

    class Twice(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(4, 4)
            self.b = self.a
            self.c, self.d = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.d(torch.relu(self.c(self.b(torch.relu(self.a(x))))))

    assert plan_of(torch.nn.Sequential(Twice())) == {"0.c": COLUMN, "0.d": ROW}


def test_a_linear_another_block_calls_or_whose_weight_is_read_directly_stays_whole():
    """One ``up`` in two blocks (the second averages its output: with a slice it would average a rank's part); a
    weight read outside its module's call (``x @ w.t()``: that read would get the slice)."""
    up, down = torch.nn.Linear(4, 8), torch.nn.Linear(8, 4)

    class Pair(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = up, down

        def forward(self, x):
            return self.down(torch.relu(self.up(x)))

    class Mean(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up = up

        def forward(self, x):
            return x + self.up(x).mean(-1, keepdim=True)

    class Direct(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = torch.nn.Linear(4, 8), torch.nn.Linear(8, 4)
            self.up.weight.requires_grad_(False)

        def forward(self, x):
            return self.down(torch.relu(self.up(x))) + x @ self.up.weight.t() @ self.down.weight.t()

    with pytest.raises(UnsupportedModelError, match="nothing in Sequential can be split"):
        plan_of(torch.nn.Sequential(Pair(), Mean()))
    with pytest.raises(UnsupportedModelError, match="nothing in Sequential can be split"):
        plan_of(torch.nn.Sequential(Direct()))


def test_a_users_subclass_of_a_transformers_model_is_split_by_transformers_plan():
    """Its config's dropout is still seen (the fx pass, for other models, would not read the config)."""
    model = llama(attention_dropout=0.1).train()
    blocks = model_blocks(model)
    model.__class__ = type("Mine", (type(model),), {"__module__": "my_project"})
    with pytest.raises(UnsupportedModelError, match="attention_dropout"):
        tensor_parallel_plan(model, blocks, 2)


def test_gpt2_has_no_plan_and_is_refused():
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=40))
    with pytest.raises(UnsupportedModelError, match="base_model_tp_plan"):
        plan_of(model.eval())


def test_a_lora_on_a_split_projection_is_split_on_its_side_and_its_other_factor_held_whole():
    """Under a column-parallel base B gives this rank's output rows (A reads the whole input: whole); under a
    row-parallel base A reads this rank's input columns (B reads the summed product: whole)."""
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(llama(), peft.LoraConfig(r=2, target_modules=["q_proj", "o_proj", "down_proj"]))
    plan = tensor_parallel_plan(model, model_blocks(model), 2)
    q, o = "base_model.model.model.layers.0.self_attn.q_proj", "base_model.model.model.layers.0.self_attn.o_proj"
    assert {k: v for k, v in plan.items() if k.startswith((q, o))} == {
        q + ".base_layer": COLUMN,
        q + ".lora_B.default": COLUMN,
        q + ".lora_A.default": WHOLE,
        o + ".base_layer": ROW,
        o + ".lora_A.default": ROW,
        o + ".lora_B.default": WHOLE,
    }
    assert plan["base_model.model.model.layers.0.self_attn.k_proj"] == COLUMN  # no LoRA there: as before


@pytest.mark.parametrize(
    "config, match",
    [
        (dict(target_modules=["q_proj"], use_dora=True), r"self_attn\.q_proj' carries a LoRA variant"),
        (dict(target_modules=["q_proj"], lora_dropout=0.1), "dropout"),
    ],
)
def test_a_lora_pipedp_cannot_split_exactly_is_refused_by_name(config, match):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(llama(), peft.LoraConfig(r=2, **config))
    with pytest.raises(UnsupportedModelError, match=match):
        tensor_parallel_plan(model, model_blocks(model), 2)


def test_another_peft_adapter_on_a_split_projection_is_refused_by_name():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(llama(), peft.IA3Config(target_modules=["q_proj"], feedforward_modules=[]))
    with pytest.raises(
        UnsupportedModelError,
        match=r"self_attn\.q_proj' is a peft\.tuners\.ia3\.layer\.Linear, not a plain torch Linear",
    ):
        tensor_parallel_plan(model, model_blocks(model), 2)


def test_tensor_parallel_in_one_process_is_refused_with_the_launch_line():
    with pytest.raises(ConfigError, match="torchrun --nproc_per_node 4"):
        PipelineDPTrainer(
            llama(), token_loss, stages=2, tensor_parallel=2, expected_batch_size=4, transport="inprocess", seed=0
        )


def test_the_planner_counts_each_ranks_slices_and_the_whole_tensors_once():
    """pipedp plan --tensor-parallel 2: every stage as its rank 0 holds it, simulated with its slices."""
    from pipedp.config import PipelineConfig
    from pipedp.planner import estimate

    config = tiny_llama_config(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    whole, split = (
        estimate(config, 2, 2, 8, pipeline=PipelineConfig(tensor_parallel=t), optimizer="adamw") for t in (1, 2)
    )
    model = llama()
    norms = sum(p.numel() for n, p in model.named_parameters() if "norm" in n)  # held whole by every rank
    assert sum(s.static.params for s in whole.stages) == sum(p.numel() for p in model.parameters())
    assert (
        sum(s.static.params for s in split.stages) == (sum(p.numel() for p in model.parameters()) - norms) // 2 + norms
    )
    assert all(b.pass_peak < a.pass_peak for a, b in zip(whole.stages, split.stages))  # activations split too
    assert "2 tensor-parallel ranks (per rank)" in split.description


def test_a_layer_replayed_whole_holding_split_projections_is_refused_by_name():
    """Doge's decoder layer owns its residual scales: its rule replays it whole per sample, split attention and
    MLP included, whose replay would need the other ranks."""
    from hf_families import build, family

    model = build(dataclasses.replace(family("doge"), config={"num_key_value_heads": 2}))
    with pytest.raises(
        UnsupportedModelError, match=r"layer 'model.layers.0' owns \['input_residual', 'post_attention_residual'\]"
    ):
        tensor_parallel_plan(model, model_blocks(model), 2)
    for layer in model.model.layers:  # the way out the message names: then its attention, which owns A
        layer.input_residual.requires_grad_(False)
        layer.post_attention_residual.requires_grad_(False)
    with pytest.raises(UnsupportedModelError, match=r"layer 'model.layers.0.self_attn' owns \['A'\] itself"):
        tensor_parallel_plan(model, model_blocks(model), 2)
