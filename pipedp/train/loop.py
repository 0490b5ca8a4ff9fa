"""The fit loop: draw each step's batch with pipedp's own sampler, step, checkpoint; nothing else.

It depends on the ``Trainable`` protocol below, not on the trainer class: the trainer calls
``fit`` and the loop calls back only what the protocol names.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Protocol, Union

import torch

from ..config import FitConfig, PrivacyConfig, steps_per_epoch
from ..errors import CheckpointError, PipeDPError, PrivacyBudgetExceeded
from ..privacy.sampling import poisson_indices, shuffled_indices, truncate, truncation_probability
from ..privacy.units import Units
from ..runtime.microbatch import Inputs, rows, take
from . import checkpoint


class Trainable(Protocol):
    """What the fit loop needs of a trainer."""

    privacy: PrivacyConfig
    last_batch_size: int
    state: Any  # TrainingState: where a shuffled epoch stands (state.charges)

    @property
    def steps_taken(self) -> int: ...

    @property
    def seed(self) -> int: ...  # the root seed of the sampling (and noise) streams

    @property
    def runtime(self) -> Any: ...  # rank and broadcast: rank 0 locks the folder, secure draws come from rank 0

    def use_dataset(self, records: int) -> None: ...

    def step(self, inputs: Inputs, targets: torch.Tensor, *, sampling: Optional[str] = None) -> float: ...

    def epsilon(self, delta: Optional[float] = None) -> float: ...

    def save_checkpoint(
        self, directory: str, key: Union[str, bytes, None] = None, keep_last: Optional[int] = None
    ) -> None: ...

    def load_checkpoint(self, directory: str, key: Union[str, bytes, None] = None) -> None: ...


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
    trainer: Trainable,
    dataset,
    config: FitConfig,
    callback: Optional[Callable[[int, float, Any], None]] = None,
) -> FitResult:
    """Train until ``config`` total steps (or epochs), each on a batch from pipedp's own sampler.

    Poisson (the default, or ``PrivacyConfig.sampling='poisson'``): each record independently with
    probability sample_rate, accounted with amplification. ``'shuffle'``: each epoch a seeded
    permutation cut into batches of expected_batch_size, each record once per epoch, accounted
    without amplification. ``max_logical_batch`` caps a Poisson batch (truncated Poisson): the run
    then differs from the accounted mechanism only on the event that the cap bites in some step,
    whose probability is at most T * p with p = P(|B| > cap), on each of two neighbouring datasets;
    so (epsilon, delta) becomes (epsilon, delta + (1 + e^epsilon) * T * p), reported as
    FitResult.truncation_delta. With ``resume``, training continues from the newest checkpoint
    exactly as if it had never stopped (same batches, same noise, the same charges: where a shuffled epoch
    stands is saved). A max_epsilon on the trainer stops
    the loop before the step that would exceed it, after saving a checkpoint. While it runs, the
    checkpoint folder is locked: a second job on it is refused.
    """
    privacy = trainer.privacy
    sampling = privacy.sampling or "poisson"
    inputs, targets = _as_tensors(dataset)
    if rows(inputs) != len(targets):
        raise PipeDPError(f"fit() got {rows(inputs)} inputs but {len(targets)} targets: pass one target per input")
    units = Units(privacy.unit_rows)
    trainer.use_dataset(units.count(rows(inputs)))  # delta is checked against 1/N (N privacy units) here
    if sampling == "poisson" and privacy.sample_rate is None:
        raise PipeDPError("fit() draws Poisson batches: give the trainer a sample_rate (expected batch / records)")
    if config.max_logical_batch is not None and sampling != "poisson":
        raise PipeDPError("max_logical_batch caps Poisson batches; shuffled batches have a fixed size already")
    total = config.planned_steps(trainer.privacy)  # the one rule of the run length (the calibration's too)
    lock = _lock(trainer, config.checkpoint_dir) if config.checkpoint_dir else None
    try:
        trunc, last_loss, stopped = _train(trainer, inputs, targets, total, config, sampling, callback)
    finally:
        if lock is not None:
            lock.release()
    eps = trainer.epsilon() if trainer.steps_taken else 0.0
    extra_delta = (1 + math.exp(min(eps, 700.0))) * total * trunc if trunc else 0.0
    return FitResult(trainer.steps_taken, last_loss, eps, privacy.delta, stopped, extra_delta)


def _lock(trainer: Trainable, directory: str) -> checkpoint.FolderLock:
    """Rank 0 locks the folder (held until release; a dead job's lock is free), or uses the lock the job's
    lead process took before writing the run folder (FolderLock.hand_down); every rank learns whether it
    could (so all stop together)."""
    lock = checkpoint.FolderLock(directory)
    problem = None
    if trainer.runtime.rank == 0:
        try:
            lock.acquire(inherit=True)
        except CheckpointError as exc:
            problem = str(exc)
    problem = trainer.runtime.broadcast(problem)
    if problem is not None:
        raise CheckpointError(problem)
    try:
        checkpoint.refuse_unshared(trainer.runtime, directory)
    except BaseException:
        lock.release()
        raise
    return lock


def _check_epoch_position(trainer: Trainable, n: int) -> None:
    """fit's shuffled batch at step s is batch s mod (steps per epoch) of its epoch's permutation; the charges
    count an epoch by the units that went through step(). A step taken outside fit (a Poisson step, a batch of
    another size) would set the two apart, and a permutation's records could then be in two batches of one
    charge: refused."""
    batch = trainer.privacy.expected_batch_size
    assert batch is not None
    position = trainer.steps_taken % steps_per_epoch(n, batch)
    seen = trainer.state.charges.seen
    if seen != position * batch:
        raise PipeDPError(
            f"a shuffled fit() at step {trainer.steps_taken} takes batch {position} of an epoch's permutation, but "
            f"{seen} units of the epoch in progress have gone through step(), not {position * batch}: steps taken "
            "outside fit() set the two apart. Start a shuffled fit() from a fresh trainer or a checkpoint of a "
            "shuffled fit(), or use sampling='poisson'"
        )


def _draw(trainer: Trainable, n: int, step: int, sampling: str, cap: Optional[int]) -> torch.Tensor:
    """The indices of step ``step``'s batch (every rank draws the same)."""
    privacy, seed = trainer.privacy, trainer.seed
    if sampling == "shuffle":
        assert privacy.expected_batch_size is not None
        return shuffled_indices(n, privacy.expected_batch_size, seed, step)
    assert privacy.sample_rate is not None
    index = poisson_indices(n, privacy.sample_rate, seed, step, privacy.secure_mode)
    index = truncate(index, cap, seed, step)
    if privacy.secure_mode:  # OS randomness differs per rank: every rank takes rank 0's draw
        index = trainer.runtime.broadcast(index)
    return index


def _train(trainer: Trainable, inputs, targets, total: int, config: FitConfig, sampling: str, callback):
    privacy = trainer.privacy
    units = Units(privacy.unit_rows)
    n = units.count(rows(inputs))
    directory = config.checkpoint_dir
    if directory:
        checkpoint.resolve_key(config.checkpoint_key)  # an empty key is refused now, not at the first save
    if config.resume:
        assert directory is not None  # FitConfig.validate()
        if checkpoint.exists(directory):
            trainer.load_checkpoint(directory, config.checkpoint_key)
        else:
            warnings.warn(f"resume=True but {directory!r} holds no checkpoint: starting from step 0", stacklevel=4)
    trunc = 0.0
    cap = config.max_logical_batch
    if cap is not None:
        assert privacy.sample_rate is not None
        trunc = truncation_probability(n, privacy.sample_rate, cap)
        if trunc > 0:
            warnings.warn(
                f"max_logical_batch={cap} truncates Poisson batches with probability {trunc:.2e} "
                f"per step: the guarantee is (epsilon, delta + (1 + e^epsilon) * {total} * {trunc:.2e})",
                stacklevel=4,
            )
    last_loss, stopped = math.nan, None
    if sampling == "shuffle":
        _check_epoch_position(trainer, n)
    saved = trainer.steps_taken if config.resume and checkpoint.exists(directory or "") else -1
    while trainer.steps_taken < total:
        index = units.row_index(_draw(trainer, n, trainer.steps_taken, sampling, cap))
        try:
            loss = trainer.step(take(inputs, index), targets[index], sampling=sampling)
        except PrivacyBudgetExceeded as exc:
            stopped = str(exc)
            warnings.warn(stopped, stacklevel=4)
            break
        if trainer.last_batch_size:  # an empty batch's loss is NaN by definition; any other NaN is reported
            last_loss = loss
        if callback is not None:
            callback(trainer.steps_taken, loss, trainer)
        every = config.checkpoint_every
        if directory and every and trainer.steps_taken % every == 0:
            trainer.save_checkpoint(directory, config.checkpoint_key, config.keep_last)
            saved = trainer.steps_taken
    if directory and saved != trainer.steps_taken:  # (a checkpoint of this very step is there already)
        trainer.save_checkpoint(directory, config.checkpoint_key, config.keep_last)
    return trunc, last_loss, stopped


__all__: List[str] = ["FitResult", "Trainable", "fit"]
