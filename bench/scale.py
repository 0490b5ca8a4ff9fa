"""The scale benchmark: a real model's configuration, random weights in a sharded safetensors folder,
DP fine-tuning with each rank loading only its stage; peak memory per rank against what the stage
must hold, a checkpoint save included, and the step time.

    python -m bench.scale write llama-2-7b /tmp/l2 --layers 2     # a 2-layer slice (1.3 GB)
    python -m bench.scale run /tmp/l2 --mode lora --stages 2        # LoRA r=8 on q/v, bf16 base
    python -m bench.scale run /tmp/l2 --mode full --stages 2        # full fine-tuning, bf16
    python -m bench.scale suite                                     # PLAN: the slices of every config (~30 min)
    python -m bench.scale suite --configs llama-2-7b --modes lora --full-depth   # the whole 7B (13.5 GB folder)

Three jobs, three modules: ``write`` (bench/scale_folder.py: the folder, a shard at a time), ``run``
(bench/scale_run.py: one run's processes, what each rank holds phase by phase, the non-private baseline) and
``suite`` (here): each folder written, run, deleted; a run that ``pipedp plan``'s estimate (``need_gib``: the
planner's stage peaks and each process's libraries; the suite's margin covers what loading holds for a moment)
says does not fit this machine's free memory is skipped and listed; a section added to bench/RESULTS.md
(measuring a snapshot of HEAD: bench/snapshot.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from typing import Dict, List, Sequence

from .scale_folder import CONFIGS, SHARD_BYTES, hf_config, write_folder
from .scale_run import breakdown, markdown_rows, run, summary_row


def _free_gib() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    return 0.0


# (config, layers or None for every layer, mode, stages, self_check[, activation checkpointing]): the default suite. Full fine-tuning of
# the Llama-3-8B slice is left out: its 128k-token embedding and head alone are 1.05B parameters (the planner puts its
# stages at 9.0 and 5.0 GiB on 2 stages, not yet measured here; need_gib skips it where it does not fit).
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


PROCESS_GIB = 0.6  # per process: the interpreter, torch and transformers (a rank's base RSS: ~0.4 GiB measured)


def need_gib(folder: str, mode: str, stages: int, batch: int, microbatches: int, seq: int, **options) -> float:
    """What a run needs, all ranks together: each stage's peak as ``pipedp plan`` estimates it for the folder,
    configured as bench/scale_run.py configures the run (``options``: PipelineConfig fields such as self_check,
    activation_checkpointing, balance), and PROCESS_GIB per process."""
    from pipedp import PipelineConfig
    from pipedp.planner import estimate

    precision = "bf16-mixed" if mode == "lora" else "bf16-true"
    settings = dict(microbatches=microbatches, precision=precision, schedule="1f1b", grad_mode="ghost")  # run()'s
    pipeline = PipelineConfig(**{**settings, **options})
    plan = estimate(folder, stages, batch // microbatches, seq, lora_r=8 if mode == "lora" else None, pipeline=pipeline)
    return sum(s.total for s in plan.stages) / 2**30 + PROCESS_GIB * stages


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
    """Each (config, layers) folder written once, its runs done, the folder deleted; a run whose planned
    memory (``need_gib``) is above what is available (less ``margin_gib``) is skipped, and listed as skipped."""
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
        try:
            for mode, stages, check, recompute in runs:
                label = f"{name} ({w['layers']} layers) {mode}, {stages} stages, self_check={check}"
                label += ", activation checkpointing" if recompute else ""
                options = dict(self_check=check, activation_checkpointing=recompute, balance=balance)
                need = need_gib(folder, mode, stages, batch, microbatches, seq, **options)
                free = _free_gib()
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
