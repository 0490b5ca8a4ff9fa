"""PipelineDPTrainer: DP-SGD on a micro-batched pipeline, equal to Opacus on one device.

One step, top to bottom: ``step`` checks the batch, cuts it into passes of static
micro-batches (runtime.microbatch), and the runtime runs each pass through the schedule
(executor: F, I with per-sample norms, NORM_REDUCE, clipped W); then ``_apply_update``
takes each local stage's clipped sum, adds the noise (privacy.noise), sums over replicas,
divides by the expected batch size and steps the stage's optimizer; the accountant
records the step.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
import weakref
from typing import Any, Callable, Dict, List, Optional, Union

import torch
import torch.nn as nn
from opacus.accountants import create_accountant

import schedules
from schedules import Kind

from ..config import PipelineConfig, PrivacyConfig, describe, split_options
from ..errors import ConfigError, NonFiniteError, PipeDPError, PrivacyBudgetExceeded, UnsupportedModelError
from ..privacy.accounting import calibrate_noise, spent_epsilon, steps_within_budget
from ..privacy.clipping import Clipping
from ..privacy.noise import add_noise
from ..privacy.validation import validate_model
from ..runtime.capture import block_units
from ..runtime.create import create_runtime
from ..runtime.microbatch import (
    Inputs,
    check_batch,
    make_pass,
    microbatch_size_for,
    plan_passes,
    replica_rows,
    take,
)
from ..runtime.microbatch import (
    rows as batch_rows,
)
from ..runtime.protocols import Runtime
from ..split.adapters import model_blocks
from ..split.balance import cost_unit, report
from ..split.blocks import model_signature
from ..split.partition import Tie, block_costs, find_ties, partition
from . import checkpoint
from .export import save_pretrained
from .loop import FitResult, fit
from .state import TrainingState

OptimizerFactory = Callable[[List[nn.Parameter]], torch.optim.Optimizer]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _check_finite(stage: Any, values: List[torch.Tensor], step: int, what: str) -> None:
    """Non-finite values never reach the parameters silently: name the step, stage and parameters
    (one flag per tensor, read back once)."""
    if not values:
        return
    # a NaN or inf element makes its tensor's sum non-finite, so finite sums clear every tensor at the
    # cost of one reduction each (10x cheaper than isfinite(v).all()); a non-finite sum may also be a
    # finite tensor whose sum overflowed, which the exact per-element check below tells apart
    if bool(torch.isfinite(torch.stack([v.sum() for v in values])).all()):
        return
    finite = torch.stack([torch.isfinite(v).all() for v in values])
    if not bool(finite.all()):
        bad = [name for name, ok in zip(stage.parameter_names(), finite.tolist()) if not ok]
        raise NonFiniteError(
            f"step {step}, stage {stage.index}: the {what} of {', '.join(bad[:5])} is not finite (NaN/inf): "
            "the optimizer step is refused; check the learning rate, max_grad_norm and the data"
        )


def _the_tie(ties: List[Tie], clipping: Clipping) -> Optional[Tie]:
    """The one embedding / head tie pipedp handles across stages, under flat clipping."""
    if not ties:
        return None
    if len(ties) > 1 or not clipping.across_stages:
        raise UnsupportedModelError(
            f"tied weights across stages {[t.owner for t in ties]}: pipedp clips one embedding tied to the head "
            "exactly under clipping='flat'; untie them (untie_weights=True) for per-stage / per-layer clipping"
        )
    return ties[0]


def _check_optimizer_options(optimizers: List[Optional[torch.optim.Optimizer]]) -> None:
    """An infinite or NaN learning rate (or beta, weight decay...) would wreck every parameter."""
    for opt in optimizers:
        for group in opt.param_groups if opt is not None else []:
            for key, value in group.items():
                values = value if isinstance(value, tuple) else (value,)
                if any(isinstance(v, float) and not math.isfinite(v) for v in values):
                    raise ConfigError(f"optimizer option {key}={value!r} is not finite: give a finite value", key)


def _default_optimizer(params: List[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


class PipelineDPTrainer:
    """DP-SGD with the model split into ``stages`` pipeline stages.

    Each ``step(inputs, targets)`` is one DP-SGD step on one logical batch: per-sample
    gradients of ``loss_fn`` (which returns per-sample losses, shape [n]) are clipped to
    ``max_grad_norm`` with their norm taken over *all* stages, summed, noised with
    N(0, (noise_multiplier * max_grad_norm)^2), divided by ``expected_batch_size``, and
    given to one optimizer per stage. ``clipping="per_stage"`` clips each stage's part on
    its own instead (``max_grad_norm`` a list of per-stage norms, or one norm split as
    C / sqrt(stages)); the noise is then scaled to sqrt(sum C_k^2); ``clipping="per_layer"`` does
    the same per layer.

    Options are the fields of ``PipelineConfig`` (stages, microbatches, schedule, schedule_costs,
    microbatch_size, grad_mode, replicas, balance, untie_weights, timeout, transport) and
    ``PrivacyConfig`` (expected_batch_size, noise_multiplier, max_grad_norm, clipping,
    sample_rate, accountant, delta, target_epsilon, total_steps, epochs, max_epsilon,
    secure_mode, seed), passed as keywords or as the config objects themselves.

    With torch.distributed initialised and world size > 1 (or ``transport="distributed"``),
    each rank runs one stage of one data-parallel replica; otherwise every stage runs in
    this process.

    What it changes on the user's model: forward hooks on every layer with trainable
    parameters (removed by ``close()``, on leaving a ``with`` block, or when the trainer is
    garbage-collected); with processes, the other stages' weights are moved to the meta
    device on each rank; ``untie_weights=True`` gives a tied head its own parameter.
    """

    def __init__(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        optimizer: OptimizerFactory = _default_optimizer,
        *,
        pipeline: Optional[PipelineConfig] = None,
        privacy: Optional[PrivacyConfig] = None,
        **options: Any,
    ):
        pipeline_options, privacy_options = split_options(options)
        pipeline = dataclasses.replace(pipeline or PipelineConfig(), **pipeline_options).validate()
        privacy = dataclasses.replace(privacy or PrivacyConfig(), **privacy_options).validate()
        if privacy.target_epsilon is not None:
            sample_rate, steps = privacy.sample_rate, privacy.planned_steps()
            assert sample_rate is not None and steps is not None  # validate() requires both
            sigma = calibrate_noise(privacy.target_epsilon, privacy.delta, sample_rate, steps, privacy.accountant)
            privacy = dataclasses.replace(privacy, noise_multiplier=sigma)
        self.pipeline, self.privacy = pipeline, privacy
        action_costs = (
            None if pipeline.schedule_costs is None else dict(zip((Kind.F, Kind.I, Kind.W), pipeline.schedule_costs))
        )
        self.schedule = schedules.build(pipeline.schedule, pipeline.stages, pipeline.microbatches, action_costs)
        schedules.validate(self.schedule)
        validate_model(model)
        if pipeline.precision == "bf16-true":
            model.to(torch.bfloat16)  # the user's model itself: its weights train in bf16
        self.model = model
        self.last_batch_size = 0
        self.last_dropped_samples = 0  # samples of the last step left out for a non-finite gradient norm
        self._budget: Optional[int] = None

        blocks = model_blocks(model, pipeline.untie_weights)
        costs = block_costs(blocks, pipeline.balance)
        stage_blocks = partition(blocks, pipeline.stages, pipeline.balance, costs)
        layers = [name for stage in stage_blocks for name in block_units(stage)]
        self.clipping = Clipping.make(privacy.clipping, privacy.max_grad_norm, pipeline.stages, layers)
        tie = _the_tie(find_ties(stage_blocks), self.clipping)
        self.partition_report = report(stage_blocks, costs, cost_unit(pipeline.balance))
        self.runtime: Runtime = create_runtime(
            pipeline,
            self.schedule,
            self.clipping,
            stage_blocks,
            loss_fn,
            self.run_config(),
            list(model.state_dict().keys()),
            tie,
        )
        self._finalizer = weakref.finalize(self, self.runtime.close)  # hooks off when the trainer goes
        self.state = TrainingState(
            step=0,
            accountant=create_accountant(mechanism=privacy.accountant),
            # a stage with nothing to train (e.g. a frozen embedding) gets no optimizer
            optimizers=[
                optimizer(stage.parameters) if stage.parameters else None for stage in self.runtime.local_stages
            ],
        )
        _check_optimizer_options(self.state.optimizers)

    # ---- one DP-SGD step ---------------------------------------------------------------------
    def step(self, inputs: Inputs, targets: torch.Tensor) -> float:
        """One DP-SGD step on a logical batch of any size >= 0; returns its mean loss
        (NaN for an empty batch, whose update is noise only). ``inputs``: a tensor, or a dict of
        batch-first tensors such as ``{"input_ids": .., "attention_mask": ..}``."""
        n = check_batch(inputs, targets)
        self.last_batch_size = n
        self.check_budget()
        self.runtime.check_same_batch(inputs, targets)
        pipeline = self.pipeline
        mine = replica_rows(n, pipeline.replicas, self.runtime.replica)
        inputs, targets = take(inputs, mine), targets[mine]
        totals = torch.zeros(2, dtype=torch.float64)  # loss sum, samples left out for a non-finite norm
        for part in plan_passes(batch_rows(inputs), pipeline.microbatches, pipeline.microbatch_size):
            size = microbatch_size_for(part.stop - part.start, pipeline.microbatches, pipeline.microbatch_size)
            batch = make_pass(take(inputs, part), targets[part], pipeline.microbatches, size)
            totals = totals + self.runtime.run_pass(batch)
        self._apply_update()
        if self.privacy.sample_rate is not None:
            self.state.accountant.step(
                noise_multiplier=self.privacy.noise_multiplier, sample_rate=self.privacy.sample_rate
            )
        self.state.step += 1
        loss_sum, dropped = (float(v) for v in self.runtime.total(totals))
        self.last_dropped_samples = int(dropped)
        if dropped:
            warnings.warn(
                f"step {self.state.step}: {int(dropped)} sample(s) had a non-finite gradient norm "
                "(NaN/inf input or loss) and were left out of the update (clip factor 0)",
                stacklevel=2,
            )
        return loss_sum / n if n else math.nan

    def _apply_update(self) -> None:
        std = self.privacy.noise_multiplier * self.clipping.sensitivity
        stages = self.runtime.local_stages
        for stage in stages:  # every stage's update is set and checked before any optimizer steps
            grads = stage.take_clipped_sum()
            if self.runtime.replica == 0:  # noise once, before the sum over replicas
                grads = self._noised(stage, grads, std)
            grads = self.runtime.combine_tied(stage, grads)  # a tied embedding / head: both parts, noised once
            grads = self.runtime.sum_over_replicas(grads)
            for p, g in zip(stage.parameters, grads):
                p.grad = (g / self.privacy.expected_batch_size).to(p.dtype)
            _check_finite(stage, [p.grad for p in stage.parameters], self.state.step + 1, "noisy clipped gradient")
        for stage, opt in zip(stages, self.state.optimizers):
            if opt is None:  # nothing to train on this stage
                continue
            opt.step()
            opt.zero_grad(set_to_none=True)
            _check_finite(stage, list(stage.parameters), self.state.step + 1, "value after the optimizer step")

    def _noised(self, stage: Any, grads: List[torch.Tensor], std: float) -> List[torch.Tensor]:
        """grads + the stage's noise, except where another stage adds it (a tied head's copy)."""
        keep = [k for k in range(len(grads)) if k not in stage.noise_free]
        noised = add_noise(
            [grads[k] for k in keep], std, self.privacy.seed, self.state.step, stage.index, self.privacy.secure_mode
        )
        out = list(grads)
        for k, g in zip(keep, noised):
            out[k] = g
        return out

    # ---- configuration as the checks see it ---------------------------------------------------
    def run_config(self) -> Dict[str, Any]:
        """What every rank of a run must agree on: every option, the model's signature and its split
        (measured costs differ between ranks; a different split on one rank would run blocks twice)."""
        return {
            **describe(self.pipeline),
            **describe(self.privacy),
            "model": model_signature(self.model),
            "blocks per stage": self.partition_report.blocks_per_stage,
        }

    def resume_config(self) -> Dict[str, Any]:
        """What a checkpoint and its resumption must agree on: the options that shape the update."""
        return {
            **describe(self.pipeline, only_resume=True),
            **describe(self.privacy, only_resume=True),
            "model": model_signature(self.model),
        }

    # ---- state and privacy --------------------------------------------------------------------
    @property
    def steps_taken(self) -> int:
        return self.state.step

    @property
    def noise_multiplier(self) -> float:
        """sigma (calibrated from target_epsilon when one was given)."""
        return self.privacy.noise_multiplier

    def state_dict(self) -> Optional[Dict[str, torch.Tensor]]:
        """The whole model's state dict with its original names (multi-process: on rank 0; None elsewhere)."""
        return self.runtime.gather_state()

    def save_pretrained(self, path: str) -> None:
        """Write a Hugging Face folder (for a PeftModel: the adapter folder) that
        ``from_pretrained`` loads as the trained model. Every rank calls it; rank 0 writes."""
        save_pretrained(self.model, self.runtime.gather_state(), path)

    def check_budget(self) -> None:
        """Raise PrivacyBudgetExceeded if one more step would spend more than max_epsilon."""
        privacy = self.privacy
        if privacy.max_epsilon is None:
            return
        if self._budget is None:
            assert privacy.sample_rate is not None  # validate() requires it with max_epsilon
            self._budget = steps_within_budget(
                privacy.max_epsilon, privacy.delta, privacy.noise_multiplier, privacy.sample_rate, privacy.accountant
            )
        if self.state.step + 1 > self._budget:
            raise PrivacyBudgetExceeded(
                f"step {self.state.step + 1} would exceed max_epsilon={privacy.max_epsilon} at delta={privacy.delta}: "
                f"{self.state.step} steps spent epsilon {self.epsilon(privacy.delta):.4f} and the budget allows "
                f"{self._budget} steps at noise_multiplier={privacy.noise_multiplier:.4f}, "
                f"sample_rate={privacy.sample_rate}"
            )

    def epsilon(self, delta: float = 1e-5) -> float:
        if self.privacy.sample_rate is None:
            raise PipeDPError(
                "epsilon() needs the Poisson sample rate: pass sample_rate=q (expected batch size / "
                "dataset size) to PipelineDPTrainer"
            )
        return spent_epsilon(self.state.accountant, delta)

    # ---- the training loop and checkpoints ----------------------------------------------------
    def fit(self, dataset, **kwargs: Any) -> FitResult:
        """Poisson-sampled DP training over ``dataset``; see pipedp.train.loop.fit for the arguments."""
        return fit(self, dataset, **kwargs)

    def save_checkpoint(
        self, directory: str, key: Union[str, bytes, None] = None, keep_last: Optional[int] = None
    ) -> None:
        """Every rank calls this. ``key`` (or PIPEDP_CHECKPOINT_KEY) signs the manifest;
        ``keep_last`` keeps only the newest step folders."""
        checkpoint.save(
            directory,
            self.state,
            self.runtime,
            self.resume_config(),
            self.pipeline.stages,
            checkpoint.resolve_key(key),
            keep_last,
        )

    def load_checkpoint(self, directory: str, key: Union[str, bytes, None] = None) -> None:
        """The newest checkpoint in ``directory``; with a key, only a manifest signed with it."""
        checkpoint.load(directory, self.state, self.runtime, self.resume_config(), checkpoint.resolve_key(key))

    # ---- leaving the user's model as it was ---------------------------------------------------
    def close(self) -> None:
        """Remove pipedp's hooks from the model (the trainer cannot step afterwards)."""
        self._finalizer()

    def __enter__(self) -> "PipelineDPTrainer":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()
