"""The Hugging Face families pipedp is tested on, as data: one row per family (or variant), from which
tests/numerics/test_hf_families.py builds its tests and docs/models.md's table is generated.

Every model is built from a tiny config (hidden 16, 2-4 layers, vocabulary 40) with random weights:
nothing is downloaded. ``python tests/hf_families.py`` prints the table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

VOCAB = 40


@dataclass(frozen=True)
class Family:
    model_type: str
    variant: str = ""  # what the row's config exercises, when a family has several rows
    config: Dict[str, object] = field(default_factory=dict)  # overrides of the tiny config
    attention: Tuple[str, ...] = ("sdpa", "eager")  # the implementations the family supports
    classification: bool = True  # has a *ForSequenceClassification
    status: str = "exact"  # "exact", or "refused: <why>"
    refusal: str = ""  # the refusal's message must match this (refused rows)
    # eager attention gives NaN where a query sees no key (a left-padded position): the model's own
    # output and gradients are NaN there, so an eager-only family is trained on right padding only
    eager_only: bool = False
    float32_inside: bool = False  # the family computes its norms (or its router's logits) in float32 in a float64 model
    experts: bool = False  # a mixture of experts (built with the eager experts: grouped_mm takes no float64)
    # a step takes over 5 s here (a linear attention's chunked scan replayed per sample): the default tier runs two
    # of its causal runs (the rest, its classifier and its LoRA on the experts in the exhaustive tier)
    slow: bool = False
    # its routers (this class) sample the experts in training: the tests key each token's draws to its own values
    # (tests/keyed_draws.py), so the loop oracle, running each sample alone, draws what the micro-batch drew
    sampled: str = ""
    ties: bool = True  # the family's config ties the head to the embedding when asked (DBRX's refuses to, and the
    # tiny Nemotron-H and Kimi-Linear leave it untied)
    # its hash routers' tables (token id -> experts: zeros until a checkpoint fills them) drawn, each token's experts
    # distinct
    hashed: bool = False
    # parameters frozen at build (refused while trainable: ZAYA's base model reads its own embedding scales outside
    # any module, where no stage holds them)
    frozen: Tuple[str, ...] = ()

    @property
    def tolerance(self) -> float:
        """Largest relative difference from the loop oracle: float64 rounding, or the family's own float32 (a row's
        float32 rounding differs between the micro-batch and the row alone: up to 2.5e-6 measured, Laguna's at one
        of 8 draws)."""
        return 1e-5 if self.float32_inside else 1e-12

    @property
    def name(self) -> str:
        return f"{self.model_type} ({self.variant})" if self.variant else self.model_type

    @property
    def exact(self) -> bool:
        return self.status == "exact"


HEAD_DIM_8 = {"head_dim": 8}
GRANITE_HYBRID = {"mamba_n_heads": 4, "mamba_d_head": 8, "mamba_n_groups": 1, "mamba_d_state": 8}  # (heads | 2 x 16)
SLIDING = {"sliding_window": 4}  # shorter than the test sequences (8): the window matters
# DeepSeek's low-rank (multi-head latent) attention, and with it a first dense layer and one routing group
LOW_RANK = {"kv_lora_rank": 8, "q_lora_rank": 8, "qk_nope_head_dim": 4, "qk_rope_head_dim": 4, "v_head_dim": 8}
LOW_RANK = {**LOW_RANK, "num_key_value_heads": 2}
GROUPED = {**LOW_RANK, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1}
# (a linear-attention cache in a training forward: transformers' own forward fails on it; pipedp's drive makes none)
NO_CACHE = {"use_cache": False}
ALTERNATING = {"layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}  # both masks
# gated delta-rule layers, narrow (their defaults, 16-32 heads of 128, made a "tiny" model 8 s a step), with a full
# attention layer between two of them (the default pattern's first comes fourth)
DELTA_RULE = {
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "head_dim": 8,
    **NO_CACHE,
}
DELTA_AND_ATTENTION = {**DELTA_RULE, "layer_types": ["linear_attention", "full_attention", "linear_attention"]}

FAMILIES = [
    # the families pipedp split before (by name)
    Family("gpt2"),
    Family("llama"),
    Family("mistral", "sliding window 4", SLIDING),
    Family(
        "qwen2", "sliding window 4 on the last layer", {"use_sliding_window": True, **SLIDING, "max_window_layers": 2}
    ),
    Family("qwen3", config=HEAD_DIM_8),
    Family("phi3"),
    Family("gemma", config=HEAD_DIM_8, float32_inside=True),
    Family("gpt_neox"),
    # the families issue #24 names
    Family("starcoder2"),
    Family("stablelm"),
    Family("phi", "partial rotary"),
    Family("falcon", "new decoder architecture", {"new_decoder_architecture": True, "num_kv_heads": 1}),
    Family("falcon", "parallel attention, alibi", {"parallel_attn": True, "alibi": True}),
    Family("gpt_bigcode", "multi-query", {"multi_query": True}),
    Family("opt"),
    Family(
        "gemma2",
        "sliding window 6, soft-capping",
        {**HEAD_DIM_8, "sliding_window": 6, "final_logit_softcapping": 3.0, "attn_logit_softcapping": 5.0},
        attention=("eager",),
        eager_only=True,
        float32_inside=True,
    ),
    Family(
        "gemma3_text",
        "sliding window 4 and full layers, local rotary, soft-capping",
        {**HEAD_DIM_8, **SLIDING, **ALTERNATING, "final_logit_softcapping": 3.0},
        float32_inside=True,
    ),
    Family("olmo"),
    Family("gptj", config={"rotary_dim": 4}),
    Family("bloom", "alibi", attention=("eager",), eager_only=True),
    # mixtures of experts (privacy/rules/experts.py): top-2 of 4 experts, with shared experts where the family has them
    Family("mixtral", experts=True),
    Family("qwen2_moe", "a shared expert and its gate", experts=True),
    # other decoder families of transformers
    Family("qwen3_moe", config=HEAD_DIM_8, classification=False, experts=True),
    Family("olmoe", classification=False, experts=True),
    Family("granitemoe", classification=False, experts=True, float32_inside=True),
    Family("granitemoeshared", "a shared MLP", classification=False, experts=True, float32_inside=True),
    Family(
        "granitemoehybrid",
        "attention layers",
        {**GRANITE_HYBRID, "layer_types": ["attention"] * 3},
        classification=False,
        experts=True,
        float32_inside=True,
    ),
    Family(
        "granitemoehybrid",
        "mamba layers",
        {**GRANITE_HYBRID, "layer_types": ["mamba", "attention", "mamba"]},
        classification=False,
        experts=True,
        float32_inside=True,
    ),
    Family("minimax", config=HEAD_DIM_8, experts=True),
    Family("flex_olmo", classification=False, experts=True),
    Family("aria_text", "shared experts; transposed bank", classification=False, experts=True),
    Family("deepseek_v2", "shared experts; low-rank attention", LOW_RANK, experts=True, float32_inside=True),
    Family("glm4_moe", "a dense first layer", HEAD_DIM_8, classification=False, experts=True, float32_inside=True),
    Family("ernie4_5_moe", "a dense first layer", HEAD_DIM_8, classification=False, experts=True, float32_inside=True),
    Family("solar_open", config=HEAD_DIM_8, classification=False, experts=True, float32_inside=True),
    Family("exaone_moe", "a dense first layer", HEAD_DIM_8, classification=False, experts=True, float32_inside=True),
    Family("deepseek_v3", "a dense first layer; grouped routing", GROUPED, experts=True, float32_inside=True),
    Family("glm4_moe_lite", config=GROUPED, classification=False, experts=True, float32_inside=True),
    Family("sarvam_mla", config=GROUPED, classification=False, experts=True, float32_inside=True),
    Family("axk1", config=GROUPED, experts=True, float32_inside=True),
    Family("axk2", config=GROUPED, experts=True, float32_inside=True),
    Family("cohere2_moe", classification=False, experts=True, float32_inside=True),
    Family("kolibri1", classification=False, experts=True, float32_inside=True),
    Family("laguna", classification=False, experts=True, float32_inside=True),
    Family("mellum", classification=False, experts=True),
    Family("minimax_m3_vl_text", classification=False, experts=True, float32_inside=True),
    Family("sarvam_moe", classification=False, experts=True, float32_inside=True),
    Family("minimax_m2", "its router passed a score-correction bias", classification=False, experts=True),
    Family(
        "hy_v3", "its router passed a score-correction bias", classification=False, experts=True, float32_inside=True
    ),
    Family("afmoe", "its router's logits from a Linear inside it", classification=False, experts=True),
    Family("hunyuan_v1_moe", "its router's logits from a Linear inside it", HEAD_DIM_8, experts=True),
    Family(
        "dots1",
        "a dense first layer; grouped routing",
        {
            **HEAD_DIM_8,
            "n_routed_experts": 4,
            "n_shared_experts": 1,
            "first_k_dense_replace": 1,
            "n_group": 1,
            "topk_group": 1,
        },
        classification=False,
        experts=True,
        float32_inside=True,
    ),
    Family(
        "lfm2_moe",
        "attention layers",
        {"layer_types": ["full_attention"] * 3, "num_dense_layers": 1},
        classification=False,
        experts=True,
    ),
    Family(
        "lfm2_moe",
        "convolution layers (their weight read by the block: one layer with it)",
        {"layer_types": ["conv", "full_attention", "conv"], "num_dense_layers": 1},
        classification=False,
        experts=True,
    ),
    # an attention owning parameters (sinks, a gate bias), called with keyword arguments: replayed per sample
    Family(
        "beam",
        "an attention owning its gate bias; a dense first layer",
        {"mlp_layer_types": ["dense", "sparse", "sparse"], "n_group": 1, "topk_group": 1},
        classification=False,
        experts=True,
        float32_inside=True,
    ),
    Family("flint", "trainable sinks", attention=("eager",), classification=False, experts=True, float32_inside=True),
    Family(
        "granite_swa",
        "trainable sinks",
        attention=("eager",),
        classification=False,
        eager_only=True,
        float32_inside=True,
    ),
    Family(
        "granitemoe_swa",
        "trainable sinks",
        attention=("eager",),
        classification=False,
        eager_only=True,
        experts=True,
        float32_inside=True,
    ),
    Family(
        "mimo_v2_flash",
        "trainable sinks",
        attention=("eager",),
        classification=False,
        experts=True,
        float32_inside=True,
    ),
    # state-space and linear-attention layers: a module reading its convolution's weight is one layer with it,
    # a gated norm over each head's tokens ([batch T heads, d]) called on [batch, T heads, d]; all scan in float32
    Family("mamba", "Mamba layers", attention=("eager",), classification=False, float32_inside=True),
    Family(
        "mamba2",
        "Mamba-2 layers",
        {"head_dim": 8, "num_heads": 4, "n_groups": 1, "state_size": 8, "chunk_size": 4},  # 2 chunks of the 8 tokens
        attention=("eager",),
        classification=False,
        float32_inside=True,
    ),
    Family("falcon_mamba", "Mamba layers", attention=("eager",), classification=False, float32_inside=True),
    Family("jamba", "Mamba, attention and experts", NO_CACHE, experts=True, float32_inside=True),
    Family("lfm3", "convolution and attention layers", classification=False, float32_inside=True),
    Family("qwen3_next", "gated delta-rule layers and experts", DELTA_AND_ATTENTION, experts=True, float32_inside=True),
    Family("qwen3_5_text", "gated delta-rule layers", DELTA_AND_ATTENTION, float32_inside=True),
    Family(
        "qwen3_5_moe_text",
        "gated delta-rule layers and experts",
        DELTA_AND_ATTENTION,
        classification=False,
        experts=True,
        float32_inside=True,
    ),
    Family(
        "nemotron_h",
        "Mamba-2, attention, experts and MLP layers",
        {"mamba_num_heads": 4, "mamba_head_dim": 8, "ssm_state_size": 8, "n_groups": 1, "head_dim": 8},
        classification=False,
        experts=True,
        float32_inside=True,
        ties=False,
    ),
    Family(
        "kimi_linear",
        "delta-rule attention and experts",
        {
            **NO_CACHE,
            # narrow (its defaults, 32 heads of 128 and a rank of 512, made a step take over 30 s)
            "linear_head_dim": 8,
            "linear_num_heads": 2,
            "kv_lora_rank": 8,
            "qk_nope_head_dim": 4,
            "qk_rope_head_dim": 4,
            "v_head_dim": 8,
            "head_dim": 8,
            "num_key_value_heads": 2,
            "layer_types": ["linear_attention", "full_attention", "linear_attention"],
        },
        classification=False,
        experts=True,
        float32_inside=True,
        ties=False,
    ),
    Family("olmo_hybrid", "gated delta-rule layers", NO_CACHE, classification=False, float32_inside=True),
    Family(
        "lara_mini",
        "linear-attention layers and experts",
        DELTA_RULE,
        classification=False,
        experts=True,
        float32_inside=True,
    ),
    Family("llama4_text", "every token through every expert", classification=False, experts=True, float32_inside=True),
    # experts as row slices of [E h, d] matrices (rules/sliced_experts.py; h 24, d 16: w2's [in, out] layout shows);
    # its router returns the logits alone
    Family(
        "dbrx",
        "experts as row slices of [E h, d] matrices",
        {
            "d_model": 16,
            "n_heads": 2,
            "n_layers": 3,
            "max_seq_len": 32,
            "ffn_config": {"ffn_hidden_size": 24, "moe_num_experts": 4, "moe_top_k": 2, "moe_jitter_eps": None},
            "attn_config": {"kv_n_heads": 1, "rope_theta": 10000.0, "clip_qkv": 8.0},
        },
        classification=False,
        experts=True,
        ties=False,
    ),
    # hash routing (experts from the token ids) in its first layers, hyper-connections (four residual streams, each
    # mixing module returning three outputs that carry gradient), compressed and sparse attention (compression every
    # 2 and 4 tokens, the indexer keeping 2 of 4 compressed entries)
    Family(
        "deepseek_v4",
        "hash routing, hyper-connections, compressed sparse attention",
        {
            "layer_types": ["compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"],
            "compress_rates": {"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
            "index_topk": 2,
            **SLIDING,
            # narrow (the defaults: heads of 512, ranks of 1024)
            "head_dim": 16,
            "q_lora_rank": 8,
            "o_lora_rank": 8,
            "o_groups": 2,
            "index_n_heads": 2,
            "index_head_dim": 8,
            "qk_rope_head_dim": 8,
        },
        attention=("eager",),
        classification=False,
        experts=True,
        float32_inside=True,
        hashed=True,
    ),
    # experts called on the tokens sorted by expert, and an attention that is itself a mixture of experts (its query
    # and output projections): each block replayed one sample at a time (rules/generic.py LOOPED)
    Family(
        "jetmoe",
        "mixtures of experts with no closed-form rule, replayed per sample",
        {"kv_channels": 8},
        experts=True,
        float32_inside=True,
    ),
    # a second stream between layers (the router states the next layer's router reads; crossing stages with the
    # hidden state) and a router that is an MLP: its blocks replayed per sample; one expert per token (its config's)
    Family(
        "zaya",
        "router states passed from layer to layer; an MLP router",
        {"num_experts_per_tok": 1, "router_hidden_size": 8},
        classification=False,
        experts=True,
        frozen=("model.input_hidden_states_scale", "model.input_hidden_states_bias"),
    ),
    # sampled routing (sparsemixer): its threshold widened from 0.01 so that a token's draw leaves the top-2 often
    Family(
        "phimoe",
        "experts sampled in training",
        {"router_jitter_noise": 1.0},
        experts=True,
        sampled="PhimoeTopKRouter",
    ),
    Family(
        "gpt_oss",
        attention=("eager",),
        classification=False,
        experts=True,
    ),
    Family("cohere", "logit scale", {"logit_scale": 0.5}, classification=False, float32_inside=True),
    Family(
        "cohere2",
        "sliding window 4 and full layers",
        {**SLIDING, **ALTERNATING},
        classification=False,
        float32_inside=True,
    ),
    Family(
        "granite",
        "multipliers",
        {"embedding_multiplier": 2.0, "logits_scaling": 4.0, "residual_multiplier": 0.5, "attention_multiplier": 0.3},
        classification=False,
    ),
    Family("olmo2"),
    Family("olmo3", "sliding window 4 and full layers", {**SLIDING, **ALTERNATING}),
    Family("glm"),
    Family("glm4"),
    Family("helium", config=HEAD_DIM_8, float32_inside=True),
    Family("smollm3", "no rotary on the last layer", {"no_rope_layer_interval": 3}),
    Family("exaone4", "sliding window 4", {**SLIDING, "sliding_window_pattern": 2}),
    Family("nemotron"),
    Family("persimmon"),
    Family("seed_oss"),
    Family("arcee"),
    Family("apertus", classification=False),
    Family("ernie4_5", classification=False),
    Family("hunyuan_v1_dense", config=HEAD_DIM_8),
    Family("ministral", config=HEAD_DIM_8),
    Family("ministral3"),
    Family("bitnet", classification=False),
    Family("codegen", config={"rotary_dim": 4}, classification=False),
    Family("mpt", "alibi", attention=("eager",), eager_only=True),
    Family(
        "vaultgemma",
        config=HEAD_DIM_8,
        attention=("eager",),
        classification=False,
        eager_only=True,
        float32_inside=True,
    ),
    Family(
        "lfm2",
        "convolution layers",
        {"layer_types": ["conv", "full_attention", "conv"]},
        classification=False,
    ),
    Family(
        "biogpt",
        status="refused: its position embedding reads positions the model passes by keyword",
        refusal="embed_positions",
    ),
    Family("doge", float32_inside=True),
    Family("openai-gpt", attention=("eager",), status="refused: no final norm", refusal="no final norm"),
    Family("nanochat", "one norm before and after the layers", classification=False),
]


def family(model_type: str, variant: str = "") -> Family:
    """The row of ``model_type`` (its first, or the one of ``variant``)."""
    return next(f for f in FAMILIES if f.model_type == model_type and (not variant or f.variant == variant))


def hf_loss(out, labels):
    """Per-sample token loss of a causal LM's output (its logits), for the loop oracle."""
    from pipedp.models import token_loss

    return token_loss(out.logits, labels)


def tiny_config(family: Family, tie: Optional[bool] = None, labels: int = 0):
    """The family's config: hidden 16, 3 layers (2-4 as the family's names say), 2 heads, vocabulary 40."""
    import transformers

    wanted = dict(
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
        n_inner=32,
        ffn_dim=32,
        word_embed_proj_dim=16,
        num_experts=4,
        num_local_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
    )
    wanted.update(family.config)
    if tie is not None:
        wanted["tie_word_embeddings"] = tie and family.ties
    if labels:
        wanted["num_labels"] = labels
    default = transformers.AutoConfig.for_model(family.model_type)
    # no dropout: the oracle's passes and pipedp's would draw different masks
    wanted.update({k: 0.0 for k, v in default.to_dict().items() if _is_dropout(k) and isinstance(v, float)})
    known = {k: v for k, v in wanted.items() if hasattr(default, k) or k in type(default).attribute_map}
    return transformers.AutoConfig.for_model(family.model_type, **known)


def _is_dropout(key: str) -> bool:
    return "dropout" in key or "pdrop" in key


# ---- what the Hugging Face tests share -----------------------------------------------------------
SEQ = 8
LENGTHS = (8, 3, 5, 4, 6)  # 5 sequences padded to SEQ: one unpadded, one padded on 5 of its 8 positions


def build(family: Family, kind: str = "causal", tie: bool = False, attention: Optional[str] = None):
    """The family's tiny model in float64 (a classifier has 3 labels), its weights drawn from seed 0 whatever test
    ran before (a float32-inside family's rounding against the oracle depends on the draw)."""
    import torch
    import transformers
    from keyed_draws import keyed

    torch.manual_seed(0)

    auto = (
        transformers.AutoModelForSequenceClassification
        if kind == "classification"
        else transformers.AutoModelForCausalLM
    )
    config = tiny_config(family, tie if kind == "causal" else None, labels=3 if kind == "classification" else 0)
    options = {"experts_implementation": "eager"} if family.experts else {}
    model = auto.from_config(config, attn_implementation=attention or family.attention[0], **options).double()
    for module in model.modules():
        if family.sampled and type(module).__name__ == family.sampled:
            keyed(module)
    for name in family.frozen:
        model.get_parameter(name).requires_grad_(False)
    for name, table in model.named_buffers():
        if family.hashed and name.endswith("tid2eid"):
            experts = config.num_local_experts
            table.copy_(torch.stack([torch.randperm(experts)[: table.shape[1]] for _ in range(table.shape[0])]))
    return model


def padded_batch(side: str, seed: int = 5):
    """{"input_ids", "attention_mask"} of 5 sequences padded on ``side`` (pad id 0, real ids 1..39), and
    shifted labels: position t is scored on token t + 1 wherever that is a real token, so with left
    padding the last padding position (which predicts the first token) is scored too."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (len(LENGTHS), SEQ), generator=g)
    mask = torch.zeros(len(LENGTHS), SEQ, dtype=torch.long)
    for i, length in enumerate(LENGTHS):
        mask[i, slice(0, length) if side == "right" else slice(SEQ - length, SEQ)] = 1
    ids = ids.masked_fill(mask == 0, 0)
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
    return {"input_ids": ids, "attention_mask": mask}, labels


def dp_update(model, loss_fn, inputs, labels, **options):
    """What one DP-SGD step (noise 0, clip 0.3, SGD lr 1, expected batch 1) subtracts from each parameter:
    the clipped per-sample gradient sum, comparable with oracles.loop_clipped_sum."""
    import torch

    from pipedp import PipelineDPTrainer

    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    options = {"microbatches": 2, "noise_multiplier": 0.0, "max_grad_norm": CLIP, "expected_batch_size": 1, **options}
    PipelineDPTrainer(model, loss_fn, lambda p: torch.optim.SGD(p, lr=1.0), **options).step(inputs, labels)
    return {k: before[k] - p.detach() for k, p in model.named_parameters()}


CLIP = 0.3


def sequence_loss(logits, labels):
    """Per-sample cross-entropy of a classifier's logits [n, labels]."""
    import torch.nn.functional as F

    return F.cross_entropy(logits, labels, reduction="none")


TABLE_START = (
    "<!-- families table: generated by `python tests/hf_families.py` from tests/hf_families.py; do not edit -->"
)
TABLE_END = "<!-- end of families table -->"


def render_table() -> str:
    """The markdown table of docs/models.md's families section, between its two markers."""
    rows = [
        "| family | causal LM | sequence classification | tied head | status |",
        "| --- | --- | --- | --- | --- |",
    ]
    for f in FAMILIES:
        tested = "tested" if f.exact else "—"
        classification = ("tested" if f.classification else "not in transformers") if f.exact else "—"
        tied = ("tied and untied" if f.ties else "untied (its config refuses to tie)") if f.exact else "—"
        rows.append(f"| {f.name} | {tested} | {classification} | {tied} | {f.status} |")
    return "\n".join([TABLE_START, *rows, TABLE_END])


if __name__ == "__main__":
    print(render_table())
