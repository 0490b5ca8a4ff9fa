"""The fit loop: draw each step's Poisson batch, step, checkpoint; nothing else.

It uses the trainer's public surface only (``step``, ``state``, ``privacy``, ``runtime``,
``save_checkpoint``, ``load_checkpoint``, ``epsilon``).
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, Union

import torch

from ..config import steps_for_epochs
from ..errors import CheckpointError, PipeDPError, PrivacyBudgetExceeded
from ..privacy.sampling import poisson_indices, truncate, truncation_probability
from ..runtime.microbatch import rows, take
from .checkpoint import FolderLock

if TYPE_CHECKING:
    from .trainer import PipelineDPTrainer


@dataclass
class FitResult:
    steps: int  # steps taken in total, including those before a resume
    loss: float  # mean loss of the last non-empty step (NaN if that step's losses were not finite)
    epsilon: Optional[float]
    delta: float
    stopped_by_budget: Optional[str] = None  # the guard's message when max_epsilon stopped the run
    truncation_delta: float = 0.0  # extra delta from capping logical batches (0 without a cap)


def _as_tensors(dataset):
    """(inputs, targets): inputs a tensor or a dict of batch-first tensors."""
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
    trainer: "PipelineDPTrainer",
    dataset,
    *,
    steps: Optional[int] = None,
    epochs: Optional[float] = None,
    checkpoint_dir: Optional[str] = None,
    checkpoint_every: Optional[int] = None,
    resume: bool = False,
    max_logical_batch: Optional[int] = None,
    checkpoint_key: Union[str, bytes, None] = None,
    keep_last: Optional[int] = None,
    callback: Optional[Callable[[int, float, "PipelineDPTrainer"], None]] = None,
) -> FitResult:
    """Train until ``steps`` total steps (or ``epochs`` epochs: ceil(epochs / sample_rate) steps).

    Every step draws a logical batch by Poisson sampling at ``trainer.sample_rate``.
    ``max_logical_batch`` caps a batch (truncated Poisson): the run then differs from the
    accounted Poisson mechanism only on the event that the cap bites in some step, whose
    probability is at most T * p with p = P(|B| > cap), on each of two neighbouring
    datasets; so (epsilon, delta) becomes (epsilon, delta + (1 + e^epsilon) * T * p).
    FitResult.truncation_delta reports that extra term.
    ``callback(step, loss, trainer)`` runs after every step. With ``resume``, training
    continues from the newest checkpoint in ``checkpoint_dir`` exactly as if it had never
    stopped (same batches, same noise). A max_epsilon on the trainer stops the loop before
    the step that would exceed it, after saving a checkpoint. ``checkpoint_key`` (or the
    environment variable PIPEDP_CHECKPOINT_KEY) signs every manifest and refuses to resume
    from one it did not sign; ``keep_last`` keeps only the newest step folders. While it
    runs, the folder is locked: a second job on it is refused with this job's pid.
    """
    privacy = trainer.privacy
    q = privacy.sample_rate
    if q is None:
        raise PipeDPError("fit() samples batches by Poisson sampling: give the trainer a sample_rate")
    if (steps is None) == (epochs is None):
        raise PipeDPError("fit() takes exactly one of steps or epochs")
    total = steps if steps is not None else steps_for_epochs(epochs, q)
    inputs, targets = _as_tensors(dataset)
    if rows(inputs) != len(targets):
        raise PipeDPError(f"fit() got {rows(inputs)} inputs but {len(targets)} targets: pass one target per input")
    if max_logical_batch is not None and max_logical_batch < 1:
        raise PipeDPError(f"max_logical_batch must be >= 1, got {max_logical_batch}")
    if resume and checkpoint_dir is None:
        raise PipeDPError("resume=True needs checkpoint_dir")
    lock = _lock(trainer, checkpoint_dir) if checkpoint_dir else None
    try:
        trunc, last_loss, stopped = _train(
            trainer,
            inputs,
            targets,
            total,
            checkpoint_dir,
            checkpoint_every,
            resume,
            max_logical_batch,
            checkpoint_key,
            keep_last,
            callback,
        )
    finally:
        if lock is not None:
            lock.release()
    eps = trainer.epsilon(privacy.delta) if trainer.state.step else 0.0
    extra_delta = (1 + math.exp(min(eps, 700.0))) * total * trunc if trunc else 0.0
    return FitResult(trainer.state.step, last_loss, eps, privacy.delta, stopped, extra_delta)


def _lock(trainer: "PipelineDPTrainer", directory: str) -> FolderLock:
    """Rank 0 locks the folder; every rank learns whether it could (so all stop together)."""
    lock = FolderLock(directory)
    problem = None
    if trainer.runtime.rank == 0:
        try:
            lock.acquire()
        except CheckpointError as exc:
            problem = str(exc)
    problem = trainer.runtime.broadcast(problem)
    if problem is not None:
        raise CheckpointError(problem)
    return lock


def _train(
    trainer,
    inputs,
    targets,
    total,
    checkpoint_dir,
    checkpoint_every,
    resume,
    max_logical_batch,
    checkpoint_key,
    keep_last,
    callback,
):
    privacy, q, n = trainer.privacy, trainer.privacy.sample_rate, rows(inputs)
    if resume:
        if os.path.exists(os.path.join(checkpoint_dir, "latest")):
            trainer.load_checkpoint(checkpoint_dir, checkpoint_key)
        else:
            warnings.warn(f"resume=True but {checkpoint_dir!r} holds no checkpoint: starting from step 0", stacklevel=4)
    trunc = 0.0
    if max_logical_batch is not None:
        trunc = truncation_probability(n, q, max_logical_batch)
        if trunc > 0:
            warnings.warn(
                f"max_logical_batch={max_logical_batch} truncates Poisson batches with probability {trunc:.2e} "
                f"per step: the guarantee is (epsilon, delta + (1 + e^epsilon) * {total} * {trunc:.2e})",
                stacklevel=4,
            )
    last_loss, stopped = math.nan, None
    while trainer.state.step < total:
        t = trainer.state.step
        index = poisson_indices(n, q, privacy.seed, t, privacy.secure_mode)
        index = truncate(index, max_logical_batch, privacy.seed, t)
        if privacy.secure_mode:  # OS randomness differs per rank: every rank takes rank 0's draw
            index = trainer.runtime.broadcast(index)
        try:
            loss = trainer.step(take(inputs, index), targets[index])
        except PrivacyBudgetExceeded as exc:
            stopped = str(exc)
            warnings.warn(stopped, stacklevel=4)
            break
        if trainer.last_batch_size:  # an empty batch's loss is NaN by definition; any other NaN is reported
            last_loss = loss
        if callback is not None:
            callback(trainer.state.step, loss, trainer)
        if checkpoint_dir and checkpoint_every and trainer.state.step % checkpoint_every == 0:
            trainer.save_checkpoint(checkpoint_dir, checkpoint_key, keep_last)
    if checkpoint_dir:
        trainer.save_checkpoint(checkpoint_dir, checkpoint_key, keep_last)
    return trunc, last_loss, stopped
