"""Regenerate every figure: the questions of bench.questions on their presets, the overhead profile,
a plot of every ratio, all written to bench/RESULTS.md (newest first) and bench/figures/.

    python -m bench.run_all              # every figure (~30 min on 2 CPU cores)
    python -m bench.run_all --quick      # the same path on the smoke-test presets (about a minute and a half)
    python -m bench.run_all --only dp-cost,self-check

Each figure is a ratio measured side by side in one run (see bench.questions), listed with the
command that reproduces it alone; the section carries the date, the machine and the git commit (and
whether the tree had uncommitted changes to the measured code).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from typing import Dict, List, Optional

from . import questions, snapshot

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "RESULTS.md")
FIGURES = os.path.join(ROOT, "bench", "figures")
HEADER = "# Benchmark results\n"
INTRO = """
Every figure here is a ratio of two contenders measured side by side in one run, repeated in
rounds (see `bench/questions.py`): the median over rounds, then the min-max over rounds as its
spread. Sections are newest first; each names its date, machine, git commit and the command that
regenerates it (`python -m bench.run_all` for the harness, `python -m bench.scale` for the scale
runs). Goals are the issues' (#21, #25, #26); a figure that misses its goal says so.
"""

# (question, preset, rounds, steps per round, warm-up steps, pipedp variants or None for the default[, threads])
PLAN = [
    ("dp-cost", "small", 5, 3, 2, None),
    ("dp-cost", "realistic", 4, 1, 1, None),
    ("dp-cost", "mixtral-slice", 3, 1, 1, None),
    ("lora", "realistic", 4, 1, 1, None),
    ("lora", "llama-slice", 3, 1, 1, [("1f1b", "ghost"), ("dp-zb", "ghost"), ("1f1b", "keep")]),
    ("opacus", "small", 5, 3, 2, None),
    ("opacus", "small", 5, 3, 2, None, 1),  # one thread: less exposed to other jobs on a shared machine
    ("opacus", "realistic", 4, 1, 1, None),
    ("self-check", "small", 5, 3, 0, None),
    ("self-check", "realistic", 3, 2, 0, None),
    ("self-check", "llama-slice", 3, 2, 0, None),
]
QUICK_PLAN = [
    ("dp-cost", "tiny", 2, 1, 1, None),
    ("lora", "tiny-llama", 2, 1, 1, [("1f1b", "ghost")]),
    ("opacus", "tiny", 2, 1, 1, None),
    ("self-check", "tiny", 2, 1, 0, None),
]


def machine() -> Dict[str, str]:
    import torch

    mem = "?"
    try:
        with open("/proc/meminfo") as f:
            mem = f"{int(f.readline().split()[1]) / 2**20:.0f} GiB"
    except OSError:
        pass
    model = platform.machine()
    try:  # the CPU's name: bf16 speed differs 100x between CPUs with and without AVX-512 / AMX
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    capability = torch.backends.cpu.get_cpu_capability()
    return {
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "machine": f"{model} ({capability}), {os.cpu_count()} cores, {mem} RAM, torch {torch.__version__}",
        "commit": snapshot.commit(),
        "dirty": snapshot.uncommitted(),
        "load": " / ".join(f"{v:.1f}" for v in os.getloadavg()),
    }


def command_line(module: str, argv) -> str:
    """The command as the user typed it (inside a snapshot, the one that started it)."""
    given = os.environ.get("PIPEDP_BENCH_COMMAND")
    if given:
        return given
    return f"python -m {module} " + " ".join(sys.argv[1:] if argv is None else argv)


def in_snapshot(module: str, argv, tree: str, results: str, figures: str) -> bool:
    """With --tree head (the default) and not yet in a snapshot: run again there; True when that ran."""
    if tree != "head" or snapshot.inside():
        return False
    os.environ["PIPEDP_BENCH_COMMAND"] = command_line(module, argv).strip()
    rest = list(sys.argv[1:] if argv is None else argv)
    code = snapshot.rerun_in_snapshot(
        module, rest + ["--results", os.path.abspath(results), "--figures", os.path.abspath(figures)]
    )
    if code:
        raise SystemExit(code)
    return True


def figures_table(figs: List[Dict]) -> List[str]:
    lines = [
        "| figure | ratio | median | spread (min-max, rounds) | FLOP ratio: share reached | goal | command |",
        "|---|---|---|---|---|---|---|",
    ]
    for f in figs:
        if f.get("detail"):
            continue
        if f["goal"] is None:
            goal = "-"
        else:
            sign = ">=" if f.get("higher_is_better", True) else "<="
            goal = f"{sign} {f['goal']:.2f}: " + ("met" if f["met"] else "**missed**")
        bound = f"{f['flop_bound']:.2f}x: {f['of_bound']:.2f}" if f.get("flop_bound") is not None else "-"
        lines.append(
            f"| {f['id']} | {f['numerator']} / {f['denominator']} | **{f['median']:.2f}** | "
            f"{f['min']:.2f}-{f['max']:.2f} ({len(f['ratios'])}) | {bound} | {goal} | `{f['command']}` |"
        )
    return lines


def details(result: Dict) -> List[str]:
    """Per question and preset: each contender's samples/s and peak memory, and every variant's ratio."""
    lines = [f"**{result['question']} / {result['preset']}** ({result['note']}; {result['seconds']:.0f} s)", ""]
    peaks = result.get("peak_mib") or []
    lines.append("| contender | samples/s (median) | peak MiB per process: build + warm-up / one step |")
    lines.append("|---|---|---|")
    for name, qps in result["samples_per_s"].items():
        mem = " ; ".join(
            f"{p[name]['build+warmup']:.0f} / {p[name]['step']:.0f}" for p in peaks if isinstance(p, dict) and name in p
        )
        lines.append(f"| {name} | {qps:.2f} | {mem or '-'} |")
    extra = [f for f in result["figures"] if f.get("detail")]
    if extra:
        lines += ["", "| variant | ratio | median | spread |", "|---|---|---|---|"]
        for f in extra:
            lines.append(
                f"| {f['id']} | {f['numerator']} / {f['denominator']} | {f['median']:.2f} | {f['min']:.2f}-{f['max']:.2f} |"
            )
    return lines + [""]


def plot(figs: List[Dict], path: str, title: str) -> Optional[str]:
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    heads = [f for f in figs if not f.get("detail")]
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(heads) + 1.5))
    ys = list(range(len(heads)))[::-1]
    for y, f in zip(ys, heads):
        color = "grey" if f["met"] is None else ("tab:green" if f["met"] else "tab:red")
        ax.barh(y, f["median"], color=color, alpha=0.7)
        ax.errorbar(f["median"], y, xerr=[[f["median"] - f["min"]], [f["max"] - f["median"]]], color="black", capsize=3)
        if f["goal"] is not None:
            ax.plot([f["goal"], f["goal"]], [y - 0.4, y + 0.4], color="black", linestyle="--")
    ax.axvline(1.0, color="grey", linewidth=0.8)
    ax.set_yticks(ys, [f["id"] for f in heads], fontsize=8)
    ax.set_xlabel("ratio (median over rounds; bars: min-max; dashed: goal; green met, red missed)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def record(section: str, path: str = RESULTS) -> None:
    """Insert ``section`` at the top of RESULTS.md (after its header and intro): newest first."""
    old = open(path).read() if os.path.exists(path) else HEADER + INTRO
    if not old.startswith(HEADER):
        old = HEADER + INTRO + "\n" + old
    cut = old.find("\n## ")
    head, rest = (old, "") if cut < 0 else (old[: cut + 1], old[cut + 1 :])
    with open(path, "w") as f:
        f.write(head.rstrip("\n") + "\n\n" + section.rstrip("\n") + "\n\n" + rest)


def main(argv=None) -> Dict:
    p = argparse.ArgumentParser(prog="python -m bench.run_all", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smoke-test presets, 2 rounds of 1 step")
    p.add_argument("--only", default=None, help="comma-separated questions (dp-cost, lora, opacus, self-check)")
    p.add_argument("--no-profile", action="store_true", help="skip the overhead profile (bench.overhead)")
    p.add_argument("--results", default=RESULTS, help="the markdown file to add the section to")
    p.add_argument("--figures", default=FIGURES, help="folder for the JSON and the PNG")
    p.add_argument(
        "--tree",
        choices=["head", "work"],
        default="head",
        help="head: measure the committed code (a snapshot of HEAD, see bench/snapshot.py); work: the working tree",
    )
    args = p.parse_args(argv)
    if in_snapshot("bench.run_all", argv, args.tree, args.results, args.figures):
        return {}
    plan = QUICK_PLAN if args.quick else PLAN
    if args.only:
        wanted = set(args.only.split(","))
        plan = [item for item in plan if item[0] in wanted]
    info = machine()
    start = time.perf_counter()
    results = []
    for question, preset, rounds, steps, warmup, variants, *threads in plan:
        print(f"[{time.perf_counter() - start:6.0f} s] {question} / {preset} ...", flush=True)
        r = questions.ask(question, preset, rounds, steps, warmup, variants, *threads)  # type: ignore[arg-type]
        for fig in r["figures"]:
            if not fig.get("detail"):
                print(f"    {fig['id']}: {questions.describe(fig)}", flush=True)
        results.append(r)
    profile = None
    if not args.no_profile:
        from . import overhead

        print(f"[{time.perf_counter() - start:6.0f} s] overhead profile ...", flush=True)
        profile = overhead.measure(quick=args.quick)
    figs = [f for r in results for f in r["figures"]]
    os.makedirs(args.figures, exist_ok=True)
    stem = "quick" if args.quick else "harness"
    with open(os.path.join(args.figures, f"{stem}.json"), "w") as f:
        json.dump({"info": info, "results": results, "profile": profile}, f, indent=1)
    command = command_line("bench.run_all", argv)
    png = plot(figs, os.path.join(args.figures, f"{stem}.png"), f"{info['date']}, {info['commit']}: {command}")
    total = time.perf_counter() - start
    lines = [
        f"## {info['date']} — harness{' (quick: smoke-test sizes, not results)' if args.quick else ''}",
        "",
        f"`{command.strip()}` ({total / 60:.0f} min); {info['machine']}; commit `{info['commit']}`"
        + (
            " (measured on a snapshot of it)"
            if snapshot.inside()
            else f" (the working tree: {info['dirty'] or 'clean'})"
        )
        + f"; load average at the start {info['load']} (the machine is shared).",
        "",
    ]
    lines += figures_table(figs)
    notes = [f"- {f['id']}: {f['note']}" for f in figs if f.get("note") and not f.get("detail")]
    if notes:
        lines += [""] + notes
    if png:
        lines += ["", f"Plot: `{os.path.relpath(png, os.path.dirname(args.results))}`."]
    lines += ["", "<details><summary>per contender</summary>", ""]
    for r in results:
        lines += details(r)
    lines += ["</details>", ""]
    if profile is not None:
        lines += overhead.markdown(profile) + [""]
    record("\n".join(lines), args.results)
    print(f"\nwrote {args.results} and {args.figures}/{stem}.json" + (f", {png}" if png else ""))
    return {"info": info, "results": results, "profile": profile}


if __name__ == "__main__":
    main()
