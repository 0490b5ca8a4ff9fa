"""``pipedp plan``: its flags and ``run``, which prints the plan of pipedp.planner (each stage's predicted peak
memory, and the largest micro-batch size that fits). Parsing imports no torch."""

from __future__ import annotations

import argparse
import json
import math
import re

from ..config import PipelineConfig
from .flags import add_config_flags, config_from_args
from .options import JobConfig, OptimizerConfig, positive_int

PLAN_SKIP = ("microbatch_size", "timeout", "transport", "device")  # (timeout, transport: no flags)
OPTIMIZER_FLAGS = ("optimizer", "momentum", "weight_decay")
JOB_FLAGS = ("lora_r", "lora_targets")


_UNITS = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}


def parse_bytes(text: str) -> int:
    """'80GB' / '80G' (10^9 bytes), '80GiB' (2^30), '1.5TB', '24000000000' -> bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:E[0-9]+)?)\s*([KMGT]I?)?B?\s*", text.upper())
    value = float(match.group(1)) * _UNITS[match.group(2) or ""] if match else 0.0
    if not (value >= 1 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"cannot read {text!r} as a memory size: use e.g. 80GB, 80GiB or 24000000000")
    return int(value)


def add_plan_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", required=True, help="a local Hugging Face model folder (config.json is enough), or tiny-gpt"
    )
    p.add_argument("--microbatch-size", type=positive_int, required=True, help="rows per micro-batch (B)")
    p.add_argument("--seq-len", type=positive_int, required=True, help="tokens per row (T)")
    add_config_flags(p, (JobConfig,), skip=[f for f in JobConfig.__dataclass_fields__ if f not in JOB_FLAGS])
    p.add_argument(
        "--device-memory",
        type=parse_bytes,
        default=None,
        help="memory per stage (e.g. 80GB, 80GiB): also search the largest micro-batch size that fits on every stage",
    )
    p.add_argument("--json", default=None, help="also write the whole plan here")
    p.add_argument("--seed", type=int, default=0, help="LoRA's initialisation seed (as pipedp train's --seed)")
    pipeline = p.add_argument_group("pipeline options (as pipedp train's)")
    add_config_flags(p, (PipelineConfig,), skip=PLAN_SKIP, groups={PipelineConfig: pipeline})
    optim = p.add_argument_group("optimizer options (as pipedp train's)")
    skip = [f for f in OptimizerConfig.__dataclass_fields__ if f not in OPTIMIZER_FLAGS]
    add_config_flags(p, (OptimizerConfig,), skip=skip, groups={OptimizerConfig: optim})


def run(args) -> int:
    # here, not at the top: parsing the flags imports no torch (pipedp --help stays fast)
    from ..planner import estimate, format_plan

    pipeline = config_from_args(PipelineConfig, args).validate()
    optim = config_from_args(OptimizerConfig, args).validate()
    plan = estimate(
        args.model,
        pipeline.stages,
        args.microbatch_size,
        args.seq_len,
        lora_r=args.lora_r,
        lora_targets=tuple(t.strip() for t in args.lora_targets.split(",") if t.strip()),
        pipeline=pipeline,
        optimizer=optim.optimizer,
        momentum=optim.momentum,
        weight_decay=optim.weight_decay,
        device_memory=args.device_memory,
        seed=args.seed,
    )
    print(format_plan(plan))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(plan.as_dict(), f, indent=1)
    return 0
