"""The harness's contenders, in one home: one training step per contender, each built from a preset the same
way (same model, split, batch, optimizer), and the timing loops (``timed``; ``interleave``, rounds of it).
bench.questions and bench.gpu_check interleave them; bench.qps, bench.cpu_time, bench.memory_sweep and
bench.overhead measure them one at a time.

A maker returns a ``Contender``: a step closure over fixed inputs, and what it holds. Multi-process
makers run on every rank of a ``pipedp.launch`` (one stage per rank); the split is pipedp's
parameter-balanced one, computed once before any adapter is added, and used by every contender.
``batch`` (default the preset's) sets the rows of a step; one-process makers take a ``device``.
"""

from __future__ import annotations

import statistics
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from .presets import BALANCE, Preset

LR = 1e-3


@dataclass
class Contender:
    name: str
    step: Callable[[], None]
    close: Callable[[], None] = lambda: None


def timed(step: Callable[[], None], warmup: int, reps: int, sync: Callable[[], None] = lambda: None) -> List[float]:
    """The seconds of each of ``reps`` steps after ``warmup`` untimed ones, ``sync`` before and after each
    (a barrier across ranks; a CUDA synchronize)."""
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


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def interleave(
    contenders: Sequence[Contender], rounds: int, reps: int, sync: Callable[[], None] = barrier
) -> Dict[str, List[float]]:
    """Per contender, its median step time (seconds) in each round; the order rotates each round, so a
    machine-wide slowdown hits every contender alike."""
    times: Dict[str, List[float]] = {c.name: [] for c in contenders}
    for r in range(rounds):
        k = r % len(contenders)
        for c in list(contenders[k:]) + list(contenders[:k]):
            times[c.name].append(statistics.median(timed(c.step, 0, reps, sync)))
    return times


_FROZEN: dict = {}  # (preset, stages, rank) -> the frozen base weights LoRA contenders share


def stage_model(preset: Preset, stages: int, rank: int, lora: bool):
    """This rank's model (other stages on meta for the large presets), the block costs of its split
    (measured before any adapter), and the model with LoRA adapters when ``lora``. LoRA contenders of
    a large preset share one copy of the frozen base weights (each would otherwise hold its own)."""
    from pipedp.split.adapters import model_blocks
    from pipedp.split.partition import block_costs

    torch.manual_seed(0)
    model = preset.build(stages, rank)
    if lora and preset.build_meta is not None:
        shared = _FROZEN.setdefault((preset.name, stages, rank), {})
        for name, p in model.named_parameters():
            if not p.is_meta:
                p.data = shared.setdefault(name, p.data)  # the first contender's tensor; this copy is freed
    costs = block_costs(model_blocks(model), BALANCE)
    if lora:
        from peft import get_peft_model

        torch.manual_seed(0)  # the same adapters on every rank and for every contender
        model = get_peft_model(model, preset.lora_config)
    return model, costs


def rank_part(model: nn.Module, costs: List[float], stages: int, rank: int) -> nn.Sequential:
    """This rank's blocks as one module (the other ranks' blocks freed to meta), where pipedp cuts."""
    from pipedp.split.adapters import model_blocks
    from pipedp.split.partition import partition

    parts = partition(model_blocks(model), stages, costs)
    for s, blocks in enumerate(parts):
        if s != rank:
            for b in blocks:
                b.module.to("meta")
    return nn.Sequential(*[b.module for b in parts[rank]])


def trainable(module: nn.Module) -> List[nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad and not p.is_meta]


# ---- one process per stage ---------------------------------------------------------------------
def torch_pipeline(
    preset: Preset,
    schedule: str = "1f1b",
    lora: bool = False,
    microbatches: Optional[int] = None,
    batch: Optional[int] = None,
) -> Contender:
    """torch.distributed.pipelining's Schedule1F1B or ScheduleGPipe (no DP) on this rank's part, SGD."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    rank, stages = dist.get_rank(), dist.get_world_size()
    x, y = preset.make_batch(batch or preset.batch, 0)
    model, costs = stage_model(preset, stages, rank, lora)
    module = rank_part(model, costs, stages, rank)
    stage = PipelineStage(module, rank, stages, torch.device("cpu"))
    kind = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[schedule]
    sched = kind(stage, n_microbatches=microbatches or preset.microbatches, loss_fn=preset.mean_loss)
    opt = torch.optim.SGD(trainable(module), lr=LR)

    def step():
        opt.zero_grad(set_to_none=True)
        if rank == 0:
            sched.step(x)
        elif rank == stages - 1:
            sched.step(target=y, losses=[])
        else:
            sched.step()
        opt.step()

    return Contender(f"torch-{schedule}" + ("-lora" if lora else ""), step)


def pipedp_trainer(
    preset: Preset,
    schedule: str = "1f1b",
    mode: str = "ghost",
    lora: bool = False,
    self_check: bool = True,
    stages: Optional[int] = None,
    microbatches: Optional[int] = None,
    model=None,
    batch: Optional[int] = None,
    device: Optional[str] = None,
    **options,
):
    """A PipelineDPTrainer on the preset (``model``: a (model, costs) pair already built, to reuse; ``device``:
    the model moved there, one process; ``options``: more trainer options, e.g. ``clipping``)."""
    from pipedp import PipelineDPTrainer

    distributed = dist.is_initialized() and dist.get_world_size() > 1
    stages = stages or (dist.get_world_size() if distributed else 1)
    rank = dist.get_rank() if distributed else 0
    # in one process every stage is here: the whole model
    model, costs = model if model is not None else stage_model(preset, stages if distributed else 1, rank, lora)
    settings = dict(
        stages=stages,
        microbatches=microbatches or preset.microbatches,
        schedule=schedule,
        grad_mode=mode,
        self_check=self_check,
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        expected_batch_size=batch or preset.batch,
        sample_rate=0.01,
        sampling="poisson",
        balance=costs,
        transport="distributed" if distributed else "inprocess",
    )
    settings.update(options)
    return PipelineDPTrainer(
        model if device is None else model.to(device),
        preset.loss,
        lambda p: torch.optim.SGD(p, lr=LR),
        **settings,
    )


def pipedp(
    preset: Preset,
    schedule: str,
    mode: str,
    lora: bool = False,
    name: Optional[str] = None,
    batch: Optional[int] = None,
    device: Optional[str] = None,
    **kw,
) -> Contender:
    x, y = (t.to(device or "cpu") for t in preset.make_batch(batch or preset.batch, 0))
    trainer = pipedp_trainer(preset, schedule, mode, lora, batch=batch, device=device, **kw)
    name = name or f"pipedp-{schedule}-{mode}" + ("-lora" if lora else "")
    return Contender(name, lambda: trainer.step(x, y), trainer.close)


def naive(preset: Preset, batch: Optional[int] = None) -> Contender:
    """The device_map-style sequential split with Opacus hooks per part (bench/naive_split.py)."""
    from .naive_split import naive_split_step_fn

    rank, stages = dist.get_rank(), dist.get_world_size()
    model, costs = stage_model(preset, stages, rank, False)
    part = rank_part(model, costs, stages, rank)
    return Contender("naive-split", naive_split_step_fn(part, preset, batch or preset.batch, stages))


# ---- one process ---------------------------------------------------------------------------------
def opacus(preset: Preset, mode: str = "ghost", batch: Optional[int] = None, device: str = "cpu") -> Contender:
    """Opacus on the whole model: its hooks (``mode="hooks"``: per-sample gradients materialized) or its ghost
    clipping (``"ghost"``: grad_sample_mode="ghost", its double-backward loss)."""
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset

    warnings.filterwarnings("ignore")
    x, y = preset.make_batch(batch or preset.batch, 0)
    torch.manual_seed(0)
    model = preset.build().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    private = dict(
        module=model,
        optimizer=opt,
        data_loader=DataLoader(TensorDataset(x, y), batch_size=len(x)),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        poisson_sampling=False,
    )
    x, y = x.to(device), y.to(device)
    if mode == "hooks":
        model, opt, _ = PrivacyEngine().make_private(**private)

        def step():
            opt.zero_grad(set_to_none=True)
            preset.mean_loss(model(x), y).backward()
            opt.step()

    else:
        token = x.dim() == 2 and not x.is_floating_point()
        model, opt, dp_loss, _ = PrivacyEngine().make_private(
            **private, criterion=torch.nn.CrossEntropyLoss(), grad_sample_mode="ghost"
        )

        def step():
            opt.zero_grad(set_to_none=True)
            out = model(x)
            loss = dp_loss(out.reshape(-1, out.shape[-1]), y.reshape(-1), shape=out.shape) if token else dp_loss(out, y)
            loss.backward()
            opt.step()

    return Contender(f"opacus-{mode}", step)


def plain(
    preset: Preset, batch: Optional[int] = None, device: str = "cpu", microbatches: int = 1, compiled: bool = False
) -> Contender:
    """Non-private training of the whole model in one process (context for the one-process figures); with
    ``microbatches``, the batch's gradients accumulated over that many equal parts; ``compiled``: the model's
    forward under ``torch.compile`` (bench.compile_ceiling)."""
    x, y = (t.to(device) for t in preset.make_batch(batch or preset.batch, 0))
    torch.manual_seed(0)
    model = preset.build().to(device)
    forward = torch.compile(model) if compiled else model
    opt = torch.optim.SGD(model.parameters(), lr=LR)

    def step():
        opt.zero_grad(set_to_none=True)
        for xs, ys in zip(x.chunk(microbatches), y.chunk(microbatches)):
            (preset.mean_loss(forward(xs), ys) / microbatches).backward()
        opt.step()

    return Contender("compiled" if compiled else "plain", step)
