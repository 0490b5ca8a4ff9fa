"""The training loop: Poisson-sampled logical batches, budget guard, checkpoints, resume."""
from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from . import checkpoint as ckpt
from .errors import PipeDPError, PrivacyBudgetExceeded
from .sampling import poisson_indices, truncate, truncation_probability


@dataclass
class FitResult:
    steps: int  # steps taken in total, including those before a resume
    loss: float  # mean loss of the last non-empty step
    epsilon: Optional[float]
    delta: float
    stopped_by_budget: Optional[str] = None  # the guard's message when max_epsilon stopped the run
    truncation_delta: float = 0.0  # extra delta from capping logical batches (0 without a cap)


def _as_tensors(dataset):
    if isinstance(dataset, (tuple, list)) and len(dataset) == 2:
        return dataset[0], dataset[1]
    tensors = getattr(dataset, "tensors", None)  # TensorDataset
    if tensors is not None and len(tensors) == 2:
        return tensors
    try:
        pairs = [dataset[i] for i in range(len(dataset))]
        return torch.stack([p[0] for p in pairs]), torch.stack([torch.as_tensor(p[1]) for p in pairs])
    except Exception as exc:
        raise PipeDPError(
            "fit() takes (inputs, targets) tensors, a TensorDataset of two tensors, or a map-style dataset of "
            f"(input, target) pairs; could not read {type(dataset).__name__}: {exc}"
        ) from exc


def fit(
    trainer,
    dataset,
    *,
    steps: Optional[int] = None,
    epochs: Optional[float] = None,
    checkpoint_dir: Optional[str] = None,
    checkpoint_every: Optional[int] = None,
    resume: bool = False,
    max_logical_batch: Optional[int] = None,
    callback: Optional[Callable[[int, float, "object"], None]] = None,
) -> FitResult:
    """Train until ``steps`` total steps (or ``epochs`` epochs = epochs / sample_rate steps).

    Every step draws a logical batch by Poisson sampling at ``trainer.sample_rate``.
    ``max_logical_batch`` caps a batch (truncated Poisson): the run then differs from the
    accounted Poisson mechanism only on the event that the cap bites in some step, whose
    probability is at most T * p with p = P(|B| > cap), on either of two neighbouring
    datasets; so (epsilon, delta) becomes (epsilon, delta + (1 + e^epsilon) * T * p).
    FitResult.truncation_delta reports that extra term.
    ``callback(step, loss, trainer)`` runs after every step. With ``resume``, training
    continues from the newest checkpoint in ``checkpoint_dir`` exactly as if it had never
    stopped (same batches, same noise). A max_epsilon on the trainer stops the loop before
    the step that would exceed it, after saving a checkpoint.
    """
    q = trainer.sample_rate
    if q is None:
        raise PipeDPError("fit() samples batches by Poisson sampling: give the trainer a sample_rate")
    if (steps is None) == (epochs is None):
        raise PipeDPError("fit() takes exactly one of steps or epochs")
    total = steps if steps is not None else math.ceil(epochs / q)
    inputs, targets = _as_tensors(dataset)
    n = len(inputs)
    if resume:
        if checkpoint_dir is None:
            raise PipeDPError("resume=True needs checkpoint_dir")
        if os.path.exists(os.path.join(checkpoint_dir, "latest")):
            trainer.load_checkpoint(checkpoint_dir)
    trunc = 0.0
    if max_logical_batch is not None:
        trunc = truncation_probability(n, q, max_logical_batch)
        if trunc > 0:
            warnings.warn(
                f"max_logical_batch={max_logical_batch} truncates Poisson batches with probability {trunc:.2e} "
                f"per step: the guarantee is (epsilon, delta + (1 + e^epsilon) * {total} * {trunc:.2e})", stacklevel=2
            )
    last_loss, stopped = math.nan, None
    while trainer.steps_taken < total:
        t = trainer.steps_taken
        index = truncate(poisson_indices(n, q, trainer.seed, t, trainer.secure_mode), max_logical_batch, trainer.seed, t)
        if trainer.secure_mode:  # OS randomness differs per rank: every rank takes rank 0's draw
            index = trainer.runtime.broadcast(index)
        try:
            loss = trainer.step(inputs[index], targets[index])
        except PrivacyBudgetExceeded as exc:
            stopped = str(exc)
            warnings.warn(stopped, stacklevel=2)
            break
        if not math.isnan(loss):
            last_loss = loss
        if callback is not None:
            callback(trainer.steps_taken, loss, trainer)
        if checkpoint_dir and checkpoint_every and trainer.steps_taken % checkpoint_every == 0:
            trainer.save_checkpoint(checkpoint_dir)
    if checkpoint_dir:
        trainer.save_checkpoint(checkpoint_dir)
    eps = trainer.epsilon(trainer.delta) if trainer.steps_taken else 0.0
    extra_delta = (1 + math.exp(min(eps, 700.0))) * total * trunc if trunc else 0.0
    return FitResult(trainer.steps_taken, last_loss, eps, trainer.delta, stopped, extra_delta)


def save_checkpoint(trainer, directory: str) -> None:
    runtime = trainer.runtime
    hashes = {}
    if runtime.replica == 0:
        for stage, opt in zip(runtime.local_stages, trainer.optimizers):
            state = {"params": stage.named_state(), "optimizer": opt.state_dict()}
            hashes[stage.index] = ckpt.write_stage(directory, trainer.steps_taken, stage.index, state)
    merged = {}
    for part in runtime.all_gather(hashes):  # also the barrier: every stage file is complete
        merged.update(part)
    if runtime.rank == 0:
        ckpt.write_manifest(directory, trainer.steps_taken, {
            "step": trainer.steps_taken,
            "config": trainer.run_config(),
            "accountant_history": [list(h) for h in trainer.accountant.history],
            "stage_sha256": [merged[s] for s in range(trainer.stages)],
        })
    runtime.all_gather(None)  # nobody reads 'latest' before it is written


def load_checkpoint(trainer, directory: str) -> None:
    manifest = ckpt.latest_manifest(directory)
    ckpt.check_compatible(manifest, trainer.run_config())
    for stage, opt in zip(trainer.runtime.local_stages, trainer.optimizers):
        state = ckpt.read_stage(manifest, stage.index)
        stage.load_named_state(state["params"])
        opt.load_state_dict(state["optimizer"])
    trainer.accountant.history = [tuple(h) for h in manifest["accountant_history"]]
    trainer.steps_taken = int(manifest["step"])
