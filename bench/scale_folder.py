"""A real model's configuration as a Hugging Face folder with random weights, for bench.scale: ``write_folder``
never holds the whole model. The model is built on the meta device for its names and shapes, the shards are
planned from those, and each shard's tensors are drawn (in row chunks, bf16, N(0, 0.02); norms 1), written and
freed before the next; then config.json, the index and a small word-level tokenizer (built from pipedp's
generated corpus). ``corpus_rows`` tokenises that corpus with the folder's tokenizer.
"""

from __future__ import annotations

import json
import math
import os
import time
import zlib
from typing import Dict, List, Optional

import torch

from .memory import PeakMemory

STD = 0.02
SHARD_BYTES = 1 << 30

# the published configurations (config.json of each model's Hugging Face repository)
CONFIGS = {
    "llama-2-7b": dict(
        family="llama",
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        bos_token_id=1,
        eos_token_id=2,
    ),
    "llama-3-8b": dict(
        family="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        bos_token_id=128000,
        eos_token_id=128001,
    ),
    "mistral-7b": dict(  # Mistral-7B-v0.1
        family="mistral",
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=32768,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        sliding_window=4096,
        bos_token_id=1,
        eos_token_id=2,
    ),
    "tiny-llama": dict(  # smoke tests
        family="llama",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        bos_token_id=1,
        eos_token_id=2,
    ),
}


def hf_config(name: str, layers: Optional[int] = None):
    from transformers import LlamaConfig, MistralConfig

    spec = dict(CONFIGS[name])
    family = spec.pop("family")
    if layers is not None:
        spec["num_hidden_layers"] = layers
    cls = LlamaConfig if family == "llama" else MistralConfig
    cfg = cls(tie_word_embeddings=False, **spec)
    cfg.dtype = "bfloat16"
    return cfg


# ---- writing a folder, a shard at a time ---------------------------------------------------------------
def _draw(name: str, shape, dtype=torch.bfloat16, chunk_elems: int = 1 << 24) -> torch.Tensor:
    """One tensor's random values, drawn in row chunks (no float32 copy of the whole tensor)."""
    leaf = name.rsplit(".", 1)[-1]
    out = torch.empty(shape, dtype=dtype)
    if "norm" in name and leaf == "weight":
        return out.fill_(1.0)
    if leaf == "bias":
        return out.zero_()
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    flat = out.view(-1)
    for start in range(0, flat.numel(), chunk_elems):
        stop = min(flat.numel(), start + chunk_elems)
        flat[start:stop] = torch.randn(stop - start, generator=g).mul_(STD)
    return out


def _tokenizer(folder: str) -> int:
    """A word-level tokenizer over the generated corpus's words (ids below every model's vocabulary)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from pipedp.data import generated_corpus

    words = sorted(set(generated_corpus().replace(".", " . ").split()))
    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", "<pad>"] + words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace()])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.save_pretrained(folder)
    return len(vocab)


def write_folder(name: str, folder: str, layers: Optional[int] = None, shard_bytes: int = SHARD_BYTES) -> Dict:
    """config.json, sharded safetensors (model-0000k-of-0000n), the index and a tokenizer, with random
    bf16 weights; the writer's peak memory is about one shard."""
    from safetensors.torch import save_file

    from pipedp.split.hf_loading import build_on_meta

    start = time.perf_counter()
    cfg = hf_config(name, layers)
    os.makedirs(folder, exist_ok=True)
    with PeakMemory() as mem:
        meta = build_on_meta(cfg)
        shapes = [(k, tuple(t.shape)) for k, t in meta.state_dict().items()]
        del meta
        shards: List[List[tuple]] = [[]]
        size = 0
        for key, shape in shapes:
            nbytes = 2 * math.prod(shape)
            if shards[-1] and size + nbytes > shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append((key, shape))
            size += nbytes
        weight_map, total = {}, 0
        for i, shard in enumerate(shards):
            file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            tensors = {key: _draw(key, shape) for key, shape in shard}
            save_file(tensors, os.path.join(folder, file), metadata={"format": "pt"})
            for key, t in tensors.items():
                weight_map[key] = file
                total += t.numel() * t.element_size()
            del tensors
        with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
        cfg.save_pretrained(folder)
        words = _tokenizer(folder)
    return {
        "config": name,
        "layers": cfg.num_hidden_layers,
        "folder": folder,
        "bytes": total,
        "shards": len(shards),
        "tokenizer_words": words,
        "writer_peak_mib": mem.peak_mib,
        "seconds": time.perf_counter() - start,
    }


def corpus_rows(folder: str, n: int, seq: int):
    from pipedp.data import generated_corpus
    from pipedp.split.hf_loading import tokenize_for_model

    ids = tokenize_for_model(folder, generated_corpus())
    need = n * (seq + 1)
    ids = (ids * (need // max(1, len(ids)) + 1))[:need]
    rows = torch.tensor(ids, dtype=torch.long).reshape(n, seq + 1)
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
