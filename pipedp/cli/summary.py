"""What ``pipedp train`` says at the start (the resolved job) and at the end (the summary, summary.json and
the loss / epsilon plot)."""

from __future__ import annotations

import json
import math
import os
from typing import Optional

from ..privacy.accounting import adjacency
from .monitor import Monitor, rate_text
from .preflight import WEAK_EPSILON
from .record import CONFIG_TOML, METRICS, PLOT, SUMMARY
from .spec import Job


def describe_job(job: Job) -> str:
    p, q, d, o, f = job.pipeline, job.privacy, job.data, job.optim, job.fit
    sampling = q.sampling or "poisson"
    if o.lr_schedule == "constant" and not o.warmup(job.steps):
        schedule = "constant"
    else:
        schedule = f"{o.lr_schedule}, {o.warmup(job.steps)} warmup steps"
    decay = f"weight decay {o.weight_decay:g}" + (
        f" (not on {', '.join(o.no_decay_kinds())})" if o.weight_decay and o.no_decay_kinds() else ""
    )
    unit = "record" if d.privacy_unit == "record" else f"user ({d.user_field}, {job.privacy.unit_rows} rows each)"
    checkpoints = (
        f"checkpoints every {f.checkpoint_every} steps, keep {f.keep_last}" if f.checkpoint_dir else "no checkpoints"
    )
    return "\n".join(
        [
            f"model: {job.model.name} ({job.model.blocks} blocks"
            + (f", LoRA r={job.lora_r} on {','.join(job.lora_targets)}" if job.lora_r else "")
            + f") | {p.stages} stages x {p.replicas} replica(s)"
            + (f" x {p.tensor_parallel} tensor-parallel" if p.tensor_parallel > 1 else "")
            + f", {p.schedule}, {p.microbatches} micro-batches, "
            f"grad mode {p.grad_mode}, precision {p.precision}",
            _privacy_line(job, unit, sampling),
            f"optimizer: {o.optimizer}, lr {o.lr:g} ({schedule}), {decay}",
            f"run folder: {job.run_dir} ({CONFIG_TOML}, {METRICS}, ...); {checkpoints}",
        ]
    )


def _privacy_line(job: Job, unit: str, sampling: str) -> str:
    q, d = job.privacy, job.data
    if not q.enabled:
        return (
            f"privacy: NONE (--disable-dp: no clipping, no noise, epsilon ∞, not differentially private) | unit "
            f"{unit}, N = {q.dataset_size}, {sampling} sampling at rate {q.sample_rate:.4g} (expected batch "
            f"{q.expected_batch_size}), {job.steps} steps"
        )
    return (
        f"privacy: unit {unit}, N = {q.dataset_size}, {sampling} sampling at rate {q.sample_rate:.4g} (expected "
        f"batch {q.expected_batch_size}), noise multiplier {q.noise_multiplier:.4g}, max grad norm "
        f"{q.max_grad_norm} ({q.clipping}), {q.accountant} accountant, delta {q.delta:g}, {job.steps} steps"
        + (f", budget {q.max_epsilon:g}" if q.max_epsilon is not None else "")
        + f" ({adjacency(q.sampling, d.privacy_unit)})"
    )


def plot(job: Job, monitor: Monitor) -> Optional[str]:
    """RUN/training.png: loss (and evaluation loss) and epsilon against steps; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    h = monitor.history
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    steps = [s for s, v in zip(h["step"], h["loss"]) if v is not None]
    left.plot(steps, [v for v in h["loss"] if v is not None], lw=0.8, label="training loss (per step)")
    if h["eval"]:
        left.plot([s for s, _ in h["eval"]], [v for _, v in h["eval"]], "o-", label="eval loss")
    left.set_xlabel("step")
    left.set_ylabel("loss")
    left.legend()
    right.plot(h["eps_step"], h["epsilon"], "o-", ms=3)
    right.set_xlabel("step")
    right.set_ylabel(
        f"epsilon at delta {job.privacy.delta:g}\n({adjacency(job.privacy.sampling, job.data.privacy_unit)})"
    )
    fig.tight_layout()
    path = os.path.join(job.run_dir, PLOT)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def final_warnings(job: Job, epsilon: Optional[float]) -> list:
    """The privacy warnings said before the run, the epsilon one replaced by the epsilon actually spent."""
    out = [w for w in job.privacy_warnings if not w.startswith("the run will end at epsilon")]
    if job.privacy.enabled and epsilon is not None and epsilon > WEAK_EPSILON:
        out.append(f"epsilon {epsilon:.3g} is above {WEAK_EPSILON:g}: a weak guarantee (see docs/privacy.md)")
    return out


def _epsilon_said(job: Job, epsilon: float) -> str:
    privacy = job.privacy
    if not privacy.enabled:
        return "epsilon ∞: not differentially private (--disable-dp: no clipping, no noise; a baseline only)"
    return (
        f"epsilon {epsilon:.3f} at delta {privacy.delta:g} ({adjacency(privacy.sampling, job.data.privacy_unit)}; "
        f"noise multiplier {privacy.noise_multiplier:.3f}, sample rate {privacy.sample_rate:.4f}, {privacy.accountant})"
    )


def summarise(job: Job, trainer, result, monitor: Monitor, lead: bool) -> dict:
    privacy = job.privacy
    summary = {
        "steps": result.steps,
        "private": privacy.enabled,
        "epsilon": result.epsilon,
        "delta": privacy.delta,
        "loss": result.loss,
        "first_loss": monitor.first_loss,
        "seconds": monitor.train_s,
        "samples_per_s": monitor.samples / max(monitor.train_s, 1e-9),
        "noise_multiplier": privacy.noise_multiplier,
        "sample_rate": privacy.sample_rate,
        "units": privacy.dataset_size,
        "stopped_by_budget": result.stopped_by_budget,
        "truncation_delta": result.truncation_delta,
        "first_nonfinite_step": monitor.first_nonfinite,
        "eval_loss": monitor.last_eval["eval_loss"] if monitor.last_eval else None,
        "eval_perplexity": monitor.last_eval["eval_perplexity"] if monitor.last_eval else None,
        "warnings": final_warnings(job, result.epsilon),
    }
    if not lead:
        return summary
    with open(os.path.join(job.run_dir, SUMMARY), "w") as f:
        json.dump({k: (v if not isinstance(v, float) or math.isfinite(v) else None) for k, v in summary.items()}, f)
    drawn = plot(job, monitor)
    first = summary["first_loss"] if summary["first_loss"] is not None else float("nan")
    lines = [
        f"done: {result.steps} steps in {monitor.train_s:.1f}s, {rate_text(summary['samples_per_s'])} samples/s | "
        f"loss {first:.3f} -> {result.loss:.3f} | {_epsilon_said(job, result.epsilon)}"
    ]
    if monitor.last_eval:
        lines.append(
            f"eval: loss {monitor.last_eval['eval_loss']:.4f}, perplexity {monitor.last_eval['eval_perplexity']:.4g} "
            f"on {monitor.last_eval['eval_rows']} rows (not differentially private unless those records are public)"
        )
    if job.fit.checkpoint_dir:
        lines.append(f"checkpoint: {job.fit.checkpoint_dir}")
    lines.append(
        f"record: {os.path.join(job.run_dir, METRICS)}, {os.path.join(job.run_dir, SUMMARY)}, "
        + (drawn if drawn else "no plot (pip install matplotlib)")
    )
    for line in final_warnings(job, result.epsilon):
        lines.append(f"warning: {line}")
    if result.stopped_by_budget:
        lines.append(f"stopped: {result.stopped_by_budget}")
    if monitor.first_nonfinite is not None:
        lines.append(f"non-finite losses from step {monitor.first_nonfinite} on (NaN/inf in the data or the model)")
    print("\n".join(lines), flush=True)
    return summary
