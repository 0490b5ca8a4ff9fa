"""Schedules compared in the simulator with costs measured from real passes.

    python -m bench.schedule_sim                      # p in {2, 4, 8, 16}, m in {8, 32, 128}

Measures, on this machine, one transformer block of the gpt preset on a micro-batch of 4
sequences: F (forward with DP capture), I (input-backward + per-sample norms), W (clipped
weight pass), the plain forward and full backward of the same block (the non-private
baseline), and over 2 gloo processes the latency of an activation send and of the
per-micro-batch norm all-reduce. Each stage is taken to hold one such block. Prints the
simulated makespan of GPipe, 1F1B, dp-zb and dp-zb-2x, their bubble, and the predicted DP
cost: non-private 1F1B's makespan (plain F + full backward) over the DP schedule's.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Dict, List

import torch
import torch.distributed as dist

import schedules
from pipedp.runtime.launch import launch
from pipedp.runtime.stage import Stage, StageOptions
from pipedp.split.adapters import model_blocks
from schedules import Kind

from .presets import PRESETS


def _median_ms(fn, reps: int = 15) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def measure_block_costs(size: int = 4) -> Dict[str, float]:
    torch.set_num_threads(1)
    preset = PRESETS["gpt"]
    torch.manual_seed(0)
    blocks = model_blocks(preset.build())
    block = blocks[1]  # a transformer block
    x = torch.randn(size, 64, 128)
    stage = Stage(1, 3, [block], None, StageOptions("ghost"))
    ones = torch.ones(size, dtype=torch.float64)
    phases: Dict[str, List[float]] = {"F": [], "I": [], "W": []}
    for rep in range(18):
        t0 = time.perf_counter()
        y = stage.forward(0, x)
        t1 = time.perf_counter()
        stage.backward_input(0, torch.ones_like(y))
        t2 = time.perf_counter()
        stage.weight(0, ones)
        t3 = time.perf_counter()
        if rep >= 3:
            for k, v in zip("FIW", (t1 - t0, t2 - t1, t3 - t2)):
                phases[k].append(1000 * v)
    stage.close()
    out = {k: statistics.median(v) for k, v in phases.items()}
    module = block.module
    xg = x.clone().requires_grad_(True)
    out["plain F"] = _median_ms(lambda: module(xg))
    out["plain B"] = _median_ms(lambda: module(xg).sum().backward()) - out["plain F"]
    return out


def _latencies(rank: int, size: int) -> Dict[str, float]:
    act = torch.randn(size, 64, 128)
    norms = torch.zeros(size, dtype=torch.float64)

    def send():
        if rank == 0:
            dist.send(act, 1)
            dist.recv(act, 1)
        else:
            dist.recv(act, 0)
            dist.send(act, 0)

    def reduce():
        dist.all_reduce(norms)

    return {"send": _median_ms(send, 30) / 2, "reduce": _median_ms(reduce, 30)}


def simulate_grid(costs: Dict[str, float], ps: List[int], ms: List[int]) -> List[Dict]:
    dp = {Kind.F: costs["F"], Kind.I: costs["I"], Kind.W: costs["W"]}
    plain = {Kind.F: costs["plain F"], Kind.I: costs["plain B"], Kind.W: 0.0}  # torch's 1F1B: full backward
    rows = []
    for p in ps:
        for m in ms:
            ref = schedules.simulate(schedules.build("1f1b", p, m), plain, comm_latency=costs["send"]).makespan
            row = {"p": p, "m": m, "non-private 1f1b": ref}
            for name in ("gpipe", "1f1b", "dp-zb", "dp-zb-2x"):
                r = schedules.simulate(
                    schedules.build(name, p, m, dp), dp, comm_latency=costs["send"], reduce_latency=costs["reduce"]
                )
                row[name] = r.makespan
                row[name + " bubble"] = r.bubble_fraction
            rows.append(row)
    return rows


def main(argv=None) -> List[Dict]:
    a = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a.add_argument("--stages", default="2,4,8,16")
    a.add_argument("--microbatches", default="8,32,128")
    args = a.parse_args(argv)
    costs = measure_block_costs()
    costs.update(launch(_latencies, 2, (4,), timeout_s=300)[0])
    print("measured (ms): " + ", ".join(f"{k} {v:.2f}" for k, v in costs.items()))
    rows = simulate_grid(
        costs, [int(v) for v in args.stages.split(",")], [int(v) for v in args.microbatches.split(",")]
    )
    names = ("gpipe", "1f1b", "dp-zb", "dp-zb-2x")
    print("\n| p | m | " + " | ".join(f"{n} ms (bubble)" for n in names) + " | DP cost of best (x non-private 1F1B) |")
    print("|---|---|" + "---|" * (len(names) + 1))
    for r in rows:
        best = min(r[n] for n in names)
        cells = " | ".join(f"{r[n]:.0f} ({r[n + ' bubble']:.1%})" for n in names)
        print(f"| {r['p']} | {r['m']} | {cells} | {r['non-private 1f1b'] / best:.2f} |")
    return rows


if __name__ == "__main__":
    main()
