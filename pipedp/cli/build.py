"""A rank's trainer: its model (its own stage's weights, with loading progress), LoRA adapters, the
optimizer each stage builds and its learning-rate schedule; and resuming it.

Weight decay is decided per parameter before the trainer is built, by module type and parameter
identity (pipedp.cli.options.OptimizerConfig.no_decay): biases, the weights of normalisation layers
(LayerNorm, RMSNorm, GroupNorm: any module class named *Norm*) and embeddings get none unless asked.
The optimizer factory receives one stage's trainable parameters and puts them in two groups.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import replace
from typing import Iterator, List, Sequence, Set

import torch
import torch.nn as nn

from ..models import GPTConfig, tiny_gpt, token_loss
from ..split.adapters import model_blocks
from ..split.hf_loading import load_local_model, load_pipeline_stage, resident_parameter_bytes
from ..split.partition import block_costs
from ..train.checkpoint import exists
from ..train.lora import with_lora
from ..train.trainer import PipelineDPTrainer
from .options import OptimizerConfig
from .spec import TINY_GPT, TINY_GPT_SEQ_LEN, TINY_GPT_SHAPE, Job

LOADING_HEARTBEAT_S = 15.0


@contextmanager
def loading(stage: int, what: str) -> Iterator[None]:
    """Say when a stage starts and ends loading, and every 15 s in between (a big model takes minutes)."""
    start = time.monotonic()
    done = threading.Event()

    def heartbeat():
        while not done.wait(LOADING_HEARTBEAT_S):
            print(f"stage {stage}: still loading ({time.monotonic() - start:.0f}s)", flush=True)

    print(f"stage {stage}: loading {what}", flush=True)
    thread = threading.Thread(target=heartbeat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
    print(f"stage {stage}: loaded in {time.monotonic() - start:.1f}s", flush=True)


def build_model(job: Job, rank: int) -> nn.Module:
    stages = job.pipeline.stages
    stage = (rank // job.pipeline.tensor_parallel) % stages  # runtime/distributed.py's Mesh
    if job.model.name == TINY_GPT:
        torch.manual_seed(job.privacy.public_seed())
        return tiny_gpt(GPTConfig(vocab_size=256, seq_len=job.data.seq_len or TINY_GPT_SEQ_LEN, **TINY_GPT_SHAPE))
    if job.inprocess:
        with loading(0, f"the whole model from {job.model.name}"):
            return load_local_model(job.model.name)
    # each rank reads only its own stage's tensors from the checkpoint; under tensor parallelism the split layers'
    # slices are read when the trainer cuts them (each rank its own)
    tp = job.pipeline.tensor_parallel
    with loading(stage, f"its weights from {job.model.name}"):
        model = load_pipeline_stage(
            job.model.name, stages, stage, untie_weights=job.pipeline.untie_weights, tensor_parallel=tp
        )
    later = " (the tensor-parallel slices are read when the layers are split)" if tp > 1 else ""
    print(f"stage {stage}: {resident_parameter_bytes(model) / 1e6:.1f} MB of parameters resident{later}", flush=True)
    return model


def no_decay_parameters(model: nn.Module, kinds: Sequence[str]) -> Set[int]:
    """The ids of the parameters that get no weight decay: by module type (embeddings, *Norm* layers) and
    by name (biases). Taken from the model as the trainer will see it (after loading and LoRA)."""
    out: Set[int] = set()
    for module in model.modules():
        own = list(module.named_parameters(recurse=False))
        is_norm = "Norm" in type(module).__name__
        is_embedding = isinstance(module, nn.Embedding)
        for name, p in own:
            if (
                ("bias" in kinds and name == "bias")
                or ("norm" in kinds and is_norm)
                or ("embedding" in kinds and is_embedding)
            ):
                out.add(id(p))
    return out


def optimizer_factory(optim: OptimizerConfig, no_decay: Set[int], keep: List[nn.Parameter]):
    """``factory(stage parameters) -> optimizer`` with two groups (decay, no decay). ``keep`` holds the
    model's parameters so that no id in ``no_decay`` can be reused by another object."""

    def factory(params: List[nn.Parameter]) -> torch.optim.Optimizer:
        decay = [p for p in params if id(p) not in no_decay]
        rest = [p for p in params if id(p) in no_decay]
        groups = [
            {"params": ps, "weight_decay": wd, "pipedp_decay": flag}
            for ps, wd, flag in ((decay, optim.weight_decay, True), (rest, 0.0, False))
            if ps
        ]
        if optim.optimizer == "sgd":
            return torch.optim.SGD(groups, lr=optim.lr, momentum=optim.momentum)
        cls = torch.optim.AdamW if optim.optimizer == "adamw" else torch.optim.Adam
        # torch's fused kernel makes no temporaries (the others: two per tensor), so the gradients may live in
        # the float32 sums' storage (train/narrowing.py); it exists for CPU and CUDA tensors
        # (a parameter on the meta device is one the tensor-parallel split will read, onto the CPU)
        fused = all(p.device.type in ("cpu", "cuda", "meta") and p.is_floating_point() for p in params)
        betas = (optim.adam_beta1, optim.adam_beta2)
        return cls(groups, lr=optim.lr, betas=betas, eps=optim.adam_epsilon, fused=fused or None)

    factory.keep = keep  # type: ignore[attr-defined]
    return factory


def scheduler_factory(optim: OptimizerConfig, total_steps: int):
    """``factory(optimizer) -> LambdaLR``: step s (from 0) runs at lr x optim.lr_factor(s, total_steps). The
    factor is a plain function, so the scheduler's state holds only its position (a resumed run's schedule
    is the one given now: see resume_optimizers)."""

    def factor(step: int) -> float:
        return optim.lr_factor(step, total_steps)

    def factory(optimizer: torch.optim.Optimizer):
        return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)

    return factory


def build_trainer(job: Job, rank: int):
    model = build_model(job, rank)
    pipeline = job.pipeline
    if job.lora_r is not None:
        # split where the stage loader split the base model, whatever parameters LoRA adds
        pipeline = replace(pipeline, balance=block_costs(model_blocks(model, pipeline.untie_weights), "compute"))
        model = with_lora(model, job.lora_r, job.lora_targets, job.privacy.public_seed())
    no_decay = no_decay_parameters(model, job.optim.no_decay_kinds())
    return PipelineDPTrainer(
        model,
        token_loss,
        optimizer_factory(job.optim, no_decay, list(model.parameters())),
        scheduler=scheduler_factory(job.optim, job.steps),
        pipeline=pipeline,
        privacy=job.privacy,
    )


def resume(trainer, job: Job, lead: bool) -> None:
    """Load the newest checkpoint; the optimizer options and the schedule given now apply from its step on."""
    directory = job.fit.checkpoint_dir
    assert directory is not None
    if not exists(directory):
        return
    trainer.load_checkpoint(directory, job.fit.checkpoint_key)
    step = trainer.steps_taken
    changes = resume_optimizers(trainer, job.optim, job.steps, step)
    if lead:
        print(f"resumed from step {step} in {directory}", flush=True)
        for line in changes:
            print(line, flush=True)


def resume_optimizers(trainer, optim: OptimizerConfig, total_steps: int, step: int) -> List[str]:
    """Set every optimizer group's options from ``optim`` and its schedule to step ``step``; return the
    options that differ from the checkpoint's, as lines."""
    changed: dict = {}

    def put(group: dict, key: str, value, flag: str, show=None):
        old = group.get(key)
        if key in group and old != value:
            changed.setdefault(flag, (show(old) if show else old, show(value) if show else value))
        group[key] = value

    factor = optim.lr_factor(step, total_steps)
    for opt, scheduler in zip(trainer.state.optimizers, trainer.state.schedulers):
        if opt is None:
            continue
        for group in opt.param_groups:
            base = group.get("initial_lr", group["lr"])
            if base != optim.lr:
                changed.setdefault("--lr", (f"{base:g}", f"{optim.lr:g}"))
            group["initial_lr"] = optim.lr
            group["lr"] = optim.lr * factor
            decays = group.get("pipedp_decay", True)
            put(group, "weight_decay", optim.weight_decay if decays else 0.0, "--weight-decay")
            if "betas" in group:
                put(group, "betas", (optim.adam_beta1, optim.adam_beta2), "--adam-beta1/2", show=tuple)
                put(group, "eps", optim.adam_epsilon, "--adam-epsilon")
            if "momentum" in group:
                put(group, "momentum", optim.momentum, "--momentum")
        if scheduler is not None:
            scheduler.base_lrs = [optim.lr for _ in opt.param_groups]
            scheduler.last_epoch = step
            scheduler._last_lr = [g["lr"] for g in opt.param_groups]
    return [f"optimizer: {flag} {new} replaces the checkpoint's {old}" for flag, (old, new) in changed.items()]
