"""Which splits of a Llama-2-70B-shaped model fit 2 nodes x 8 devices of 80 GB, for DP full fine-tuning and DP LoRA:
``pipedp plan``'s estimate (pipedp.cli.plan.estimate) for each candidate mesh, one after the other.

    python -m bench.plan_70b                       # every candidate (~5 min each on one core)
    python -m bench.plan_70b --only full:8x2x1     # one

The config is Llama-2-70B's (80 layers, width 8192, FFN 28672, 64 heads, 8 KV heads, vocab 32000, bf16), written
as a config.json only: the planner builds it on meta and reads no weight. A mesh is stages x tensor-parallel x
replicas = 16 ranks; torchrun numbers a node's 8 ranks consecutively and pipedp's rank is (replica x stages +
stage) x T + t, so T <= 8 keeps each stage's tensor-parallel group inside a node. Full fine-tuning: bf16-true,
AdamW (fused), the optimizer sharded over the replicas where there are several; LoRA: r=8 on q_proj and v_proj
over a bf16 base (bf16-mixed: float32 adapters), T=1 (PEFT under tensor parallelism is refused). Each row: the
largest micro-batch size whose predicted peak fits 80 GB on every stage (with the first step's self-check off:
``--no-self-check``; it is one step), and the tightest stage's peak there.
"""

from __future__ import annotations

import argparse
import tempfile
import time
import warnings
from dataclasses import dataclass
from typing import List, Optional, Tuple

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
    from pipedp.cli.plan import estimate

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


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=None, help="MODE:SxTxR, e.g. full:8x2x1")
    args = parser.parse_args(argv)
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
