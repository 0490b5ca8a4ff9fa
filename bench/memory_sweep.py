"""Peak memory per process against the number of micro-batches at a fixed micro-batch size:
1F1B's point is memory bounded by about p micro-batches however large m is.

    python -m bench.memory_sweep                     # m in {8, 32, 128}, micro-batches of 4, 2 stages

Per-process peak RSS above the process's state after building the model and one warm-up
step at the same m (so the table shows what a step holds, not the model or the allocator's
first-touch), for torch's Schedule1F1B (no DP) and pipedp's 1F1B and dp-zb (ghost), and 1F1B with
grad_mode="keep" (per-sample gradients held from I to W).
"""

from __future__ import annotations

import argparse
import json
import os
import warnings
from typing import Dict, List

import torch
import torch.distributed as dist
import torch.distributed.pipelining  # noqa: F401  (imported before any measured phase)

import pipedp.train.trainer  # noqa: F401
from pipedp.models import GPTConfig
from pipedp.runtime.launch import launch

from . import steps
from .memory import PeakMemory
from .presets import gpt_preset

PRESET = gpt_preset(
    GPTConfig(vocab_size=256, seq_len=64, d_model=256, n_heads=4, n_layers=4),
    "GPT-style, 4 layers, d=256, T=64",
    "gpt-256",
)


def _step(name: str, m: int, size: int):
    if name == "torch-1f1b":
        return steps.torch_pipeline(PRESET, "1f1b", microbatches=m, batch=m * size).step
    schedule = name[len("pipedp-") :].removesuffix("-keep")
    mode = "keep" if name.endswith("-keep") else "ghost"
    return steps.pipedp(PRESET, schedule, mode, microbatches=m, batch=m * size).step


def sweep(rank: int, ms: List[int], size: int) -> List[Dict]:
    warnings.filterwarnings("ignore")
    rows = []
    for name in ("torch-1f1b", "pipedp-1f1b", "pipedp-dp-zb", "pipedp-1f1b-keep"):
        for m in ms:
            step = _step(name, m, size)
            step()  # warm-up at this m
            dist.barrier()
            with PeakMemory() as mem:
                step()
            gathered: List = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, mem.peak_mib)
            rows.append({"name": name, "microbatches": m, "peak_mib": gathered})
            del step
    return rows


def main(argv=None) -> Dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--microbatches", default="8,32,128")
    p.add_argument("--microbatch-size", type=int, default=4)
    p.add_argument("--out", default="bench/results")
    args = p.parse_args(argv)
    ms = [int(v) for v in args.microbatches.split(",")]
    rows = launch(sweep, 2, (ms, args.microbatch_size), timeout_s=3600)[0]
    print(
        f"**{PRESET.note}**, 2 stages, micro-batches of {args.microbatch_size}; per-process peak MiB above the "
        f"state after a warm-up step (`python -m bench.memory_sweep`)\n"
    )
    print("| contender | " + " | ".join(f"m={m}" for m in ms) + f" | m={ms[-1]} / m={ms[0]} |")
    print("|---|" + "---|" * (len(ms) + 1))
    for name in dict.fromkeys(r["name"] for r in rows):
        mine = [r for r in rows if r["name"] == name]
        cells = [" / ".join(f"{v:.0f}" for v in r["peak_mib"]) for r in mine]
        growth = max(mine[-1]["peak_mib"]) / max(1e-9, max(mine[0]["peak_mib"]))
        print(f"| {name} | " + " | ".join(cells) + f" | {growth:.2f} |")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "memory-sweep.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return {"rows": rows}


if __name__ == "__main__":
    main()
