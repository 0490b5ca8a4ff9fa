"""Which splits of a Llama-2-70B-shaped model fit 2 nodes x 8 devices of 80 GB, for DP full fine-tuning and DP LoRA:
``pipedp plan``'s estimate (pipedp.planner.estimate) for each candidate mesh, one after the other.

    python -m bench.plan_70b                       # every candidate (~5 min each on one core)
    python -m bench.plan_70b --only full:8x2x1     # one
    python -m bench.plan_70b --measure /tmp/l70    # a 1-layer slice trained here, beside the planner's prediction

The config is Llama-2-70B's (80 layers, width 8192, FFN 28672, 64 heads, 8 KV heads, vocab 32000, bf16), written
as a config.json only: the planner builds it on meta and reads no weight. A mesh is stages x tensor-parallel x
replicas = 16 ranks; torchrun numbers a node's 8 ranks consecutively and pipedp's rank is (replica x stages +
stage) x T + t, so T <= 8 keeps each stage's tensor-parallel group inside a node. Full fine-tuning: bf16-true,
AdamW (fused), the optimizer sharded over the replicas where there are several; LoRA: r=8 on q_proj and v_proj
over a bf16 base (bf16-mixed: float32 adapters), T=1 (the meshes measured before LoRA under tensor parallelism
was built; its meshes are not in this list yet). Each row: the
largest micro-batch size whose predicted peak fits 80 GB on every stage (with the first step's self-check off:
``--no-self-check``; it is one step), and the tightest stage's peak there.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import tempfile
import time
import warnings
from dataclasses import dataclass
from typing import List, Optional, Tuple

from .memory import status_kib

Mesh = Tuple[int, ...]  # stages x tensor-parallel x replicas
FULL: List[Mesh] = [(16, 1, 1), (8, 2, 1), (4, 4, 1), (2, 8, 1), (4, 2, 2), (2, 4, 2)]  # stages x T x replicas
LORA: List[Mesh] = [(16, 1, 1), (8, 1, 2), (4, 1, 4), (2, 1, 8)]
MEMORY = 80 * 10**9
SEQ_LEN, MICROBATCHES = 1024, 8


@dataclass
class Row:
    mode: str
    mesh: tuple
    largest: int
    seconds: float
    note: str = ""

    def line(self) -> str:
        s, t, r = self.mesh
        layout = (
            "a replica per node" if s * t == 8 else ("replicas across nodes" if s * t < 8 else "stages across nodes")
        )
        fits = str(self.largest) if self.largest else "no"
        return f"| {self.mode} | {s} x {t} x {r} | {layout} | {fits} | {self.note} | {self.seconds:.0f} |"


def write_config(folder: str) -> None:
    from transformers import LlamaConfig

    LlamaConfig(
        vocab_size=32000,
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        torch_dtype="bfloat16",
        architectures=["LlamaForCausalLM"],
    ).save_pretrained(folder)


def plan(folder: str, mode: str, mesh: tuple) -> Row:
    from pipedp import PipelineConfig
    from pipedp.planner import estimate

    stages, t, replicas = mesh
    pipeline = PipelineConfig(
        microbatches=MICROBATCHES,
        tensor_parallel=t,
        replicas=replicas,
        shard_optimizer=mode == "full" and replicas > 1,
        precision="bf16-true" if mode == "full" else "bf16-mixed",
        self_check=False,
    )
    start = time.monotonic()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = estimate(
            folder, stages, 1, SEQ_LEN, lora_r=8 if mode == "lora" else None, pipeline=pipeline, device_memory=MEMORY
        )
    note = (result.fit_note or "").split(": ", 1)[-1]  # "N (stage k at X GiB, set by its ...)"
    return Row(mode, mesh, result.largest_fit or 0, time.monotonic() - start, note)


# ---- a slice of the model trained here, beside its plan -------------------------------------------------------
SLICE = dict(layers=1, batch=2, seq_len=128, microbatches=2, lora_r=8)
TARGETS = ("q_proj", "v_proj")


def _status(field: str) -> int:
    return status_kib(field) * 1024


def _pipeline():
    from pipedp import PipelineConfig

    return PipelineConfig(stages=2, microbatches=SLICE["microbatches"], microbatch_size=SLICE["batch"])


def measure_stage(rank: int, folder: str) -> List[int]:
    """One rank of the slice's run (as pipedp train runs it: its stage loaded alone, LoRA on it, AdamW): the kernel's
    peak resident set (VmHWM, reset before each step) above the process before its stage was loaded, per step."""
    import warnings

    import torch

    from pipedp import PipelineDPTrainer, PrivacyConfig
    from pipedp.cli.build import with_lora
    from pipedp.models import token_loss
    from pipedp.split.hf_loading import load_pipeline_stage

    warnings.filterwarnings("ignore")
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 128 << 10)  # M_MMAP_THRESHOLD fixed: a freed tensor leaves the resident set at once
    gc.collect()
    libc.malloc_trim(0)
    base = _status("VmRSS")
    model = with_lora(load_pipeline_stage(folder, 2, rank), SLICE["lora_r"], TARGETS, 0)
    rows = SLICE["microbatches"] * SLICE["batch"]
    trainer = PipelineDPTrainer(
        model,
        token_loss,
        lambda params: torch.optim.AdamW(params, lr=1e-4),
        pipeline=_pipeline(),
        privacy=PrivacyConfig(expected_batch_size=rows, sample_rate=0.01, sampling="poisson"),
    )
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 32000, (rows, SLICE["seq_len"]), generator=g)
    peaks = []
    for _ in range(2):
        gc.collect()
        libc.malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM
        trainer.step({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, ids)
        peaks.append(_status("VmHWM") - base)
    trainer.close()
    return peaks


def measure(folder: str) -> None:
    """Write the slice (float32: bf16 products are 40-500x slower on CPUs without AVX-512), plan it, train it."""
    import os

    import torch
    from transformers import LlamaForCausalLM

    from pipedp.planner import estimate
    from pipedp.runtime.launch import launch

    if not os.path.exists(os.path.join(folder, "config.json")):
        write_config(folder)
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(folder)
        config.num_hidden_layers, config.torch_dtype = SLICE["layers"], "float32"
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(folder)
    start = time.monotonic()
    plan = estimate(folder, 2, SLICE["batch"], SLICE["seq_len"], lora_r=SLICE["lora_r"], pipeline=_pipeline())
    planned = time.monotonic() - start
    start = time.monotonic()
    measured = launch(measure_stage, 2, (folder,), timeout_s=3600)
    trained = time.monotonic() - start
    print(
        f"Llama-2-70B-shaped slice ({SLICE}), float32, 2 stages over gloo (plan {planned:.0f} s, run {trained:.0f} s)"
    )
    print("| stage | blocks | first step: predicted / measured GiB | later step: predicted / measured GiB |")
    print("|---|---|---|---|")
    for s, peaks in zip(plan.stages, measured):
        first, later = max(s.first_step, s.at_step), max(s.steady, s.at_step)
        print(
            f"| {s.index} | {s.blocks} | {first / 2**30:.2f} / {peaks[0] / 2**30:.2f} ({first / peaks[0]:.2f}) | "
            f"{later / 2**30:.2f} / {peaks[1] / 2**30:.2f} ({later / peaks[1]:.2f}) |"
        )


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=None, help="MODE:SxTxR, e.g. full:8x2x1")
    parser.add_argument("--measure", default=None, help="a folder for the 1-layer slice: write, plan and train it")
    args = parser.parse_args(argv)
    if args.measure:
        measure(args.measure)
        return
    candidates: List[Tuple[str, Mesh]] = [("full", m) for m in FULL] + [("lora", m) for m in LORA]
    if args.only:
        mode, mesh = args.only.split(":")
        candidates = [(mode, tuple(int(v) for v in mesh.split("x")))]
    print(f"Llama-2-70B-shaped, 2 nodes x 8 devices of 80 GB, {MICROBATCHES} micro-batches of B x {SEQ_LEN} tokens")
    print("| mode | stages x T x replicas | node layout | largest B | the planner's note | plan s |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as folder:
        write_config(folder)
        for mode, mesh in candidates:
            try:
                print(plan(folder, mode, mesh).line(), flush=True)
            except Exception as exc:  # noqa: BLE001 - a refused mesh is a row of the answer
                print(Row(mode, mesh, 0, 0.0, f"refused: {str(exc).splitlines()[0][:160]}").line(), flush=True)


if __name__ == "__main__":
    main()
