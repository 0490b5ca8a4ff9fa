"""One training step per contender, built the same way from the same preset and batch.

Single process (all cores): plain PyTorch, Opacus hooks, Opacus ghost clipping.
One process per stage (one core each): torch.distributed.pipelining GPipe / 1F1B (no DP),
the naive split (bench/naive_split.py: Opacus hooks on each part, the whole batch as one
micro-batch, norms summed across parts — the device_map hack, with no pipedp code), and pipedp.
"""

from __future__ import annotations

import statistics
import time
import warnings
from typing import Callable, Dict, List

# Every library a contender uses is imported here, before any measured phase: no contender's
# peak memory may include the cost of importing one (the first contender of a process used to).
import opacus  # noqa: F401
import torch
import torch.distributed as dist
import torch.distributed.pipelining  # noqa: F401

import pipedp.train.trainer  # noqa: F401
from pipedp.runtime.process import settle_process

from .memory import PeakMemory
from .presets import BALANCE, PRESETS, Preset

LR = 1e-3


def _timed(step: Callable[[], None], warmup: int, reps: int, sync: Callable[[], None] = lambda: None) -> List[float]:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
    return times


# ---- single process --------------------------------------------------------------------------
def single_process(name: str, preset: Preset, batch: int, warmup: int, reps: int) -> Dict:
    x, y = preset.make_batch(batch, 0)
    with PeakMemory() as mem:
        torch.manual_seed(0)
        model = preset.build()
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        if name == "plain":

            def step():
                opt.zero_grad(set_to_none=True)
                preset.mean_loss(model(x), y).backward()
                opt.step()
        else:
            step = _opacus_step(name, preset, model, opt, x, y)
        times = _timed(step, warmup, reps)
    return {"name": name, "seconds": statistics.median(times), "peak_mib": [mem.peak_mib], "batch": batch}


def _opacus_step(name, preset, model, opt, x, y):
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset

    warnings.filterwarnings("ignore")
    loader = DataLoader(TensorDataset(x, y), batch_size=len(x))
    engine = PrivacyEngine()
    criterion = torch.nn.CrossEntropyLoss()
    token = x.dim() == 2 and not x.is_floating_point()
    if name == "opacus-ghost":
        model, opt, dp_loss, _ = engine.make_private(
            module=model,
            optimizer=opt,
            data_loader=loader,
            criterion=criterion,
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            poisson_sampling=False,
            grad_sample_mode="ghost",
        )

        def step():
            opt.zero_grad(set_to_none=True)
            out = model(x)
            loss = dp_loss(out.reshape(-1, out.shape[-1]), y.reshape(-1), shape=out.shape) if token else dp_loss(out, y)
            loss.backward()
            opt.step()
    else:
        model, opt, _ = engine.make_private(
            module=model,
            optimizer=opt,
            data_loader=loader,
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            poisson_sampling=False,
        )

        def step():
            opt.zero_grad(set_to_none=True)
            preset.mean_loss(model(x), y).backward()
            opt.step()

    return step


# ---- one process per stage -------------------------------------------------------------------
def torch_pipeline(schedule: str, microbatches: int, preset: Preset, batch: int, stages: int, warmup: int, reps: int):
    x, y = preset.make_batch(batch, 0)
    with PeakMemory() as mem:
        step = torch_pipeline_step(schedule, microbatches, preset, x, y)
        times = _timed(step, warmup, reps, dist.barrier)
    return {"seconds": statistics.median(times), "peak_mib": mem.peak_mib}


def torch_pipeline_step(schedule: str, microbatches: int, preset: Preset, x, y) -> Callable[[], None]:
    """This rank's part of the preset under torch's GPipe / 1F1B (no DP): one training step."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from .parts import rank_part

    rank, stages = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    module = rank_part(preset.build(), stages, rank)
    stage = PipelineStage(module, rank, stages, torch.device("cpu"))
    cls = Schedule1F1B if schedule == "1f1b" else ScheduleGPipe
    sched = cls(stage, n_microbatches=microbatches, loss_fn=preset.mean_loss)
    opt = torch.optim.SGD(module.parameters(), lr=LR)

    def step():
        opt.zero_grad(set_to_none=True)
        if rank == 0:
            sched.step(x)
        elif rank == stages - 1:
            sched.step(target=y, losses=[])
        else:
            sched.step()
        opt.step()

    return step


def pipedp_pipeline(
    schedule: str, mode: str, microbatches: int, preset: Preset, batch: int, stages: int, warmup: int, reps: int
):
    from pipedp import PipelineDPTrainer

    x, y = preset.make_batch(batch, 0)
    with PeakMemory() as mem:
        torch.manual_seed(0)
        trainer = PipelineDPTrainer(
            preset.build(),
            preset.loss,
            lambda p: torch.optim.SGD(p, lr=LR),
            stages=stages,
            microbatches=microbatches,
            schedule=schedule,
            grad_mode=mode,
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            expected_batch_size=batch,
            balance=BALANCE,
        )
        times = _timed(lambda: trainer.step(x, y), warmup, reps, dist.barrier)
    return {"seconds": statistics.median(times), "peak_mib": mem.peak_mib}


def naive_split(preset: Preset, batch: int, stages: int, warmup: int, reps: int):
    from .naive_split import naive_split_step_fn
    from .parts import rank_part

    with PeakMemory() as mem:
        torch.manual_seed(0)
        part = rank_part(preset.build(), stages, dist.get_rank())
        step = naive_split_step_fn(part, preset, batch, stages)
        times = _timed(step, warmup, reps, dist.barrier)
    return {"seconds": statistics.median(times), "peak_mib": mem.peak_mib}


def run_multiprocess(rank: int, plan: List[Dict], preset_name: str, batch: int, stages: int, warmup: int, reps: int):
    """Runs every multi-process contender of the plan in turn on this rank."""
    warnings.filterwarnings("ignore")
    settle_process()  # as `pipedp train` does, for every contender alike (see pipedp/runtime/process.py)
    preset = PRESETS[preset_name]
    results = []
    for item in plan:
        if item["kind"] == "naive":
            r = naive_split(preset, batch, stages, warmup, reps)
        elif item["kind"] == "torch":
            r = torch_pipeline(item["schedule"], item["microbatches"], preset, batch, stages, warmup, reps)
        else:
            r = pipedp_pipeline(
                item["schedule"], item["mode"], item["microbatches"], preset, batch, stages, warmup, reps
            )
        gathered: List = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, r)
        results.append(dict(item, seconds=gathered[0]["seconds"], peak_mib=[g["peak_mib"] for g in gathered]))
    return results
