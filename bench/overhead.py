"""Where the DP step's time goes on small models: per phase, and the fixed costs per micro-batch and per layer.

    python -m bench.overhead            # ~2 min on 2 cores
    python -m bench.overhead --quick

One process, one thread, every stage in turn (no pipeline, no transport: compute and dispatch only).

1. Phases on the small preset (2 stages in one process, 8 micro-batches of 8 rows; plain and DP steps
   alternating): the time of
   pipedp's F (forward with capture), I (input backward + per-sample norms), W (clipped weight pass)
   and the rest of the step (norm sum, noise, update), timed by wrapping the stages' methods, and
   the aten operators each phase dispatches per micro-batch; against plain micro-batched training
   (forward + backward per micro-batch, one SGD step) of the same model and batch.
2. Fixed costs: a narrow GPT (d=32, T=16, micro-batches of 4 rows, where the arithmetic is negligible)
   with L in {2, 4, 8} blocks and m in {2, 8} micro-batches; the step time (and the aten operators
   dispatched per step) fitted as a + m * (b + c * L) by least squares, for pipedp (ghost, keep, one
   stage) and plain training, so c is the fixed cost per block and micro-batch, b the rest per
   micro-batch. Plain and DP alternate, median of the repetitions.
3. By operator (small preset): each aten operator's time in a plain and a DP step (auto), the largest
   differences first, and both steps' matrix-product FLOPs: their ratio is the most DP can reach at
   plain's FLOP rate.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections import defaultdict
from typing import Callable, Dict, List

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pipedp.models import GPTConfig

from . import steps as S
from .presets import PRESETS, gpt_preset


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


class _Phases:
    """Wraps the stages' forward / backward_input / weight to accumulate their time (and, when counting,
    their aten operators)."""

    PHASES = ("forward", "backward_input", "weight")

    def __init__(self, trainer):
        self.time: Dict[str, float] = defaultdict(float)
        self.ops: Dict[str, int] = defaultdict(int)
        self.counting = False
        for stage in trainer.runtime.local_stages:
            for name in self.PHASES:
                setattr(stage, name, self._wrap(name, getattr(stage, name)))

    def _wrap(self, name, fn):
        def timed(*args, **kwargs):
            if self.counting:
                with _CountOps() as mode:
                    out = fn(*args, **kwargs)
                self.ops[name] += mode.count
                return out
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            self.time[name] += time.perf_counter() - start
            return out

        return timed

    def reset(self):
        self.time.clear()
        self.ops.clear()


def _trainer(preset, m: int, mode: str, stages: int, batch: int):
    return S.pipedp_trainer(preset, "1f1b", mode, stages=stages, microbatches=m, batch=batch)


def _median_time(fn, reps: int) -> float:
    return statistics.median(S.timed(fn, 0, reps))


def _count(fn) -> int:
    with _CountOps() as mode:
        fn()
    return mode.count


def phases(preset_name: str = "small", reps: int = 5) -> Dict:
    """Plain micro-batched training and pipedp ghost / keep on the preset, their steps alternating."""
    preset = PRESETS[preset_name]
    m, batch = preset.microbatches, preset.batch
    x, y = preset.make_batch(batch, 0)
    out: Dict = {"preset": preset_name, "microbatches": m, "rows": batch // m}
    torch.manual_seed(0)
    plain = S.plain(preset, len(x), microbatches=m).step
    trainers, timers = {}, {}
    for mode in ("ghost", "keep"):
        torch.manual_seed(0)
        trainers[mode] = _trainer(preset, m, mode, 2, batch)
        timers[mode] = _Phases(trainers[mode])
    steps: Dict[str, Callable[[], object]] = {
        "plain": plain,
        **{mode: functools.partial(t.step, x, y) for mode, t in trainers.items()},
    }
    for step in steps.values():  # the first step (self-check) and one more
        step()
        step()
    times: Dict[str, List[float]] = defaultdict(list)
    per_phase: Dict[str, Dict[str, List[float]]] = {mode: defaultdict(list) for mode in trainers}
    for _ in range(reps):
        for name, step in steps.items():
            if name in timers:
                timers[name].reset()
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
            if name in timers:
                for k in _Phases.PHASES:
                    per_phase[name][k].append(timers[name].time[k])
    out["plain ms"] = 1000 * statistics.median(times["plain"])
    out["plain ops per micro-batch"] = _count(plain) / m
    for mode, trainer in trainers.items():
        timer = timers[mode]
        timer.reset()
        timer.counting = True
        total = _count(lambda t=trainer: t.step(x, y))
        timer.counting = False
        row = {"step ms": 1000 * statistics.median(times[mode])}
        for k in timer.PHASES:
            row[f"{k} ms"] = 1000 * statistics.median(per_phase[mode][k])
        row["rest ms"] = row["step ms"] - sum(row[f"{k} ms"] for k in timer.PHASES)
        for k in timer.PHASES:
            row[f"{k} ops per micro-batch"] = timer.ops[k] / m
        row["ops per micro-batch"] = total / m
        out[mode] = row
        trainer.close()
    return out


def fixed_costs(layers=(2, 4, 8), ms=(2, 8), rows: int = 4, reps: int = 5, rounds: int = 3) -> Dict:
    """The step time and the aten operators dispatched per step, each fitted as a + m * (b + c * L), for
    plain training and pipedp ghost / keep (one stage)."""
    samples: Dict[str, List[tuple]] = {"plain": [], "ghost": [], "keep": []}
    for L in layers:
        preset = gpt_preset(GPTConfig(vocab_size=32, seq_len=16, d_model=32, n_heads=2, n_layers=L), "narrow", "narrow")
        for m in ms:
            x, y = preset.make_batch(m * rows, 0)
            steps: Dict[str, Callable[[], object]] = {}
            torch.manual_seed(0)
            steps["plain"] = S.plain(preset, len(x), microbatches=m).step
            trainers = []
            for mode in ("ghost", "keep"):
                torch.manual_seed(0)
                t = _trainer(preset, m, mode, 1, m * rows)
                trainers.append(t)
                steps[mode] = functools.partial(t.step, x, y)
            for s in steps.values():
                s()
                s()
            got = defaultdict(list)
            for _ in range(rounds):  # alternate, so a slow spell hits every contender
                for name, s in steps.items():
                    got[name].append(_median_time(s, reps))
            for name, s in steps.items():
                samples[name].append((L, m, statistics.median(got[name]), _count(s)))
            for t in trainers:
                t.close()
    fits = {}
    for name, pts in samples.items():
        a = torch.tensor([[1.0, m, m * L] for L, m, _, _ in pts], dtype=torch.float64)
        t = torch.tensor([[s, ops] for _, _, s, ops in pts], dtype=torch.float64)
        coef = torch.linalg.lstsq(a, t).solution
        fits[name] = {
            "per step ms": 1000 * float(coef[0, 0]),
            "per micro-batch ms": 1000 * float(coef[1, 0]),
            "per block and micro-batch ms": 1000 * float(coef[2, 0]),
            "ops per step": float(coef[0, 1]),
            "ops per micro-batch": float(coef[1, 1]),
            "ops per block and micro-batch": float(coef[2, 1]),
        }
    return {"samples": samples, "fits": fits, "rows": rows}


class _OperatorTimes(TorchDispatchMode):
    """Each aten operator's wall time summed per operator (the dispatch included: a small operator's
    figure is inflated by this wrapper), and the matrix products' floating-point operations."""

    PRODUCTS = {"mm", "addmm", "addmm_", "bmm", "baddbmm", "baddbmm_", "mv", "addmv", "addmv_"}

    def __init__(self):
        super().__init__()
        self.ms: Dict[str, float] = defaultdict(float)
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        grouped = name == "_grouped_mm"  # an expert bank's products: each row of one operand meets one group's matrix
        product = name in self.PRODUCTS or grouped  # (one row: plain's weight gradients are mm, W's addmm_)
        self.ms["matrix products" if product else name] += 1000 * (time.perf_counter() - start)
        if grouped:  # 2 x (the first operand's elements) x (the second's last dimension), in each of its layouts
            self.flops += 2 * args[0].numel() * args[1].shape[-1]
        elif product:  # 2 x (output elements) x (the contracted length)
            contracted = [a for a in args if isinstance(a, torch.Tensor) and a.dim() >= 1][-1]
            length = contracted.shape[-2] if contracted.dim() >= 2 else contracted.shape[-1]
            self.flops += 2 * out.numel() * length
        return out


def _plain_and_dp(preset_name: str, grad_mode: str):
    """({"plain": step, "dp": step}, the trainer) on the preset's batch, each warmed up by two steps (the
    self-check's first step done)."""
    preset = PRESETS[preset_name]
    m, batch = preset.microbatches, preset.batch
    x, y = preset.make_batch(batch, 0)
    torch.manual_seed(0)
    steps = {"plain": S.plain(preset, len(x), microbatches=m).step}
    torch.manual_seed(0)
    trainer = _trainer(preset, m, grad_mode, 2, batch)
    steps["dp"] = lambda: trainer.step(x, y)
    for step in steps.values():
        step()
        step()
    return steps, trainer


def flop_bound(preset_name: str, grad_mode: str = "auto") -> Dict[str, float]:
    """Plain micro-batched training's matrix-product FLOPs per step over pipedp's on the preset (``grad_mode``, 2
    stages in one process, after two warm-up steps: the self-check's first step is not counted): the speed ratio
    a DP step would reach if its products ran at plain's rate and nothing else cost. Work both sides share
    (softmax, element-wise operations) lifts the real limit above it."""
    steps, trainer = _plain_and_dp(preset_name, grad_mode)
    flops = {}
    for name, step in steps.items():
        with _OperatorTimes() as counter:
            step()
        flops[name] = counter.flops
    trainer.close()
    return {"plain_flops": flops["plain"], "dp_flops": flops["dp"], "bound": flops["plain"] / flops["dp"]}


def by_operator(preset_name: str = "small", reps: int = 3) -> Dict:
    """Plain micro-batched training and pipedp's default step (grad_mode auto) on the preset: each aten
    operator's time (median over reps) on both sides, and both steps' matrix-product FLOPs, whose ratio
    bounds the DP / plain speed where DP's products ran at plain's rate and nothing else cost."""
    steps, trainer = _plain_and_dp(preset_name, "auto")
    times: Dict[str, Dict[str, List[float]]] = {name: defaultdict(list) for name in steps}
    flops: Dict[str, int] = {}
    for _ in range(reps):
        for name, step in steps.items():
            with _OperatorTimes() as timer:
                step()
            for op, ms in timer.ms.items():
                times[name][op].append(ms)
            flops[name] = timer.flops
    trainer.close()
    median = {name: {op: statistics.median(v) for op, v in t.items()} for name, t in times.items()}
    ops = sorted(
        set(median["plain"]) | set(median["dp"]), key=lambda op: -(median["dp"].get(op, 0) - median["plain"].get(op, 0))
    )
    rows = [(op, median["plain"].get(op, 0.0), median["dp"].get(op, 0.0)) for op in ops]
    return {
        "preset": preset_name,
        "rows": rows,
        "total ms": {name: sum(t.values()) for name, t in median.items()},
        "flops": flops,
    }


def measure(quick: bool = False) -> Dict:
    torch.set_num_threads(1)
    from pipedp import settle_process

    settle_process()
    if quick:
        return {
            "phases": phases("tiny", reps=1),
            "operators": by_operator("tiny", reps=1),
            "fixed": fixed_costs(layers=(1, 2), ms=(1, 2), reps=1, rounds=1),
        }
    return {"phases": phases("small"), "operators": by_operator("small"), "fixed": fixed_costs()}


def markdown(result: Dict) -> List[str]:
    ph, fx = result["phases"], result["fixed"]
    lines = [
        f"**Where the time goes** (`python -m bench.overhead`; one process, one thread, {ph['preset']} preset in 2 "
        f"stages run in turn, {ph['microbatches']} micro-batches of {ph['rows']} rows):",
        "",
        "| | step ms | F ms | I ms | W ms | rest (norm sum, noise, update) ms | aten ops per micro-batch (F / I / W) |",
        "|---|---|---|---|---|---|---|",
        f"| plain micro-batched training | {ph['plain ms']:.1f} | | | | | {ph['plain ops per micro-batch']:.0f} (forward + backward) |",
    ]
    for mode in ("ghost", "keep"):
        r = ph[mode]
        lines.append(
            f"| pipedp {mode} | {r['step ms']:.1f} | {r['forward ms']:.1f} | {r['backward_input ms']:.1f} | "
            f"{r['weight ms']:.1f} | {r['rest ms']:.1f} | {r['ops per micro-batch']:.0f} ({r['forward ops per micro-batch']:.0f} / "
            f"{r['backward_input ops per micro-batch']:.0f} / {r['weight ops per micro-batch']:.0f}) |"
        )
    lines += _operator_lines(result["operators"])
    lines += [
        "",
        f"Fixed costs (narrow GPT d=32, T=16, {fx['rows']}-row micro-batches, L blocks x m micro-batches, step time fitted "
        "as a + m (b + c L)):",
        "",
        "| | a: per step ms | b: per micro-batch ms | c: per block and micro-batch ms | aten ops: a / b / c |",
        "|---|---|---|---|---|",
    ]
    for name, f in fx["fits"].items():
        lines.append(
            f"| {name} | {f['per step ms']:.2f} | {f['per micro-batch ms']:.2f} | "
            f"{f['per block and micro-batch ms']:.3f} | {f['ops per step']:.0f} / {f['ops per micro-batch']:.0f} / "
            f"{f['ops per block and micro-batch']:.0f} |"
        )
    return lines


def _operator_lines(op: Dict, top: int = 14) -> List[str]:
    plain, dp = op["total ms"]["plain"], op["total ms"]["dp"]
    lines = [
        "",
        f"By operator ({op['preset']} preset, the same 2 stages in turn; plain training against pipedp's default, "
        "grad_mode auto; ms per step, median of the repetitions, each operator timed through a dispatch wrapper, "
        "which inflates the small ones), the largest differences first:",
        "",
        "| operator | plain ms | pipedp ms | pipedp - plain ms |",
        "|---|---|---|---|",
    ]
    for name, a, b in op["rows"][:top]:
        lines.append(f"| {name} | {a:.1f} | {b:.1f} | {b - a:+.1f} |")
    rest_a = sum(a for _, a, _ in op["rows"][top:])
    rest_b = sum(b for _, _, b in op["rows"][top:])
    lines.append(f"| the other {len(op['rows']) - top} | {rest_a:.1f} | {rest_b:.1f} | {rest_b - rest_a:+.1f} |")
    lines.append(f"| all operators | {plain:.1f} | {dp:.1f} | {dp - plain:+.1f} (plain / pipedp {plain / dp:.2f}) |")
    fp, fd = op["flops"]["plain"], op["flops"]["dp"]
    lines += [
        "",
        f"Matrix-product FLOPs per step: plain {fp / 1e9:.2f} G, pipedp {fd / 1e9:.2f} G (the ghost norms' Gram "
        f"matrices and W's products): at plain's FLOP rate, with nothing else costing, pipedp / plain could reach "
        f"at most **{fp / fd:.2f}x**.",
    ]
    return lines


def main(argv=None) -> Dict:
    p = argparse.ArgumentParser(prog="python -m bench.overhead", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    result = measure(args.quick)
    print("\n".join(markdown(result)))
    return result


if __name__ == "__main__":
    main()
