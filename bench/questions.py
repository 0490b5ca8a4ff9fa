"""The questions users ask, each answered by ratios measured side by side in one run.

    python -m bench.questions dp-cost --preset small        # pipedp (DP) vs torch Schedule1F1B (no DP); and vs the naive split
    python -m bench.questions lora --preset realistic       # DP LoRA vs non-private LoRA on the same pipeline
    python -m bench.questions opacus --preset small         # pipedp on one stage vs Opacus ghost clipping, one process
    python -m bench.questions self-check --preset small     # first step with self_check=True vs False; steady step too
    python -m bench.questions dp-cost --preset tiny --rounds 2 --steps 1   # seconds (smoke test)

How: every contender of a question is built in the same processes (2 processes x 1 thread for the
pipelines, one process x 2 threads for the one-process question), warmed up, then timed in
``rounds`` rounds; in each round every contender runs ``steps`` steps (its median is the round's
time), the contenders' order rotating from round to round. A ratio is computed per round from the
two contenders' times in that round, so machine-wide slowdowns (this machine is shared) hit both
sides of it; the figure is the median over rounds, with the min and max as its spread. Where a
figure takes "the best pipedp", the best variant is the one with the lowest median time over the
rounds, and its per-round ratios are reported (not the per-round best, which would pick noise).
Peak memory per process (bench.memory.PeakMemory: above the state before the contender was built)
covers its build and warm-up steps. Each dp-cost figure also gets its FLOP ratio (bench.overhead.flop_bound:
plain training's matrix-product FLOPs per step over DP's, for the figure's grad mode) and the share of it
reached. It is the limit only where matrix products are the whole step: the work both sides share (attention's
softmax, element-wise operations, the pipeline's messages) lifts the real limit above it, so a figure can
exceed it (the realistic preset does).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
import warnings
from typing import Callable, Dict, List, Sequence

import torch.distributed as dist

from .memory import PeakMemory
from .presets import PRESETS, Preset
from .steps import barrier, interleave, timed

PIPEDP_VARIANTS = [("1f1b", "auto"), ("1f1b", "ghost"), ("dp-zb", "ghost"), ("1f1b", "keep"), ("dp-zb", "keep")]
GOALS = {"dp-cost": None, "naive": None, "lora": 1.0, "opacus": 1.5, "self-check-steady": 0.97}


def _gather(value):
    if not dist.is_initialized():
        return [value]
    out: List = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def build_all(makers: Sequence[Callable], warmup: int) -> tuple:
    """Build each contender and warm it up, measuring that phase's peak memory, then one more step's
    (the steady step's own peak, above the state it starts from); returns (contenders, peaks)."""
    contenders, peaks = [], {}
    for make in makers:
        barrier()
        with PeakMemory() as mem:
            c = make()
            for _ in range(warmup):
                barrier()
                c.step()
        barrier()
        with PeakMemory() as steady:
            c.step()
        contenders.append(c)
        peaks[c.name] = {"build+warmup": mem.peak_mib, "step": steady.peak_mib}
    return contenders, peaks


def _settle() -> None:
    from pipedp import settle_process

    warnings.filterwarnings("ignore")
    settle_process()  # as `pipedp train` does, for every contender alike


# ---- the questions, as functions run on every rank ----------------------------------------------------
def _pipeline_rank(rank: int, question: str, preset_name: str, rounds: int, steps: int, warmup: int, variants):
    from . import steps as S

    _settle()
    preset = PRESETS[preset_name]
    lora = question == "lora"
    makers: List[Callable] = [lambda: S.torch_pipeline(preset, lora=lora)]
    makers += [functools.partial(S.pipedp, preset, s, m, lora=lora) for s, m in variants]
    if question == "dp-cost" and preset.opacus:  # (the naive split runs Opacus's hooks on each part)
        makers.append(lambda: S.naive(preset))
    contenders, peaks = build_all(makers, warmup)
    times = interleave(contenders, rounds, steps)
    for c in contenders:
        c.close()
    return {"times": times, "peak_mib": _gather(peaks)}


def _one_process(rank: int, preset_name: str, rounds: int, steps: int, warmup: int, variants):
    from . import steps as S

    _settle()
    preset = PRESETS[preset_name]
    makers: List[Callable] = [lambda: S.opacus(preset), lambda: S.plain(preset)]
    makers += [
        functools.partial(S.pipedp, preset, "1f1b", m, name=f"pipedp-1stage-{m}", stages=1, microbatches=1)
        for m in variants
    ]
    contenders, peaks = build_all(makers, warmup)
    times = interleave(contenders, rounds, steps)
    for c in contenders:
        c.close()
    return {"times": times, "peak_mib": [peaks]}


def _self_check_rank(rank: int, preset_name: str, rounds: int, steps: int, lora: bool):
    """Per round, for self_check True and False in turn (order alternating): a new trainer on the same
    model, its first step timed (and its peak memory), one step untimed, then ``steps`` steady steps timed.
    A throwaway trainer first warms the process."""
    from . import steps as S

    _settle()
    preset = PRESETS[preset_name]
    stages = dist.get_world_size() if dist.is_initialized() else 1
    model = S.stage_model(preset, stages, rank, lora)
    x, y = preset.make_batch(preset.batch, 0)
    out: Dict[str, Dict[str, List[float]]] = {
        "first": {"on": [], "off": []},
        "steady": {"on": [], "off": []},
        "first_peak_mib": {"on": [], "off": []},
    }

    def run(check: bool, record: bool):
        trainer = S.pipedp_trainer(preset, self_check=check, model=model)
        barrier()
        with PeakMemory() as mem:  # the first step's peak above the state before it, this rank
            start = time.perf_counter()
            trainer.step(x, y)
            barrier()
            first = time.perf_counter() - start
        # the second step settles what the first left (freed memory, caches): not timed
        per = timed(lambda: trainer.step(x, y), 1, steps, barrier)
        trainer.close()
        if record:
            key = "on" if check else "off"
            out["first"][key].append(first)
            out["steady"][key].append(statistics.median(per))
            out["first_peak_mib"][key].append(mem.peak_mib)

    run(True, False)
    for r in range(rounds):
        order = (True, False) if r % 2 == 0 else (False, True)
        for check in order:
            run(check, True)
    out["first_peak_mib"] = _gather(out["first_peak_mib"])  # per rank
    return out


# ---- figures ---------------------------------------------------------------------------------------------
def figure(fid, question, preset, per_round, numerator, denominator, goal, command, note="", higher_is_better=True):
    """One figure: a ratio per round, its median and spread, and whether it meets its goal."""
    med = statistics.median(per_round)
    met = None if goal is None else (med >= goal if higher_is_better else med <= goal)
    return {
        "id": fid,
        "question": question,
        "preset": preset.name,
        "numerator": numerator,
        "denominator": denominator,
        "ratios": list(per_round),
        "median": med,
        "min": min(per_round),
        "max": max(per_round),
        "goal": goal,
        "higher_is_better": higher_is_better,
        "met": met,
        "command": command,
        "note": note,
    }


def speed_ratio(fid, question, preset, times, numerator, denominator, goal, command, note=""):
    """numerator's samples/s over denominator's, per round (the inverse ratio of their step times)."""
    per_round = [d / n for n, d in zip(times[numerator], times[denominator])]
    return figure(fid, question, preset, per_round, numerator, denominator, goal, command, note)


def best(times: Dict[str, List[float]], prefix: str) -> str:
    names = [n for n in times if n.startswith(prefix)]
    return min(names, key=lambda n: statistics.median(times[n]))


def _samples_per_s(preset: Preset, times: Dict[str, List[float]]) -> Dict[str, float]:
    return {n: preset.batch / statistics.median(t) for n, t in times.items()}


def ask(question: str, preset_name: str, rounds: int, steps: int, warmup: int, variants=None, threads: int = 2) -> Dict:
    """Run one question on one preset; returns {figures, rows, seconds, ...}."""
    from pipedp.runtime.launch import launch

    preset = PRESETS[preset_name]
    command = f"python -m bench.questions {question} --preset {preset_name} --rounds {rounds} --steps {steps}"
    start = time.perf_counter()
    figures: List[Dict] = []
    if question in ("dp-cost", "lora"):
        variants = variants or PIPEDP_VARIANTS
        got = launch(
            _pipeline_rank,
            2,
            (question, preset_name, rounds, steps, warmup, variants),
            timeout_s=3600,
            threads=1,
            op_timeout_s=1800,
        )[0]
        times, peaks = got["times"], got["peak_mib"]
        suffix = "-lora" if question == "lora" else ""
        top = best(times, "pipedp-")
        torch_name = "torch-1f1b" + suffix
        if question == "dp-cost":
            figures.append(
                speed_ratio(
                    f"dp-cost/{preset_name}",
                    "DP cost: best pipedp (DP) / torch Schedule1F1B (no DP), samples/s",
                    preset,
                    times,
                    top,
                    torch_name,
                    None,
                    command,
                    "2 processes x 1 thread",
                )
            )
        if question == "dp-cost" and preset.opacus:
            figures.append(
                speed_ratio(
                    f"naive/{preset_name}",
                    "pipeline vs naive split (device_map + Opacus hooks per part), equal devices",
                    preset,
                    times,
                    top,
                    "naive-split",
                    None,
                    command,
                    "2 processes x 1 thread",
                )
            )
        if question == "lora":
            figures.append(
                speed_ratio(
                    f"lora/{preset_name}",
                    "DP LoRA (best pipedp) / non-private LoRA (torch Schedule1F1B), samples/s",
                    preset,
                    times,
                    top,
                    torch_name,
                    GOALS["lora"],
                    command,
                    "LoRA r=8 on "
                    + "/".join(preset.lora_targets + preset.lora_parameters)
                    + ", 2 processes x 1 thread",
                )
            )
        for name in times:  # every variant against torch, for the table
            if name.startswith("pipedp-") and name != top:
                f = speed_ratio(f"{question}/{preset_name}/{name}", "", preset, times, name, torch_name, None, command)
                figures.append(dict(f, detail=True))
        if question == "dp-cost":  # beside each figure: its FLOP ratio, and how much of it the figure reaches
            from .overhead import flop_bound

            limits: Dict[str, float] = {}
            for fig in figures:
                if fig["id"].startswith("dp-cost/"):
                    mode = fig["numerator"].rsplit("-", 1)[-1]  # pipedp-SCHEDULE-GRADMODE
                    if mode not in limits:
                        limits[mode] = flop_bound(preset_name, mode)["bound"]
                    fig.update(flop_bound=limits[mode], of_bound=fig["median"] / limits[mode])
    elif question == "opacus":
        variants = variants or ["ghost", "keep"]
        got = launch(_one_process, 1, (preset_name, rounds, steps, warmup, variants), timeout_s=3600, threads=threads)[
            0
        ]
        tag = "" if threads == 2 else f"-{threads}thread"
        command += "" if threads == 2 else f" --threads {threads}"
        times, peaks = got["times"], got["peak_mib"]
        top = best(times, "pipedp-")
        figures.append(
            speed_ratio(
                f"opacus{tag}/{preset_name}",
                "pipedp on one stage (best grad mode, 1 micro-batch) / Opacus ghost clipping, one process",
                preset,
                times,
                top,
                "opacus-ghost",
                GOALS["opacus"],
                command,
                f"1 process x {threads} thread(s)",
            )
        )
        f = speed_ratio(f"opacus{tag}/{preset_name}/plain", "", preset, times, top, "plain", None, command)
        figures.append(dict(f, detail=True))
    elif question == "self-check":
        lora = preset.build_meta is not None  # the large presets as they are fine-tuned (full: see bench.scale)
        got = launch(
            _self_check_rank, 2, (preset_name, rounds, steps, lora), timeout_s=3600, threads=1, op_timeout_s=1800
        )[0]
        first, steady = got["first"], got["steady"]
        times = {
            "first step, self_check=True": first["on"],
            "first step, self_check=False": first["off"],
            "steady step, self_check=True": steady["on"],
            "steady step, self_check=False": steady["off"],
        }
        peaks = []
        on_mib = " / ".join(f"{statistics.median(r['on']):.0f}" for r in got["first_peak_mib"])
        off_mib = " / ".join(f"{statistics.median(r['off']):.0f}" for r in got["first_peak_mib"])
        extra = [(a - b) / s for a, b, s in zip(first["on"], first["off"], steady["off"])]
        slow = [a / b for a, b in zip(first["on"], first["off"])]
        fig = figure(
            f"self-check/{preset_name}",
            "self-check's cost at the first step: first-step time, self_check=True / False",
            preset,
            slow,
            "first step, self_check=True",
            "first step, self_check=False",
            None,
            command,
            "2 processes x 1 thread, pipedp 1f1b ghost" + (", LoRA" if lora else "") + ", a new trainer per "
            "measurement; the extra time is "
            f"{statistics.median(extra):.2f} steady steps (median); first-step peak memory above the state before "
            f"it, MiB per rank: {on_mib} with the check, {off_mib} without",
            higher_is_better=False,
        )
        figures.append(dict(fig, kind="time ratio", extra_steady_steps=statistics.median(extra)))
        figures.append(
            speed_ratio(
                f"self-check-steady/{preset_name}",
                "steady-state step unaffected: samples/s with self_check=True / False",
                preset,
                times,
                "steady step, self_check=True",
                "steady step, self_check=False",
                GOALS["self-check-steady"],
                command,
                "2 processes x 1 thread, pipedp 1f1b ghost" + (", LoRA" if lora else ""),
            )
        )
    else:
        raise SystemExit(f"unknown question {question!r}")
    return {
        "question": question,
        "preset": preset_name,
        "note": preset.note,
        "rounds": rounds,
        "steps": steps,
        "times": times,
        "samples_per_s": _samples_per_s(preset, times),
        "peak_mib": peaks,
        "figures": figures,
        "seconds": time.perf_counter() - start,
        "command": command,
    }


def describe(fig: Dict) -> str:
    spread = f"{fig['min']:.2f}-{fig['max']:.2f}"
    goal = "-" if fig["goal"] is None else f">= {fig['goal']:.2f} " + ("met" if fig["met"] else "**missed**")
    bound = ""
    if fig.get("flop_bound") is not None:  # (dp-cost) plain's matrix-product FLOPs over DP's, and the share reached
        bound = f", FLOP ratio {fig['flop_bound']:.2f}x: {fig['of_bound']:.2f} of it"
    return f"{fig['median']:.2f}x ({spread} over {len(fig['ratios'])} rounds){bound}, goal {goal}"


def main(argv=None) -> Dict:
    p = argparse.ArgumentParser(prog="python -m bench.questions", description=__doc__.splitlines()[0])
    p.add_argument("question", choices=["dp-cost", "lora", "opacus", "self-check"])
    p.add_argument("--preset", default="small", choices=sorted(PRESETS))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=3, help="timed steps per contender and round (their median)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=2, help="opacus: the one process's threads")
    p.add_argument("--json", default=None, help="write the result here")
    args = p.parse_args(argv)
    result = ask(args.question, args.preset, args.rounds, args.steps, args.warmup, threads=args.threads)
    for fig in result["figures"]:
        print(f"{fig['id']}: {fig['numerator']} / {fig['denominator']}: {describe(fig)}")
    for name, qps in result["samples_per_s"].items():
        print(f"  {name}: {qps:.2f} samples/s (median over rounds)")
    print(f"  ({result['seconds']:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
