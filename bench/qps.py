"""QPS and memory, side by side: Opacus, plain PyTorch, the naive split, torch pipelining, pipedp.

    python -m bench.qps                      # default: GPT preset, 2 stages, batch 32, m in {1,2,4,8,16}
    python -m bench.qps --preset gpt-long    # long sequences: ghost vs materialize
    python -m bench.qps --quick              # seconds; what the smoke test runs

Prints a markdown table, writes JSON and a PNG plot (QPS vs micro-batches; peak memory per stage).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import warnings
from typing import Dict, List

# Every library a contender uses is imported here, before any measured phase: no contender's
# peak memory may include the cost of importing one (the first contender of a process used to).
import opacus  # noqa: F401
import torch
import torch.distributed as dist
import torch.distributed.pipelining  # noqa: F401

import pipedp.train.trainer  # noqa: F401
from pipedp.runtime.launch import launch
from pipedp.runtime.process import settle_process

from . import steps
from .memory import PeakMemory
from .presets import PRESETS, Preset
from .report import markdown, plot, ratios


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.qps", description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="gpt", choices=sorted(PRESETS))
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--microbatches", default="1,2,4,8,16")
    p.add_argument("--schedules", default="gpipe,1f1b")
    p.add_argument("--modes", default="ghost,materialize")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default="bench/results", help="folder for the JSON and the PNG")
    p.add_argument("--quick", action="store_true", help="tiny preset, m in {1,2}, 1 rep (smoke test)")
    args = p.parse_args(argv)
    if args.quick:
        args.preset, args.batch, args.microbatches, args.warmup, args.reps = "tiny", 8, "1,2", 1, 1
    return args


def single_process(name: str, preset: Preset, batch: int, warmup: int, reps: int) -> Dict:
    """One contender on the whole model in this process: its median step and its peak (build included)."""
    with PeakMemory() as mem:
        c = steps.plain(preset, batch) if name == "plain" else steps.opacus(preset, name.split("-")[1], batch)
        times = steps.timed(c.step, warmup, reps)
    return {"name": name, "seconds": statistics.median(times), "peak_mib": [mem.peak_mib], "batch": batch}


def _contender(item: Dict, preset: Preset, batch: int) -> steps.Contender:
    m = item["microbatches"]
    if item["kind"] == "naive":
        return steps.naive(preset, batch)
    if item["kind"] == "torch":
        return steps.torch_pipeline(preset, item["schedule"], microbatches=m, batch=batch)
    return steps.pipedp(preset, item["schedule"], item["mode"], microbatches=m, batch=batch)


def run_multiprocess(rank: int, plan: List[Dict], preset_name: str, batch: int, warmup: int, reps: int):
    """Every multi-process contender of the plan in turn on this rank, each built, timed and closed alone."""
    warnings.filterwarnings("ignore")
    settle_process()  # as `pipedp train` does, for every contender alike (see pipedp/runtime/process.py)
    preset = PRESETS[preset_name]
    results = []
    for item in plan:
        with PeakMemory() as mem:
            c = _contender(item, preset, batch)
            times = steps.timed(c.step, warmup, reps, dist.barrier)
            c.close()
        r = {"seconds": statistics.median(times), "peak_mib": mem.peak_mib}
        gathered: List = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, r)
        results.append(dict(item, seconds=gathered[0]["seconds"], peak_mib=[g["peak_mib"] for g in gathered]))
    return results


def main(argv=None) -> dict:
    args = parse_args(argv)
    mbs = [int(m) for m in args.microbatches.split(",")]
    schedules, modes = args.schedules.split(","), args.modes.split(",")
    for m in mbs:
        if args.batch % m:
            raise SystemExit(f"--batch {args.batch} must divide by every micro-batch count (torch pipelining needs it)")
    preset = PRESETS[args.preset]
    start = time.perf_counter()
    torch.set_num_threads(args.stages)  # one process gets the cores the pipeline's processes get
    settle_process()  # every contender, in every process, runs under the settings `pipedp train` uses
    singles = [
        single_process(n, preset, args.batch, args.warmup, args.reps) for n in ("plain", "opacus-hooks", "opacus-ghost")
    ]
    plan = [{"kind": "naive", "name": "naive-split", "microbatches": 1}]
    # torch has GPipe and 1F1B; pipedp's dp-zb schedules are compared with torch's 1F1B
    torch_schedules = sorted({s if s in ("gpipe", "1f1b") else "1f1b" for s in schedules})
    for s in torch_schedules:
        # torch's Schedule1F1B refuses fewer micro-batches than stages
        plan += [
            {"kind": "torch", "name": f"torch-{s}", "schedule": s, "microbatches": m}
            for m in mbs
            if not (s == "1f1b" and m < args.stages)
        ]
    for s in schedules:
        for mode in modes:
            plan += [
                {"kind": "pipedp", "name": f"pipedp-{s}-{mode}", "schedule": s, "mode": mode, "microbatches": m}
                for m in mbs
            ]
    multi = launch(
        run_multiprocess,
        args.stages,
        (plan, args.preset, args.batch, args.warmup, args.reps),
        timeout_s=3600,
        threads=1,
    )[0]
    rows = singles + multi
    for r in rows:
        r["qps"] = args.batch / r["seconds"]
    result = {
        "command": "python -m bench.qps " + " ".join(sys.argv[1:]),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "preset": preset.note,
        "stages": args.stages,
        "batch": args.batch,
        "reps": args.reps,
        "rows": rows,
        "ratios": ratios(rows, args.stages),
        "seconds": time.perf_counter() - start,
    }
    os.makedirs(args.out, exist_ok=True)
    base = os.path.join(args.out, f"qps-{args.preset}-p{args.stages}")
    with open(base + ".json", "w") as f:
        json.dump(result, f, indent=1)
    print(markdown(result))
    try:
        plot(result, base + ".png")
        print(f"\nwrote {base}.json and {base}.png")
    except ImportError:
        print(f"\nwrote {base}.json (no PNG: pip install matplotlib)")
    return result


if __name__ == "__main__":
    main()
