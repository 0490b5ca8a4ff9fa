"""``pipedp train``: resolve the job once (preflight), record it, then run it on every rank (own processes,
torchrun, or this process).

A rank's work, one module each: ``build`` (the model, LoRA, the optimizer and its schedule),
``dataset`` (the rank's rows), ``monitor`` (the per-step callback: progress, metrics log, evaluation),
``export`` (the Hugging Face folder), ``summary`` (the last report and the plot).

The training stack is imported inside the functions that use it: ``pipedp train`` imports this module
before its flags are checked, and a flag error answers before torch loads.
"""

from __future__ import annotations

import math
import os
from dataclasses import replace
from typing import Optional

from ..errors import PipeDPError
from .spec import Job, Model  # noqa: F401 (the job's parts, re-exported)


def train_rank(rank: int, job: Job) -> dict:
    """One rank's run: build, train with the monitor's callback, export, summarise."""
    import warnings

    import torch

    from ..runtime.process import settle_process
    from .build import build_trainer, resume
    from .dataset import rank_data
    from .export import export
    from .monitor import Monitor
    from .signals import raising
    from .summary import summarise

    with raising():  # SIGTERM / SIGINT unwind through fit's finally: the folder's lock is released
        torch.set_num_threads(job.threads)
        lead = rank == 0
        if not lead:
            warnings.filterwarnings("ignore")
        data = rank_data(job)
        trainer = build_trainer(job, rank)
        if lead:
            print(f"partition: {trainer.partition_report}", flush=True)
        if job.resume and job.fit.checkpoint_dir:
            resume(trainer, job, lead)
            if trainer.steps_taken >= job.steps:  # a finished run: no step, no export, no new record
                if lead:
                    print(
                        f"nothing to do: the run already took its {trainer.steps_taken} steps (raise --steps to "
                        "train on)",
                        flush=True,
                    )
                return {"loss": None, "first_loss": None}
        monitor = Monitor(job, trainer, data, lead)
        settle_process()  # the built objects out of full collections; freed memory kept for reuse (see README)
        try:
            monitor.begin()
            result = trainer.fit(data.train, job.fit, callback=monitor.on_step)
            monitor.finish(result)
        finally:
            monitor.close()
        if job.export or job.export_merged:
            export(trainer, job, lead)
        return summarise(job, trainer, result, monitor, lead)


def run(args, defaults: Optional[dict] = None) -> int:
    """``defaults``: the flags' defaults (config.toml keeps only the flags set away from them; None: all)."""
    from contextlib import ExitStack

    with ExitStack() as hold:  # the run folder's lock: taken before anything is written there, held to the end
        return _run(args, defaults, hold)


def _run(args, defaults: Optional[dict], hold) -> int:
    from .preflight import flags_of, resolve
    from .record import RunFolder

    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ and not args.inprocess
    lead = not under_torchrun or os.environ["RANK"] == "0"  # under torchrun every rank resolves; rank 0 speaks
    if under_torchrun:  # from the start: the preflight takes the folder's lock on rank 0
        from ..config import PipelineConfig
        from ..runtime.lifeline import watch_agent

        watch_agent(getattr(args, "timeout", None) or PipelineConfig.timeout)  # (a config file's: resolved later)
    job = resolve(args, say=print if lead else lambda line: None, lead=lead, hold=hold)
    if lead:
        folder = RunFolder(job.run_dir)
        if not job.resume:
            folder.clear_record()
        folder.write_config(flags_of(args), job, defaults or {})
        _print_job(job)
    stages, replicas, tp = job.pipeline.stages, job.pipeline.replicas, job.pipeline.tensor_parallel
    world = stages * replicas * tp
    if under_torchrun:
        from ..runtime.launch import init_from_env

        if int(os.environ["WORLD_SIZE"]) != world:
            raise PipeDPError(
                f"torchrun started {os.environ['WORLD_SIZE']} processes but --stages {stages} x --replicas "
                f"{replicas} x --tensor-parallel {tp} = {world}: use torchrun --nproc_per_node {world}"
            )
        init_from_env(timeout_s=job.pipeline.timeout, device=job.pipeline.device)
        _print_rank_device(world, job.pipeline.device)
        return _merged(job, exit_code(train_rank(int(os.environ["RANK"]), job)), lead)
    if (job.inprocess or world == 1) and replicas > 1:
        raise PipeDPError("--replicas > 1 needs one process per (stage, replica): drop --inprocess")
    if job.inprocess and tp > 1:
        raise PipeDPError("--tensor-parallel > 1 needs one process per (stage, tensor-parallel rank): drop --inprocess")
    placement = place_job(job)
    if not placement.processes:
        devices = None if set(placement.devices) == {"cpu"} else placement.devices
        pipeline = replace(job.pipeline, transport="inprocess", devices=devices)
        return _merged(job, exit_code(train_rank(0, replace(job, inprocess=True, pipeline=pipeline))), lead)
    if placement.shared:  # its ranks' stages on the GPUs they share (under gloo, "auto" would be the CPU)
        job = replace(job, pipeline=replace(job.pipeline, device="cuda"))
    return _merged(job, _launch(job, world, placement.backend or "gloo"), lead)


def _merged(job: Job, code: int, lead: bool) -> int:
    """--export-merged after the ranks (cli/export.py): on the lead process, when the run exported."""
    if lead and job.export_merged:
        from .export import export_merged

        export_merged(job)
    return code


def place_job(job: Job):
    """Where the job's ranks go on this machine (runtime/placement.py), said on stdout."""
    import torch

    from ..runtime.placement import place

    p = job.pipeline
    placement = place(p.stages, p.replicas, p.device, torch.cuda.device_count(), job.inprocess, p.tensor_parallel)
    print(placement.describe(), flush=True)
    return placement


def _print_rank_device(world: int, device: str) -> None:
    import torch
    import torch.distributed as dist

    from ..wire import carrier

    backend = dist.get_backend()
    nccl = carrier(backend, "cuda") == "nccl"
    where = f"cuda:{torch.cuda.current_device()}" if (nccl and device != "cpu") or device == "cuda" else "cpu"
    shared = " (shared, through host memory)" if not nccl and where != "cpu" else ""
    print(f"pipedp: rank {dist.get_rank()} of {world} over {backend} on {where}{shared}", flush=True)


def _launch(job: Job, world: int, backend: str) -> int:
    from ..errors import RankFailedError
    from ..runtime.launch import launch
    from .signals import Forwarding, Terminated

    stages, replicas, tp = job.pipeline.stages, job.pipeline.replicas, job.pipeline.tensor_parallel
    print(
        f"pipedp: launching {world} processes ({stages} stages x {replicas} replica"
        f"{'s' if replicas > 1 else ''}{f' x {tp} tensor-parallel' if tp > 1 else ''}, {backend})",
        flush=True,
    )
    forwarding = Forwarding()
    try:
        with forwarding.active():
            summary = launch(
                train_rank,
                world,
                (job,),
                timeout_s=24 * 3600,
                threads=job.threads,
                backend=backend,
                op_timeout_s=job.pipeline.timeout,
            )[0]
    except RankFailedError:
        if forwarding.signum is not None:  # the ranks stopped because we forwarded the signal
            raise Terminated(forwarding.signum) from None
        raise
    return exit_code(summary)


def _print_job(job: Job) -> None:
    from .summary import describe_job

    print(describe_job(job), flush=True)
    for note in job.resume_notes:
        print(f"resume: {note}", flush=True)


def exit_code(summary: dict) -> int:
    """Non-zero (3) when the run ended on non-finite losses, so scripts notice."""
    loss = summary["loss"]
    return 3 if isinstance(loss, float) and not math.isfinite(loss) and summary["first_loss"] is not None else 0
