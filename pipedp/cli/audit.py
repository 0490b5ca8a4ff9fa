"""``pipedp audit``: run the one-run privacy audit (own processes, torchrun, or in-process) and
print its report; exit 0 when it passes, 4 when it shows a leak."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from typing import Optional

from ..audit.run import AuditConfig, AuditResult, audit_rank, run_audit
from ..config import PipelineConfig, PrivacyConfig
from ..runtime.launch import init_from_env, launch


def run(args) -> int:
    steps = args.steps or (10 if args.kind == "whitebox" else 100)
    sample_rate = args.sample_rate or (0.5 if args.kind == "whitebox" else 0.01)
    if not 0 < args.confidence < 1:
        raise ValueError(f"--confidence must be in (0, 1), got {args.confidence}")
    if not 0 < sample_rate <= 1:
        raise ValueError(f"--sample-rate must be in (0, 1], got {sample_rate}")
    config = AuditConfig(
        kind=args.kind,
        canaries=args.canaries,
        steps=steps,
        lr=args.lr,
        confidence=args.confidence,
        seed=args.seed,
        pipeline=PipelineConfig(stages=args.stages, microbatches=args.microbatches, transport="inprocess"),
        privacy=PrivacyConfig(
            sample_rate=sample_rate,
            noise_multiplier=args.noise_multiplier,
            max_grad_norm=args.max_grad_norm,
            delta=args.delta,
        ),
    )
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and not args.inprocess:
        init_from_env()
        raw = audit_rank(int(os.environ["RANK"]), replace(config, pipeline=replace(config.pipeline, transport="auto")))
        if raw is None:
            return 0
        result: Optional[AuditResult] = AuditResult.from_dict(raw)
    elif args.inprocess or args.stages == 1:
        result = run_audit(config)
    else:
        print(f"pipedp: launching {args.stages} processes for the audit (gloo)", flush=True)
        over_processes = replace(config, pipeline=replace(config.pipeline, transport="auto"))
        raw = launch(audit_rank, args.stages, (over_processes,), timeout_s=3600)[0]
        result = AuditResult.from_dict(raw)
    assert result is not None
    print(result.summary())
    print(f"({result.seconds:.1f}s)")
    if args.png:
        result.plot(args.png)
        print(f"score histograms drawn to {args.png}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result.to_dict(), f)
    return 0 if result.passed else 4
