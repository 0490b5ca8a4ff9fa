"""Where a pipeline step's time goes, per process: wall time, CPU time in user code and in the
kernel, context switches and page faults per step, for torch's Schedule1F1B (no DP) and pipedp's
1F1B side by side (getrusage over the timed steps, after warm-up).

    python -m bench.cpu_time                          # gpt preset, 2 stages, m=8, 5 steps
    python -m bench.cpu_time --clipping per_stage     # pipedp without the per-micro-batch norm all-reduce
    python -m bench.cpu_time --grad-mode keep         # pipedp holding per-sample gradients from I to W

A wall time well above user + sys means waiting; many involuntary context switches mean more
runnable threads than cores; sys time is mostly socket, futex and page-fault work.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from typing import Dict, List

from pipedp.config import GRAD_MODES
from pipedp.runtime.launch import launch

from .presets import PRESETS

BATCH = 32


def _usage(step, warmup: int, reps: int, sync) -> Dict[str, float]:
    for _ in range(warmup):
        step()
    sync()
    before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for _ in range(reps):
        step()
    sync()
    wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
    per = 1.0 / reps
    return {
        "wall ms": 1000 * wall * per,
        "user ms": 1000 * (after.ru_utime - before.ru_utime) * per,
        "sys ms": 1000 * (after.ru_stime - before.ru_stime) * per,
        "voluntary switches": (after.ru_nvcsw - before.ru_nvcsw) * per,
        "involuntary switches": (after.ru_nivcsw - before.ru_nivcsw) * per,
        "minor faults": (after.ru_minflt - before.ru_minflt) * per,
    }


def _rank(rank: int, contender: str, preset_name: str, m: int, clipping: str, grad_mode: str, warmup: int, reps: int):
    import torch.distributed as dist

    from pipedp import settle_process

    from . import steps

    settle_process()  # both contenders under the settings `pipedp train` uses

    preset, stages = PRESETS[preset_name], dist.get_world_size()
    if contender == "torch-1f1b":
        step = steps.torch_pipeline(preset, "1f1b", microbatches=m, batch=BATCH).step
    else:
        norm = [1.0 / stages**0.5] * stages if clipping == "per_stage" else 1.0
        step = steps.pipedp(
            preset, "1f1b", grad_mode, microbatches=m, batch=BATCH, clipping=clipping, max_grad_norm=norm
        ).step
    return _usage(step, warmup, reps, dist.barrier)


def main(argv=None) -> List[Dict]:
    p = argparse.ArgumentParser(prog="python -m bench.cpu_time", description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="gpt", choices=sorted(PRESETS))
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--clipping", default="flat", choices=["flat", "per_stage"])
    p.add_argument("--grad-mode", default="ghost", choices=GRAD_MODES)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args(argv)
    rows = []
    print(
        f"{args.preset} preset, {args.stages} stages, m={args.microbatches}, per process and step "
        f"(`python -m bench.cpu_time {' '.join(sys.argv[1:] if argv is None else argv)}`)\n"
    )
    print("| contender | rank | wall ms | user ms | sys ms | voluntary / involuntary switches | minor faults |")
    print("|---|---|---|---|---|---|---|")
    for contender in ("torch-1f1b", f"pipedp-1f1b ({args.clipping}, {args.grad_mode})"):
        per_rank = launch(
            _rank,
            args.stages,
            (
                contender.split(" ")[0],
                args.preset,
                args.microbatches,
                args.clipping,
                args.grad_mode,
                args.warmup,
                args.reps,
            ),
            timeout_s=1200,
            threads=1,
        )
        for rank, r in enumerate(per_rank):
            rows.append(dict(r, contender=contender, rank=rank))
            print(
                f"| {contender} | {rank} | {r['wall ms']:.1f} | {r['user ms']:.1f} | {r['sys ms']:.1f} | "
                f"{r['voluntary switches']:.0f} / {r['involuntary switches']:.0f} | {r['minor faults']:.0f} |"
            )
    return rows


if __name__ == "__main__":
    main()
