"""The scale benchmark: a real model's configuration, random weights in a sharded safetensors folder,
DP fine-tuning with each rank loading only its stage; peak memory per rank against what the stage
must hold, a checkpoint save included, and the step time.

    python -m bench.scale write llama-2-7b /tmp/l2 --layers 2     # a 2-layer slice (1.3 GB)
    python -m bench.scale run /tmp/l2 --mode lora --stages 2        # LoRA r=8 on q/v, bf16 base
    python -m bench.scale run /tmp/l2 --mode full --stages 2        # full fine-tuning, bf16
    python -m bench.scale suite                                     # PLAN: the slices of every config (~30 min)
    python -m bench.scale suite --configs llama-2-7b --modes lora --full-depth   # the whole 7B (13.5 GB folder)

``suite`` writes each folder, runs it, deletes it, skips a run its memory estimate says does not fit
(and lists it), and adds a section to bench/RESULTS.md (measuring a snapshot of HEAD: bench/snapshot.py).

``write`` never holds the whole model: the model is built on the meta device for its names and
shapes, the shards are planned from those, and each shard's tensors are drawn (in row chunks, bf16,
N(0, 0.02); norms 1), written and freed before the next; then config.json, the index and a small
word-level tokenizer (built from pipedp's generated corpus). ``run`` launches one process per stage
(``pipedp.launch``, 1 thread each); each calls ``load_pipeline_stage`` (only its own tensors are read),
adds LoRA (PEFT, r=8, alpha 16, q_proj and v_proj; precision "bf16-mixed": the base stays bf16, the
adapters and their AdamW state float32) or trains every weight (precision "bf16-true": weights and
AdamW state bf16), tokenises the corpus with the folder's tokenizer, takes ``--steps`` DP steps and
saves a checkpoint (``trainer.save_checkpoint``).

Memory, per rank, from the kernel's peak RSS mark (VmHWM), reset at each phase (load, trainer build,
first step, later steps, save), so the whole run's peak is the largest phase peak. It is compared with
what the stage must hold, above the process's RSS before loading (Python, torch, transformers):
- its weights (every parameter with memory, as loaded),
- its optimizer state (bytes of the AdamW state tensors after the steps),
- one float32 clipped-sum buffer (4 bytes per trainable parameter),
- the in-flight activations: the bytes autograd saves for one micro-batch's plain forward of the stage
  (saved-tensor hooks, parameters excluded; the last stage with its loss), times the micro-batches 1F1B
  keeps in flight on the stage (min(m, stages - stage)).
The save's own cost is the peak increment during ``save_checkpoint`` (the mark reset before it).

Beside it (unless ``--no-baseline``): non-private training of the same stages, split and batch under
torch's ``Schedule1F1B`` (GPipe where m < stages), in the same processes before the DP run; its peak above
the base and its step time. And the balance: the partition report's predicted imbalance (slowest / mean
stage cost, ``--balance``, default the trainer's ``compute``) beside the measured one (each stage's
main-thread CPU time per later step). ``--activation-checkpointing`` turns the trainer's option on.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import time
import zlib
from typing import Dict, List, Optional, Sequence

import torch

from .memory import PeakMemory, status_kib

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


# ---- one rank of a run -----------------------------------------------------------------------------------
class _Marks:
    """Peak RSS per phase: the kernel's mark read, then reset, at each phase's end."""

    def __init__(self):
        self.base = self._reset()
        self.phases: Dict[str, float] = {}

    @staticmethod
    def _reset() -> float:
        import ctypes
        import gc

        gc.collect()
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except OSError:
            pass
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return status_kib("VmRSS") / 1024.0

    def end(self, phase: str) -> float:
        """This phase's peak RSS (MiB, absolute), then the mark reset; returns the RSS after the reset."""
        self.phases[phase] = status_kib("VmHWM") / 1024.0
        return self._reset()


def corpus_rows(folder: str, n: int, seq: int):
    from pipedp.data import generated_corpus
    from pipedp.split.hf_loading import tokenize_for_model

    ids = tokenize_for_model(folder, generated_corpus())
    need = n * (seq + 1)
    ids = (ids * (need // max(1, len(ids)) + 1))[:need]
    rows = torch.tensor(ids, dtype=torch.long).reshape(n, seq + 1)
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def _activation_bytes(stage_blocks, x, y, last: bool, autocast: bool, loss_fn) -> int:
    """Bytes autograd saves for one micro-batch's plain forward through these blocks (parameters and
    their views excluded)."""
    params = set()
    for b in stage_blocks:
        for p in b.module.parameters():
            if not p.is_meta:
                params.add(p.untyped_storage().data_ptr())
    seen: Dict[int, int] = {}

    def pack(t):
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            ptr = t.untyped_storage().data_ptr()
            if ptr not in params:
                seen[ptr] = max(seen.get(ptr, 0), t.untyped_storage().nbytes())
        return t

    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else torch.autocast("cpu", enabled=False)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), ctx:
        h = x
        for b in stage_blocks:
            h = b.module(h)
        if last:
            h = loss_fn(h.float(), y).sum()
    del h
    return sum(seen.values())


class _Autocast(torch.nn.Module):
    """A stage's blocks under bf16 autocast (bf16-mixed) for torch's pipelining, which has no precision option."""

    def __init__(self, blocks, autocast: bool):
        super().__init__()
        self.blocks = torch.nn.Sequential(*blocks)
        self.autocast = autocast

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
            out = self.blocks(x)
        return out.float() if self.autocast and out.is_floating_point() else out


def _plain_steps(stage_blocks, rank: int, stages: int, x, y, m: int, autocast: bool, steps: int, marks) -> List[float]:
    """Non-private training of the same stage, split and batch under torch's Schedule1F1B (per-token mean
    cross-entropy, fused AdamW): its step times; its memory is the phase ``marks`` records. Its optimizer
    state and gradients are freed before returning (the DP run starts from the same state)."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    module = _Autocast([b.module for b in stage_blocks], autocast)
    stage = PipelineStage(module, rank, stages, torch.device("cpu"))

    def mean_loss(out, target):
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))

    # torch's 1F1B refuses m < stages; there 1F1B runs every forward before the first backward anyway, as GPipe
    kind = Schedule1F1B if m >= stages else ScheduleGPipe
    schedule = kind(stage, n_microbatches=m, loss_fn=mean_loss)
    trainable = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-4, fused=True) if trainable else None
    times = []
    for _ in range(steps):
        dist.barrier()
        t = time.perf_counter()
        if rank == 0:
            schedule.step(x)
        elif rank == stages - 1:
            schedule.step(target=y)
        else:
            schedule.step()
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)
        dist.barrier()
        times.append(time.perf_counter() - t)
    marks.end("plain 1F1B steps")
    for p in trainable:
        p.grad = None
    del opt, schedule, stage, module
    return times


def preimport() -> None:
    """Every library the run uses, imported before the base RSS is taken (their code is not the stage's)."""
    import peft  # noqa: F401
    import safetensors.torch  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401
    import transformers.models.mistral.modeling_mistral  # noqa: F401

    import pipedp.train.checkpoint  # noqa: F401
    import pipedp.train.trainer  # noqa: F401


def _run_rank(rank: int, folder: str, args: Dict) -> Dict:
    import warnings

    import torch.distributed as dist

    from pipedp import PipelineDPTrainer, settle_process
    from pipedp.models import token_loss
    from pipedp.split.adapters import model_blocks
    from pipedp.split.hf_loading import load_pipeline_stage, resident_parameter_bytes
    from pipedp.split.partition import block_costs, partition
    from pipedp.train.prepare import apply_precision

    warnings.filterwarnings("ignore")
    preimport()
    stages, m, lora = args["stages"], args["microbatches"], args["mode"] == "lora"
    marks = _Marks()
    t0 = time.perf_counter()
    model = load_pipeline_stage(folder, stages, rank, balance=args["balance"])
    load_s = time.perf_counter() - t0
    marks.end("load")
    weights = resident_parameter_bytes(model)
    hidden = model.config.hidden_size
    blocks = model_blocks(model)
    costs = block_costs(blocks, args["balance"])
    mine = partition(blocks, stages, costs)[rank]
    if lora:
        from peft import LoraConfig, get_peft_model

        for p in model.parameters():
            p.requires_grad_(False)
        torch.manual_seed(0)
        model = get_peft_model(
            model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
        )
        weights = resident_parameter_bytes(model)  # with the adapters
        mine = partition(model_blocks(model), stages, costs)[rank]
    marks.end("blocks + adapters")  # pipedp's model_blocks (a stand-in layer for HF models) and PEFT
    x, y = corpus_rows(folder, args["batch"], args["seq"])
    size = args["batch"] // m
    sample = x[:size] if rank == 0 else torch.randn(size, args["seq"], hidden, dtype=torch.bfloat16, requires_grad=True)
    act = _activation_bytes(mine, sample, y[:size], rank == stages - 1, lora, token_loss)
    in_flight = min(m, stages - rank)
    marks.end("activation probe")
    plain_s: List[float] = []
    if args["baseline"]:
        if lora:  # bf16-mixed as the trainer applies it: float32 trainable parameters
            apply_precision(model, "bf16-mixed")
        plain_s = _plain_steps(mine, rank, stages, x, y, m, lora, args["steps"], marks)
    t0 = time.perf_counter()
    trainer = PipelineDPTrainer(
        model,
        token_loss,
        lambda params: torch.optim.AdamW(params, lr=1e-4, fused=True),  # no temporaries (train/narrowing.py)
        stages=stages,
        microbatches=m,
        schedule=args["schedule"],
        grad_mode=args["grad_mode"],
        precision="bf16-mixed" if lora else "bf16-true",
        self_check=args["self_check"],
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        expected_batch_size=args["batch"],
        sample_rate=0.01,
        sampling="poisson",
        balance=costs,
        activation_checkpointing=args["activation_checkpointing"],
    )
    settle_process()
    build_s = time.perf_counter() - t0
    marks.end("trainer build")
    params = [p for stage in trainer.runtime.local_stages for p in stage.parameters]
    trainable_numel = sum(p.numel() for p in params)
    trainable_bytes = sum(p.numel() * p.element_size() for p in params)
    times, busy = [], []
    for i in range(args["steps"]):
        dist.barrier()
        t, c = time.perf_counter(), time.thread_time()
        trainer.step(x, y)
        busy.append(time.thread_time() - c)  # this thread's CPU time: the stage's work, not its waits
        dist.barrier()
        times.append(time.perf_counter() - t)
        if i == 0:
            marks.end("first step")
    marks.end("later steps")
    opt_bytes = 0
    for opt in trainer.state.optimizers:
        if opt is not None:
            for state in opt.state.values():
                opt_bytes += sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))
    before_save = status_kib("VmRSS") / 1024.0
    t = time.perf_counter()
    trainer.save_checkpoint(args["checkpoint"])
    save_s = time.perf_counter() - t
    marks.end("save")
    dist.barrier()
    written = 0
    if rank == 0:
        for root, _, files in os.walk(args["checkpoint"]):
            written += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    must = {
        "weights": weights,
        "optimizer state": opt_bytes,
        "float32 clipped sum": 4 * trainable_numel,
        "activations in flight": act * in_flight,
    }
    trainer.close()
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    mib = 1 / 2**20
    peak = max(v for k, v in marks.phases.items() if k not in NOT_DP)  # the probe and the baseline: not pipedp's
    return {
        "rank": rank,
        "base_rss_mib": marks.base,
        "phase_peak_mib": marks.phases,
        "peak_mib": peak,
        "peak_above_base_mib": peak - marks.base,
        "must_hold_mib": {k: v * mib for k, v in must.items()},
        "must_hold_total_mib": sum(must.values()) * mib,
        "activation_mib_per_microbatch": act * mib,
        "in_flight": in_flight,
        "trainable_mib": trainable_bytes * mib,
        "trainable_params": trainable_numel,
        "save_increase_mib": marks.phases["save"] - before_save,
        "checkpoint_mib": written * mib,
        "step_s": times,
        "busy_s": busy,
        "plain_step_s": plain_s,
        "predicted_costs": list(trainer.partition_report.stage_costs),
        "load_s": load_s,
        "build_s": build_s,
        "save_s": save_s,
        "user_s": usage.ru_utime,
        "sys_s": usage.ru_stime,
        "minor_faults": usage.ru_minflt,
    }


def run(
    folder: str,
    mode: str,
    stages: int = 2,
    steps: int = 3,
    batch: int = 4,
    microbatches: int = 2,
    seq: int = 32,
    schedule: str = "1f1b",
    grad_mode: str = "ghost",
    self_check: bool = True,
    checkpoint: Optional[str] = None,
    activation_checkpointing: bool = False,
    balance: str = "compute",
    baseline: bool = True,
) -> Dict:
    from pipedp.runtime.launch import launch

    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    ckpt = checkpoint or os.path.join(os.path.dirname(os.path.abspath(folder)), f"ckpt-{os.getpid()}")
    args = dict(
        mode=mode,
        stages=stages,
        steps=steps,
        batch=batch,
        microbatches=microbatches,
        seq=seq,
        schedule=schedule,
        grad_mode=grad_mode,
        self_check=self_check,
        checkpoint=ckpt,
        activation_checkpointing=activation_checkpointing,
        balance=balance,
        baseline=baseline,
    )
    start = time.perf_counter()
    try:
        ranks = launch(_run_rank, stages, (folder, args), timeout_s=7200, threads=1, op_timeout_s=3600)
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)
    return {
        "folder": folder,
        "layers": cfg["num_hidden_layers"],
        "hidden": cfg["hidden_size"],
        "vocab": cfg["vocab_size"],
        "args": args,
        "ranks": ranks,
        "seconds": time.perf_counter() - start,
    }


TRAINING_PHASES = ("first step", "later steps", "save")
NOT_DP = ("activation probe", "plain 1F1B steps")  # this bench's own phases


def summary_row(name: str, folder_bytes: int, r: Dict) -> Dict:
    a = r["args"]
    ranks = r["ranks"]

    def above(x, phases):
        return max(v for k, v in x["phase_peak_mib"].items() if k in phases) - x["base_rss_mib"]

    def whole(x):  # every phase but this bench's own
        return above(x, [k for k in x["phase_peak_mib"] if k not in NOT_DP])

    plain = [above(x, ("plain 1F1B steps",)) if "plain 1F1B steps" in x["phase_peak_mib"] else None for x in ranks]
    plain_s = ranks[0].get("plain_step_s") or []

    steady = ranks[0]["step_s"][1:] or ranks[0]["step_s"]
    busy = [statistics.median(x["busy_s"][1:] or x["busy_s"]) for x in ranks]  # later steps: no self-check
    costs = ranks[0]["predicted_costs"]
    return {
        "model": f"{name}, {r['layers']} layers",
        "folder_gib": folder_bytes / 2**30,
        "mode": a["mode"],
        "stages": a["stages"],
        "self_check": a["self_check"],
        "activation_checkpointing": a.get("activation_checkpointing", False),
        "batch": f"{a['batch']} x T={a['seq']}, m={a['microbatches']}",
        "must_hold_mib": [x["must_hold_total_mib"] for x in ranks],
        "peak_above_base_mib": [whole(x) for x in ranks],
        "base_mib": [x["base_rss_mib"] for x in ranks],
        "peak_ratio": [whole(x) / x["must_hold_total_mib"] for x in ranks],
        "training_ratio": [above(x, TRAINING_PHASES) / x["must_hold_total_mib"] for x in ranks],
        "steady_ratio": [above(x, ("later steps", "save")) / x["must_hold_total_mib"] for x in ranks],
        "steady_peak_mib": [above(x, ("later steps",)) for x in ranks],
        # non-private torch Schedule1F1B on the same stages and batch (bench's own phase, before the DP run)
        "plain_peak_mib": plain,
        "dp_over_plain_peak": [above(x, ("later steps",)) / p if p else None for x, p in zip(ranks, plain)],
        "plain_step_s": statistics.median(plain_s[1:] or plain_s) if plain_s else None,
        # slowest / mean stage: the partition report's (from its costs) and the stages' CPU time per step
        "predicted_imbalance": max(costs) / statistics.mean(costs) if sum(costs) > 0 else 1.0,
        "measured_imbalance": max(busy) / statistics.mean(busy) if sum(busy) > 0 else 1.0,
        "busy_s": busy,
        "save_ratio": [x["save_increase_mib"] / x["must_hold_mib"]["weights"] for x in ranks],
        "first_step_s": ranks[0]["step_s"][0],
        "step_s": statistics.median(steady),
        "load_s": max(x["load_s"] for x in ranks),
        "build_s": max(x["build_s"] for x in ranks),
        "save_s": max(x["save_s"] for x in ranks),
        "user_s": [x.get("user_s", 0.0) for x in ranks],
        "sys_s": [x.get("sys_s", 0.0) for x in ranks],
        "worst_phase": [
            max((k for k in x["phase_peak_mib"] if k not in NOT_DP), key=x["phase_peak_mib"].get) for x in ranks
        ],
    }


def _per_rank(values, fmt: str, goal: Optional[float] = None) -> str:
    text = " / ".join(fmt.format(v) for v in values)
    if goal is None:
        return text
    return text + (" (met)" if all(v <= goal for v in values) else " (**missed**)")


def _imbalance(r: Dict) -> str:
    if "measured_imbalance" not in r:
        return ""
    predicted, measured = r["predicted_imbalance"], r["measured_imbalance"]
    met = abs(predicted / measured - 1) <= 0.10
    return f"{predicted:.2f} / {measured:.2f}" + (" (met)" if met else " (**missed**)")


def markdown_rows(rows: List[Dict]) -> List[str]:
    out = [
        "| model | folder | mode | stages | self-check | activation checkpointing | batch | must hold, MiB per "
        "rank | whole run: peak above base, MiB | whole run / must hold (goal <= 1.15) | steps + save / must hold "
        "| later steps + save / must hold | later steps: peak above base, MiB | save adds (of stage weights, goal "
        "<= 5%) | non-private torch 1F1B: peak above base, MiB | DP later steps / non-private peak | first step s "
        "| step s | non-private step s | stage CPU s per step | imbalance predicted / measured (goal: within 10%) "
        "| load s | build s | save s | cpu user / sys s (rank 0) | phase of the peak |",
        "|---" * 26 + "|",
    ]
    for r in rows:
        out.append(
            f"| {r['model']} | {r['folder_gib']:.1f} GiB | {r['mode']} | {r['stages']} | "
            f"{'on' if r['self_check'] else 'off'} | {'on' if r.get('activation_checkpointing') else 'off'} | "
            f"{r['batch']} | "
            + " | ".join(
                [
                    _per_rank(r["must_hold_mib"], "{:.0f}"),
                    _per_rank(r["peak_above_base_mib"], "{:.0f}"),
                    _per_rank(r["peak_ratio"], "{:.2f}", 1.15),
                    _per_rank(r["training_ratio"], "{:.2f}"),
                    _per_rank(r["steady_ratio"], "{:.2f}"),
                    _per_rank(r.get("steady_peak_mib", []), "{:.0f}"),
                    _per_rank([100 * v for v in r["save_ratio"]], "{:.1f}%", 5.0),
                    _per_rank([v for v in r.get("plain_peak_mib") or [] if v is not None], "{:.0f}"),
                    _per_rank([v for v in r.get("dp_over_plain_peak") or [] if v is not None], "{:.2f}"),
                ]
            )
            + f" | {r['first_step_s']:.1f} | {r['step_s']:.1f} | "
            + (f"{r['plain_step_s']:.1f}" if r.get("plain_step_s") else "")
            + f" | {_per_rank(r.get('busy_s', []), '{:.2f}')} | "
            + _imbalance(r)
            + f" | {r['load_s']:.0f} | {r['build_s']:.0f} | "
            f"{r['save_s']:.1f} | {r['user_s'][0]:.0f} / {r['sys_s'][0]:.0f} | " + " / ".join(r["worst_phase"]) + " |"
        )
    return out


def breakdown(name: str, r: Dict) -> List[str]:
    """Per rank: what the stage must hold, and each phase's peak above the base."""
    lines = [f"`{name}`, {r['layers']} layers, {r['args']['mode']}, {r['args']['stages']} stages:", ""]
    lines.append(
        "| rank | base RSS | weights | optimizer | fp32 clipped sum | activations (per mb x in flight) | "
        + " | ".join(r["ranks"][0]["phase_peak_mib"])
        + " | checkpoint written |"
    )
    lines.append("|---" * (7 + len(r["ranks"][0]["phase_peak_mib"])) + "|")
    for x in r["ranks"]:
        h = x["must_hold_mib"]
        lines.append(
            f"| {x['rank']} | {x['base_rss_mib']:.0f} | {h['weights']:.0f} | {h['optimizer state']:.0f} | "
            f"{h['float32 clipped sum']:.0f} | {x['activation_mib_per_microbatch']:.0f} x {x['in_flight']} | "
            + " | ".join(f"{v - x['base_rss_mib']:.0f}" for v in x["phase_peak_mib"].values())
            + f" | {x['checkpoint_mib']:.0f} |"
        )
    return lines + [""]


def _free_gib() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    return 0.0


# (config, layers or None for every layer, mode, stages, self_check[, activation checkpointing]): the default suite. Full fine-tuning of
# the Llama-3-8B slice is left out: its 128k-token embedding and head alone are 1.05B parameters, ~11 GiB per
# rank on 2 stages with AdamW and the float32 clipped sum, more than this 24 GiB machine has for 2 ranks.
PLAN = [
    ("llama-2-7b", 2, "lora", 2, True),
    ("llama-2-7b", 2, "lora", 2, False),  # the later steps without and with activation checkpointing
    ("llama-2-7b", 2, "lora", 2, False, True),
    ("llama-2-7b", 2, "lora", 4, True),
    ("llama-2-7b", 2, "full", 2, False),
    ("llama-2-7b", 2, "full", 2, False, True),
    ("llama-2-7b", 2, "full", 4, False),
    ("llama-2-7b", 1, "full", 2, True),  # the self-check's first step at full fine-tuning (1 layer: it fits)
    ("llama-2-7b", 1, "full", 2, False),
    ("mistral-7b", 2, "lora", 2, True),
    ("mistral-7b", 2, "lora", 4, True),
    ("mistral-7b", 2, "full", 2, False),
    ("llama-3-8b", 2, "lora", 2, True),
    ("llama-3-8b", 2, "lora", 4, True),
]


def stage_bytes(cfg, stages: int, balance: str = "compute") -> List[int]:
    """Bytes of each stage's bf16 parameters under the split the run uses (the model built on meta)."""
    from pipedp.split.adapters import model_blocks
    from pipedp.split.hf_loading import build_on_meta
    from pipedp.split.partition import partition

    blocks = model_blocks(build_on_meta(cfg))
    return [
        sum(2 * p.numel() for b in part for p in b.module.parameters()) for part in partition(blocks, stages, balance)
    ]


def estimate_gib(stage_sizes: List[int], layer_bytes: int, mode: str, self_check: bool) -> float:
    """Memory a run needs, all ranks together, from the measured slices: LoRA the stage's weights plus
    ~1.5 decoder layers while building (pipedp's stand-in layer and one block read twice); full fine-tuning
    ~7x the stage's bf16 weights in steady steps, ~15x in a self-checked first step; 0.6 GiB per process
    for the interpreter and libraries."""
    if mode == "lora":
        per = [s + 1.5 * layer_bytes for s in stage_sizes]
    else:
        per = [(15.0 if self_check else 7.0) * s for s in stage_sizes]
    return sum(v / 2**30 + 0.6 for v in per)


def _layer_bytes(cfg) -> int:
    d, inter = cfg.hidden_size, cfg.intermediate_size
    kv = d * cfg.num_key_value_heads // cfg.num_attention_heads
    return 2 * (2 * d * d + 2 * d * kv + 3 * d * inter)


def suite(
    plan: Sequence[tuple],
    root: str,
    steps: int,
    batch: int,
    microbatches: int,
    seq: int,
    margin_gib: float = 2.0,
    balance: str = "compute",
    baseline: bool = True,
) -> Dict:
    """Each (config, layers) folder written once, its runs done, the folder deleted; a run whose estimated
    memory is above what is available (less ``margin_gib``) is skipped, and listed as skipped."""
    rows, details, writes, skipped = [], [], [], []
    folders: Dict[tuple, List[tuple]] = {}
    for name, layers, mode, stages, check, *recompute in plan:
        folders.setdefault((name, layers), []).append((mode, stages, check, bool(recompute and recompute[0])))
    for (name, layers), runs in folders.items():
        folder = os.path.join(root, f"pipedp-scale-{name}-{layers or 'all'}")
        cfg = hf_config(name, layers)
        meta_bytes = _model_bytes(cfg)
        if _disk_free_gib(root) < meta_bytes / 2**30 + 5:
            skipped.append(f"{name} ({layers or 'all'} layers): {meta_bytes / 2**30:.1f} GiB folder, not enough disk")
            continue
        print(f"writing {folder} ...", flush=True)
        w = write_folder(name, folder, layers)
        writes.append(w)
        print(
            f"  {w['bytes'] / 2**30:.2f} GiB in {w['shards']} shards, {w['seconds']:.0f} s, writer peak "
            f"{w['writer_peak_mib']:.0f} MiB",
            flush=True,
        )
        sizes: Dict[int, List[int]] = {}
        try:
            for mode, stages, check, recompute in runs:
                label = f"{name} ({w['layers']} layers) {mode}, {stages} stages, self_check={check}"
                label += ", activation checkpointing" if recompute else ""
                if stages not in sizes:
                    sizes[stages] = stage_bytes(cfg, stages, balance)
                need, free = estimate_gib(sizes[stages], _layer_bytes(cfg), mode, check), _free_gib()
                if need > free - margin_gib:
                    skipped.append(f"{label}: needs ~{need:.0f} GiB, {free:.0f} GiB available")
                    print(f"  skipped {skipped[-1]}", flush=True)
                    continue
                print(f"  {label} (needs ~{need:.0f} GiB, {free:.0f} available) ...", flush=True)
                r = run(
                    folder,
                    mode,
                    stages,
                    steps,
                    batch,
                    microbatches,
                    seq,
                    self_check=check,
                    activation_checkpointing=recompute,
                    balance=balance,
                    baseline=baseline,
                )
                row = summary_row(name, w["bytes"], r)
                rows.append(row)
                details.append((name, r))
                print("\n".join(markdown_rows([row])[2:]), flush=True)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    return {"rows": rows, "runs": [r for _, r in details], "writes": writes, "details": details, "skipped": skipped}


def _model_bytes(cfg) -> int:
    from pipedp.split.hf_loading import build_on_meta

    meta = build_on_meta(cfg)
    return sum(2 * t.numel() for t in meta.state_dict().values())


def _disk_free_gib(path: str) -> float:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize / 2**30


def record(result: Dict, command: str, results: str, figures: str, info: Dict) -> None:
    """Add the suite's section to bench/RESULTS.md; ``info``: run_all.machine() taken at the start."""
    from . import snapshot
    from .run_all import record as insert

    lines = [
        f"## {info['date']} — scale",
        "",
        f"`{command}`; {info['machine']}; commit `{info['commit']}`"
        + (
            " (measured on a snapshot of it)"
            if snapshot.inside()
            else f" (the working tree: {info['dirty'] or 'clean'})"
        )
        + f"; load average at the start {info['load']}.",
        "",
        "Random bf16 weights written shard by shard (`bench.scale write`; writer peak: "
        + ", ".join(
            f"{w['config']} {w['layers']} layers {w['bytes'] / 2**30:.1f} GiB: {w['writer_peak_mib']:.0f} MiB"
            for w in result["writes"]
        )
        + "). Per rank, one process and one thread each; AdamW (torch's fused kernel); the split by balance="
        + ", ".join(sorted({f"`{r['args'].get('balance', 'params')}`" for r in result["runs"]}))
        + "; LoRA r=8 on q_proj/v_proj with precision "
        'bf16-mixed (bf16 base, float32 adapters), full fine-tuning with bf16-true. "Peak above base": the '
        "largest phase peak of the run (load, build, steps, save) minus the RSS before loading. Imbalance: "
        "slowest / mean stage, predicted by the partition report's costs and measured as each stage's "
        "main-thread CPU time per later step (its work, not its waits).",
        "",
    ]
    lines += markdown_rows(result["rows"])
    if result.get("skipped"):
        lines += ["", "Not run (memory or disk of this machine): " + "; ".join(result["skipped"]) + "."]
    lines += ["", "<details><summary>per rank: MiB above the base RSS per phase</summary>", ""]
    for name, r in result["details"]:
        lines += breakdown(name, r)
    lines += ["</details>", ""]
    insert("\n".join(lines), results)
    os.makedirs(figures, exist_ok=True)
    stamp = info["date"].replace(" ", "-").replace(":", "")
    with open(os.path.join(figures, f"scale-{stamp}.json"), "w") as f:
        json.dump(
            {"info": info, "rows": result["rows"], "runs": result["runs"], "writes": result["writes"]}, f, indent=1
        )


def main(argv=None) -> Dict:
    p = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    w = sub.add_parser("write", help="write a Hugging Face folder with random weights, a shard at a time")
    w.add_argument("config", choices=sorted(CONFIGS))
    w.add_argument("folder")
    w.add_argument("--layers", type=int, default=None, help="an N-layer slice (default: every layer)")
    w.add_argument("--shard-mib", type=int, default=SHARD_BYTES >> 20)
    for name in ("run", "suite"):
        job = sub.add_parser(name)
        if name == "run":
            job.add_argument("folder")
            job.add_argument("--mode", choices=["lora", "full"], default="lora")
            job.add_argument("--stages", type=int, default=2)
        else:
            job.add_argument("--configs", default=None, help="a grid instead of the default PLAN: these configs ...")
            job.add_argument("--layers", type=int, default=2, help="... with this many layers ...")
            job.add_argument("--full-depth", action="store_true", help="... or every layer of the configuration ...")
            job.add_argument("--modes", default="lora,full", help="... in these modes ...")
            job.add_argument("--stage-counts", default="2", help="... on these stage counts ...")
            job.add_argument("--self-check", default="on", help="... with self_check on, off, or on,off ...")
            job.add_argument("--activation-checkpointing", default="off", help="... and this: off, on, or off,on")
            job.add_argument("--root", default=os.environ.get("TMPDIR", "/tmp"), help="where folders are written")
            job.add_argument("--no-record", action="store_true", help="do not add a section to bench/RESULTS.md")
            job.add_argument("--results", default=None, help="markdown file to add the section to (bench/RESULTS.md)")
            job.add_argument("--figures", default=None, help="folder for the JSON (bench/figures)")
            job.add_argument("--tree", choices=["head", "work"], default="head", help="see bench/snapshot.py")
        job.add_argument("--steps", type=int, default=3)
        job.add_argument("--batch", type=int, default=4)
        job.add_argument("--microbatches", type=int, default=2)
        job.add_argument("--seq", type=int, default=32)
        job.add_argument(
            "--balance", choices=["compute", "params", "uniform"], default="compute", help="the split's rule"
        )
        if name == "run":
            job.add_argument("--no-self-check", action="store_true", help="self_check=False (default: on, as shipped)")
            job.add_argument(
                "--activation-checkpointing", action="store_true", help="recompute each layer's activations"
            )
        job.add_argument("--no-baseline", action="store_true", help="skip the non-private torch 1F1B steps")
    args = p.parse_args(argv)
    if args.command == "write":
        out = write_folder(args.config, args.folder, args.layers, args.shard_mib << 20)
        print(json.dumps(out, indent=1))
        return out
    if args.command == "run":
        r = run(
            args.folder,
            args.mode,
            args.stages,
            args.steps,
            args.batch,
            args.microbatches,
            args.seq,
            self_check=not args.no_self_check,
            activation_checkpointing=args.activation_checkpointing,
            balance=args.balance,
            baseline=not args.no_baseline,
        )
        with open(os.path.join(args.folder, "model.safetensors.index.json")) as f:
            size = json.load(f)["metadata"]["total_size"]
        row = summary_row(os.path.basename(os.path.normpath(args.folder)), size, r)
        print("\n".join(markdown_rows([row])))
        print("\n".join(breakdown(args.folder, r)))
        return r
    from .run_all import FIGURES, RESULTS, command_line, in_snapshot

    results_path, figures_path = args.results or RESULTS, args.figures or FIGURES
    if in_snapshot("bench.scale", argv, args.tree, results_path, figures_path):
        return {}
    cmd = command_line("bench.scale", argv).strip()
    plan: List[tuple]
    if args.configs is None:
        plan = PLAN
    else:
        layers = None if args.full_depth else args.layers
        plan = [
            (name, layers, mode, int(stages), check == "on", recompute == "on")
            for name in args.configs.split(",")
            for mode in args.modes.split(",")
            for stages in args.stage_counts.split(",")
            for check in args.self_check.split(",")
            for recompute in args.activation_checkpointing.split(",")
        ]
    from .run_all import machine

    info = machine()
    result = suite(
        plan,
        args.root,
        args.steps,
        args.batch,
        args.microbatches,
        args.seq,
        balance=args.balance,
        baseline=not args.no_baseline,
    )
    print("\n".join(markdown_rows(result["rows"])))
    if not args.no_record and result["rows"]:
        record(result, cmd, results_path, figures_path, info)
    return result


if __name__ == "__main__":
    main()
