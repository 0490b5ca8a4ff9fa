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
import platform
import warnings
import weakref
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, Union

import torch
import torch.nn as nn
from opacus.accountants import create_accountant

import schedules
from schedules import Kind

from .. import shards
from ..config import SAMPLINGS, FitConfig, PipelineConfig, PrivacyConfig, describe, split_options
from ..errors import ConfigError, NonFiniteError, PrivacyBudgetExceeded
from ..privacy.accounting import BudgetGuard, calibrated, planned_charges, spent_epsilon
from ..privacy.noise import add_noise
from ..privacy.streams import run_seed
from ..runtime.create import create_runtime
from ..runtime.microbatch import (
    Inputs,
    PassBatch,
    check_batch,
    make_pass,
    microbatch_size_for,
    padding_pass,
    pass_slices,
    replica_rows,
    take,
)
from ..runtime.microbatch import (
    rows as batch_rows,
)
from ..runtime.protocols import Runtime
from ..split.blocks import model_signature
from . import checkpoint
from .export import save_pretrained
from .loop import FitResult, fit
from .narrowing import narrow_in_storage, steps_without_temporaries
from .prepare import prepare, vocab_parallel
from .state import TrainingState

OptimizerFactory = Callable[[List[nn.Parameter]], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]  # e.g. lambda opt: LambdaLR(opt, warmup)
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _check_finite(stage: Any, values: List[Optional[torch.Tensor]], step: int, what: str) -> None:
    """Non-finite values never reach the parameters silently: name the step, stage and parameters
    (one flag per tensor, read back once; None: a parameter another replica steps)."""
    named = [(n, v) for n, v in zip(stage.parameter_names(), values) if v is not None]
    names, tensors = [n for n, _ in named], [v for _, v in named]
    if not tensors:
        return
    # a NaN or inf element makes its tensor's sum non-finite, so finite sums clear every tensor at the
    # cost of one reduction each (10x cheaper than isfinite(v).all()); a non-finite sum may also be a
    # finite tensor whose sum overflowed, which the exact per-element check below tells apart
    if bool(torch.isfinite(torch.stack([v.sum() for v in tensors])).all()):
        return
    finite = torch.stack([torch.isfinite(v).all() for v in tensors])
    if not bool(finite.all()):
        bad = [name for name, ok in zip(names, finite.tolist()) if not ok]
        raise NonFiniteError(
            f"step {step}, stage {stage.index}: the {what} of {', '.join(bad[:5])} is not finite (NaN/inf): "
            "the optimizer step is refused; check the learning rate, max_grad_norm and the data"
        )


def _check_optimizer_options(optimizers: List[Optional[torch.optim.Optimizer]]) -> None:
    """An infinite or NaN learning rate (or beta, weight decay...) would wreck every parameter."""
    for opt in optimizers:
        for group in opt.param_groups if opt is not None else []:
            for key, value in group.items():
                values = value if isinstance(value, tuple) else (value,)
                if any(isinstance(v, float) and not math.isfinite(v) for v in values):
                    raise ConfigError(f"optimizer option {key}={value!r} is not finite: give a finite value", key)


# optimizers whose step treats every coordinate alone: a tensor-parallel slice steps as its part of the whole would
ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop, torch.optim.Adagrad)


def _check_elementwise(optimizers: List[Optional[torch.optim.Optimizer]], tensor_parallel: int) -> None:
    """Under tensor parallelism each rank steps its slices: an optimizer that factors or normalises a whole tensor
    (Adafactor's row and column moments, LAMB's trust ratio, Muon) would step each slice as if it were the whole."""
    for opt in optimizers:
        if tensor_parallel > 1:
            _refuse_unless(
                opt,
                ELEMENTWISE,
                f"tensor_parallel={tensor_parallel}",
                "each rank steps its slices of the split layers, which is the whole tensor's step only for "
                "optimizers that treat every coordinate alone",
                "tensor_parallel=1",
            )


def _refuse_unless(opt: Optional[torch.optim.Optimizer], allowed: tuple, option: str, why: str, off: str) -> None:
    """Refuse an optimizer whose type is not one of ``allowed`` under ``option``, saying why and the way out."""
    if opt is not None and type(opt) not in allowed:
        names = ", ".join(t.__name__ for t in allowed)
        raise ConfigError(
            f"{option} with {type(opt).__name__}: {why} ({names}); use one of them, or {off}", option.split("=")[0]
        )


# optimizers whose step of a parameter reads that parameter's gradient and state alone: under a sharded optimizer
# each replica steps the parameters it owns, which is the whole step only for them (not LBFGS's one search over all)
PER_TENSOR = ELEMENTWISE + (
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.Adadelta,
    torch.optim.Adafactor,
    torch.optim.Rprop,
)


def _shard_optimizers(
    optimizers: List[Optional[torch.optim.Optimizer]], stages: List[Any], replicas: int, replica: int
) -> List[Optional[List[int]]]:
    """ZeRO stage 1: which replica owns each parameter of each stage (pipedp.shards.owners), after refusing an
    optimizer that does not step each tensor alone. The optimizers keep every parameter (their groups and LR
    schedules stay the unsharded run's), but a parameter this replica does not own never gets a gradient, so torch's
    optimizers make no state for it; state made eagerly (Adagrad's) is dropped here."""
    out: List[Optional[List[int]]] = []
    for stage, opt in zip(stages, optimizers):
        _refuse_unless(
            opt,
            PER_TENSOR,
            "shard_optimizer",
            "each replica steps only the parameters it owns, which is the whole step only for optimizers whose step "
            "of a parameter reads its own gradient and state alone",
            "shard_optimizer=False",
        )
        owners = shards.owners([p.numel() * p.element_size() for p in stage.parameters], replicas)
        for p, owner in zip(stage.parameters, owners):
            if opt is not None and owner != replica:
                opt.state.pop(p, None)
        out.append(owners)
    return out


def _warn_if_nothing_can_change(runtime: Runtime, optimizers: List[Optional[torch.optim.Optimizer]]) -> None:
    """Every step is charged epsilon: say so when no step can change the model."""
    if not any(stage.parameters for stage in runtime.local_stages):
        local = "this rank's stage has" if runtime.replicas > 1 or runtime.rank > 0 else "the model has"
        warnings.warn(
            f"{local} no trainable parameter: steps change nothing here but are charged epsilon", stacklevel=3
        )
    groups = [g for opt in optimizers if opt is not None for g in opt.param_groups]
    if groups and all(_too_small(g) for g in groups):
        rates = ", ".join(sorted({f"{g['lr']:g}" for g in groups}))
        warnings.warn(
            f"the learning rate is {rates}: 0, or below the smallest normal number of the parameters' dtype, so "
            "steps change nothing but are charged epsilon",
            stacklevel=3,
        )


def _too_small(group: Dict[str, Any]) -> bool:
    """An lr of 0, or one below the parameters' smallest normal number (it cannot move a weight of normal size)."""
    lr = group.get("lr")
    if not isinstance(lr, (int, float)):
        return False
    tiny = min((torch.finfo(p.dtype).tiny for p in group["params"] if p.is_floating_point()), default=0.0)
    return lr == 0 or abs(lr) < tiny


def _warn_if_slow_bf16(precision: str, devices: List[torch.device]) -> None:
    """On an x86 CPU without AVX-512 torch's bf16 matrix products skip oneDNN for a reference kernel, 40-500x
    slower than float32 (pytorch/pytorch#146508): a 7B-wide bf16 backward takes minutes per micro-batch."""
    if not precision.startswith("bf16") or not any(d.type == "cpu" for d in devices):
        return
    capability = torch.backends.cpu.get_cpu_capability()
    if platform.machine().lower() in ("x86_64", "amd64") and "AVX512" not in capability:
        warnings.warn(
            f"precision {precision!r} on a CPU without AVX-512 (torch's CPU capability: {capability}): torch's bf16 "
            "matrix products run a reference kernel there, 40-500x slower than float32 (pytorch/pytorch#146508); "
            "use precision '32' on this machine, or a CPU with AVX-512 or a GPU for bf16",
            stacklevel=3,
        )


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
    microbatch_size, grad_mode, replicas, balance, untie_weights, timeout, transport),
    ``PrivacyConfig`` (expected_batch_size, noise_multiplier, max_grad_norm, clipping,
    sample_rate, accountant, delta, target_epsilon, max_epsilon, secure_mode, seed) and
    ``FitConfig`` (``fit()``'s defaults: the run length steps or epochs, which target_epsilon
    calibrates for, and the checkpoints), passed as keywords or as the config objects themselves.

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
        scheduler: Optional[SchedulerFactory] = None,
        pipeline: Optional[PipelineConfig] = None,
        privacy: Optional[PrivacyConfig] = None,
        fit_config: Optional[FitConfig] = None,
        **options: Any,
    ):
        pipeline_options, privacy_options, fit_options = split_options(options)
        pipeline = dataclasses.replace(pipeline or PipelineConfig(), **pipeline_options).validate()
        privacy = dataclasses.replace(privacy or PrivacyConfig(), **privacy_options).validate()
        self.fit_config = dataclasses.replace(fit_config or FitConfig(), **fit_options)  # fit()'s defaults
        if self.fit_config.steps is not None or self.fit_config.epochs is not None:
            self.fit_config.validate()
        if privacy.target_epsilon is not None:  # over the charges fit() will make in the run declared here
            privacy = calibrated(privacy, self.fit_config)
        if not privacy.enabled:  # no clipping: the update is the batch gradient, no per-sample gradient to verify
            pipeline = dataclasses.replace(pipeline, self_check=False)
        self.pipeline, self.privacy = pipeline, privacy
        action_costs = (
            None if pipeline.schedule_costs is None else dict(zip((Kind.F, Kind.I, Kind.W), pipeline.schedule_costs))
        )
        self.schedule = schedules.build(pipeline.schedule, pipeline.stages, pipeline.microbatches, action_costs)
        schedules.validate(self.schedule)
        # tensor parallel with pipedp's token loss: the loss on the head's vocabulary slices (no gathered logits)
        split_loss = vocab_parallel(loss_fn, model, pipeline.tensor_parallel)
        loss_fn = split_loss or loss_fn
        prepared = prepare(model, pipeline, privacy, vocab_parallel_loss=split_loss is not None)
        self.model = model
        # the whole model's names, shapes and dtypes: taken before tensor parallelism cuts this rank's slices
        self.signature = model_signature(model)
        self.last_batch_size = 0
        self.last_dropped_samples = 0  # samples of the last step left out for a non-finite gradient norm
        self.last_clipped_fraction = 0.0  # of the last step's samples, those clipped (a diagnostic, not private)
        self._budget: Optional[BudgetGuard] = None
        self._warned_unamplified = self._warned_delta = False
        self.clip, self.units, self.partition_report = prepared.clip, prepared.units, prepared.report
        self.runtime: Runtime = create_runtime(
            pipeline,
            self.schedule,
            self.clip,
            self.units,
            prepared.stage_blocks,
            loss_fn,
            self.agreement(),
            list(model.state_dict().keys()),
            prepared.tie,
            prepared.tensor_parallel_plan,
        )
        self._finalizer = weakref.finalize(self, self.runtime.close)  # hooks off when the trainer goes
        # a stage with nothing to train (e.g. a frozen embedding) gets no optimizer
        optimizers = [optimizer(stage.parameters) if stage.parameters else None for stage in self.runtime.local_stages]
        self.state = TrainingState(
            step=0,
            accountant=create_accountant(mechanism=privacy.accountant),
            optimizers=optimizers,
            schedulers=[scheduler(opt) if scheduler is not None and opt is not None else None for opt in optimizers],
            seed=self.runtime.broadcast(run_seed(privacy.seed)),  # rank 0's draw: the ranks' streams must agree
        )
        if pipeline.shard_optimizer and self.runtime.replicas > 1:
            self.state.owners = _shard_optimizers(
                optimizers, self.runtime.local_stages, self.runtime.replicas, self.runtime.replica
            )
        elif pipeline.shard_optimizer:
            warnings.warn(
                "shard_optimizer with one replica: there is nothing to shard the optimizer over", stacklevel=2
            )
        _check_optimizer_options(self.state.optimizers)
        _check_elementwise(self.state.optimizers, pipeline.tensor_parallel)
        _warn_if_nothing_can_change(self.runtime, self.state.optimizers)
        _warn_if_slow_bf16(pipeline.precision, [stage.device for stage in self.runtime.local_stages])

    # ---- one DP-SGD step ---------------------------------------------------------------------
    def step(self, inputs: Inputs, targets: torch.Tensor, *, sampling: Optional[str] = None) -> float:
        """One DP-SGD step on a logical batch of any size >= 0; returns its mean loss
        (NaN for an empty batch, whose update is noise only). ``inputs``: a tensor, or a dict of
        batch-first tensors such as ``{"input_ids": .., "attention_mask": ..}``. ``sampling``: how
        this batch was drawn ("poisson" or "shuffle"; default ``PrivacyConfig.sampling``), which
        decides what the accountant charges (see pipedp.privacy.accounting). A step that raises
        leaves the trainer as it was before it: the next step is the one it would have been."""
        n = self.units.count(check_batch(inputs, targets))  # privacy units (rows, by default)
        sampling = sampling if sampling is not None else self.privacy.sampling
        charge = self._charge(sampling, n)
        self.last_batch_size = n
        self._check_budget(charge)
        self.runtime.check_same_batch(inputs, targets)
        # loss sum, units left out (non-finite norm), clipped, stages whose self-check was inconclusive
        totals = torch.zeros(4, dtype=torch.float64)
        try:
            self._set_noise()
            for batch in self._passes(inputs, targets):
                totals = totals + self.runtime.run_pass(batch)
            self._apply_update()
        except BaseException as exc:
            self.runtime.abort_step(exc)  # nothing of the failed step stays behind (messages, captures, sums)
            raise
        if charge is not None:
            self.state.accountant.step(noise_multiplier=charge[0], sample_rate=charge[1])
        self.state.charges.record(sampling, self.privacy, n)
        for stage in self.runtime.local_stages:
            self.partition_report.ways.update(stage.ways)
        self.state.step += 1
        loss_sum, dropped, clipped, inconclusive = (float(v) for v in self.runtime.total(totals))
        for stage in self.runtime.local_stages:  # every stage of every replica agrees: the sum is over all ranks
            stage.check.conclude(inconclusive == 0)
        self.last_dropped_samples = int(dropped)
        # a diagnostic computed from the private batch without noise: not itself private
        self.last_clipped_fraction = clipped / n if n else 0.0
        if dropped:
            warnings.warn(
                f"step {self.state.step}: {int(dropped)} sample(s) had a non-finite gradient norm "
                "(NaN/inf input or loss) and were left out of the update (clip factor 0)",
                stacklevel=2,
            )
        return loss_sum / n if n else math.nan

    def _passes(self, inputs: Inputs, targets: torch.Tensor) -> Iterator[PassBatch]:
        """This replica's share of a logical batch, as pipeline passes of static micro-batches holding
        whole privacy units (a larger batch than one pass: several passes, one update)."""
        pipeline, size_of = self.pipeline, self.units.rows
        n = self.units.count(batch_rows(inputs))
        mine = replica_rows(n, pipeline.replicas, self.runtime.replica)  # in units
        rows = slice(mine.start * size_of, mine.stop * size_of)
        own_inputs, own_targets = take(inputs, rows), targets[rows]
        static = pipeline.microbatch_size // size_of if pipeline.microbatch_size is not None else None
        parts = pass_slices(mine.stop - mine.start, pipeline.microbatches, static)
        for part in parts:
            size = microbatch_size_for(part.stop - part.start, pipeline.microbatches, static) * size_of
            span = slice(part.start * size_of, part.stop * size_of)
            yield make_pass(take(own_inputs, span), own_targets[span], pipeline.microbatches, size)
        # every replica runs as many passes as replica 0 (the largest share): a pass's collectives span the replicas
        most = replica_rows(n, pipeline.replicas, 0)
        for _ in range(len(pass_slices(most.stop - most.start, pipeline.microbatches, static)) - len(parts)):
            size = microbatch_size_for(1, pipeline.microbatches, static) * size_of
            yield padding_pass(inputs, targets, pipeline.microbatches, size)

    def _charge(self, sampling: Optional[str], n: Optional[int] = None) -> Optional[Tuple[float, float]]:
        """(noise multiplier, sample rate) the accountant records for the next step (of ``n`` units), or None."""
        if sampling is not None and sampling not in SAMPLINGS:
            raise ConfigError(f"unknown sampling {sampling!r}: choose one of {list(SAMPLINGS)}", "sampling")
        if sampling is None and self.privacy.enabled and not self._warned_unamplified:  # (no DP: nothing accounted)
            self._warned_unamplified = True
            warnings.warn(
                "step() got a batch whose sampling is not declared: each such step is accounted as if it held every "
                "record (no subsampling amplification). Declare PrivacyConfig.sampling='poisson' if your batches "
                "are Poisson-sampled at sample_rate (e.g. Opacus's DPDataLoader), or let fit() draw them",
                stacklevel=3,
            )
        rate = self.state.charges.rate(sampling, self.privacy, n)
        if not self.privacy.enabled:  # no noise: nothing the accountant could bound (epsilon() says inf)
            return None
        return None if rate is None else (self.privacy.noise_multiplier, rate)

    @property
    def _std(self) -> float:
        return self.privacy.noise_multiplier * self.clip.sensitivity if self.privacy.enabled else 0.0

    def _set_noise(self) -> None:
        """Each stage draws this step's noise into its clipped sums before they get their first micro-batch
        (noise.SumNoise: where a pipeline stage waits anyway), where it can (Stage.noises_sums_first)."""
        owners = self.state.owners or [None] * len(self.runtime.local_stages)
        for stage, owner in zip(self.runtime.local_stages, owners):
            stage.set_noise(
                self._std, self.state.seed, self.state.step, self.privacy.secure_mode, self.runtime.replica, owner
            )

    def _apply_update(self) -> None:
        stages, replica, std = self.runtime.local_stages, self.runtime.replica, self._std
        owners = self.state.owners or [None] * len(stages)
        for stage, opt, owner in zip(stages, self.state.optimizers, owners):  # every update set and checked first
            stage.draw_noise()  # (where no pass did: a stage with no action that draws it)
            grads = stage.take_clipped_sum()
            self.runtime.refuse_unequal_whole(stage, grads)  # tensor parallel: a whole tensor is every rank's alike
            if not stage.noises_sums_first:
                self._noised(stage, grads, std, stage.noised_here(replica, owner))
            grads = self.runtime.combine_tied(stage, grads)  # a tied embedding / head: both parts, noised once
            grads = self.runtime.sum_over_replicas(grads, owner)
            grads = self.runtime.broadcast_whole(stage, grads)  # tensor parallel: every rank steps rank 0's
            in_storage = opt is not None and steps_without_temporaries(opt)
            for k, p in enumerate(stage.parameters):
                if owner is not None and owner[k] != replica:  # another replica steps it: no gradient here
                    grads[k] = None
                    continue
                # in place, and each float32 sum dropped once it is the parameter's gradient: a bf16 model's
                # float32 sums and bf16 gradients never exist all at once (narrowing.py: which is less)
                total = grads[k].div_(self.privacy.expected_batch_size)
                p.grad = narrow_in_storage(total, p.dtype) if in_storage else total.to(p.dtype)
                grads[k] = total = None
            _check_finite(stage, [p.grad for p in stage.parameters], self.state.step + 1, "noisy clipped gradient")
        for stage, opt, scheduler, owner in zip(stages, self.state.optimizers, self.state.schedulers, owners):
            if opt is None:  # nothing to train on this stage
                continue
            opt.step()
            opt.zero_grad(set_to_none=True)
            if scheduler is not None:
                scheduler.step()
            if owner is not None:  # sharded: each parameter as its owner stepped it
                self.runtime.share_owned(stage.parameters, owner)
            _check_finite(stage, list(stage.parameters), self.state.step + 1, "value after the optimizer step")

    def _noised(self, stage: Any, grads: List[torch.Tensor], std: float, keep: List[int]) -> None:
        """Add the stage's noise to the clipped sums this rank noises (``keep``: Stage.noised_here) in place; each
        parameter's noise is drawn from its own (step, name) stream, so who draws it does not change it."""
        names = stage.parameter_names()
        slices = stage.tensor_parallel.shards  # a split parameter: its slice of the whole one's noise
        add_noise(
            [grads[k] for k in keep],
            [names[k] for k in keep],
            std,
            self.state.seed,
            self.state.step,
            self.privacy.secure_mode,
            [slices.get(id(stage.parameters[k])) for k in keep],
        )

    # ---- the run as the checks see it: what ranks agree on, what a resume must keep (its identity) ---------------------------------------------------
    def agreement(self) -> Dict[str, Any]:
        """What every rank of a run must agree on: every option, the model's signature and its split
        (measured costs differ between ranks; a different split on one rank would run blocks twice)."""
        return {
            **describe(self.pipeline),
            **describe(self.privacy),
            "model": self.signature,
            "blocks per stage": self.partition_report.blocks_per_stage,
        }

    def identity(self) -> Dict[str, Any]:
        """What a checkpoint and its resumption must agree on: the options that shape the update. The
        split does not (the noise is drawn per parameter, the norms summed over every stage), except
        under per-stage clipping, where each stage's threshold is part of the mechanism."""
        config = {
            **describe(self.pipeline, only_resume=True),
            **describe(self.privacy, only_resume=True),
            "model": self.signature,
        }
        if self.clip.mode == "per_stage":
            config["stages"] = self.pipeline.stages
        return config

    # ---- state and privacy --------------------------------------------------------------------
    @property
    def steps_taken(self) -> int:
        return self.state.step

    @property
    def seed(self) -> int:
        """The root seed of the noise and sampling streams: PrivacyConfig.seed if given, else drawn from the OS's
        entropy at construction (or restored from a checkpoint). Secret: whoever knows it can strip the noise."""
        return self.state.seed

    @property
    def noise_multiplier(self) -> float:
        """sigma (calibrated from target_epsilon when one was given)."""
        return self.privacy.noise_multiplier

    def state_dict(self) -> Optional[Dict[str, torch.Tensor]]:
        """The whole model's state dict with its original names (multi-process: on rank 0; None elsewhere),
        tensors no stage holds (a layer never called) included: ``Model().load_state_dict`` takes it."""
        gathered = self.runtime.gather_state()
        if gathered is None:
            return None
        own = self.model.state_dict()
        return {
            k: gathered[k] if k in gathered else own[k].detach().cpu()
            for k in own
            if k in gathered or not own[k].is_meta
        }

    def evaluate(self, inputs: Inputs, targets: torch.Tensor) -> float:
        """The mean loss of ``loss_fn`` per privacy unit over a batch of any size, through the pipeline with no
        per-sample machinery and no gradient: no privacy is spent by the computation itself, but the
        number it returns is not private if the batch is (see docs/privacy.md)."""
        n = self.units.count(check_batch(inputs, targets))
        if n == 0:
            return math.nan
        self.runtime.check_same_batch(inputs, targets)
        total = torch.zeros(4, dtype=torch.float64)
        try:
            for batch in self._passes(inputs, targets):
                total = total + self.runtime.run_eval(batch)
        except BaseException as exc:
            self.runtime.abort_step(exc)
            raise
        return float(self.runtime.total(total)[0]) / n

    def save_pretrained(self, path: str) -> None:
        """Write a Hugging Face folder (for a PeftModel: the adapter folder) that
        ``from_pretrained`` loads as the trained model. Every rank calls it; rank 0 writes."""
        save_pretrained(self.model, self.state_dict(), path)

    def check_budget(self, sampling: Optional[str] = None) -> None:
        """Raise PrivacyBudgetExceeded if one more step on a batch drawn by ``sampling`` (default
        PrivacyConfig.sampling) would spend more than max_epsilon."""
        self._check_budget(self._charge(sampling if sampling is not None else self.privacy.sampling))

    def _check_budget(self, charge: Optional[Tuple[float, float]]) -> None:
        privacy = self.privacy
        if privacy.max_epsilon is None:
            return
        if self._budget is None:
            self._budget = BudgetGuard(privacy.max_epsilon, privacy.delta, privacy.accountant)
        if not self._budget.allows(list(self.state.accountant.history), charge):
            assert charge is not None
            raise PrivacyBudgetExceeded(
                f"step {self.state.step + 1} would exceed max_epsilon={privacy.max_epsilon} at delta={privacy.delta}: "
                f"{self.state.step} steps spent epsilon {self.epsilon(privacy.delta):.4f}; the next is charged "
                f"noise_multiplier={charge[0]:.4f} at sample rate {charge[1]:g}"
            )

    def epsilon(self, delta: Optional[float] = None) -> float:
        """The epsilon spent so far at ``delta`` (default PrivacyConfig.delta), for the steps as they were
        accounted: never negative; inf once a step had no noise."""
        if not self.privacy.enabled:  # no clipping, no noise: no finite guarantee
            return math.inf
        delta = self.privacy.delta if delta is None else delta
        if self.privacy.dataset_size is not None and delta >= 1 / self.privacy.dataset_size:
            raise ConfigError(
                f"delta {delta:g} is not below 1/N = 1/{self.privacy.dataset_size}: such a delta allows publishing a "
                "random record in full; ask for a delta well below 1/N",
                "delta",
            )
        if self.privacy.dataset_size is None and not self._warned_delta:
            self._warned_delta = True
            warnings.warn(
                "the number of records is unknown, so delta cannot be checked against 1/N (an epsilon at "
                "delta >= 1/N guarantees nothing): pass dataset_size to PipelineDPTrainer, or train with fit()",
                stacklevel=2,
            )
        return spent_epsilon(self.state.accountant, delta)

    def use_dataset(self, records: int) -> None:
        """The training data holds ``records`` privacy units (fit() calls this): delta is checked
        against 1/records, and a shuffled epoch is records / expected_batch_size steps."""
        known = self.privacy.dataset_size
        if known is not None and known != records:
            raise ConfigError(
                f"dataset_size is {known} but the data holds {records} records: pass the data the trainer was "
                "configured for, or fix dataset_size",
                "dataset_size",
            )
        self.privacy = dataclasses.replace(self.privacy, dataset_size=records).validate()

    # ---- the training loop and checkpoints ----------------------------------------------------
    def fit(
        self,
        dataset: Any,
        config: Optional[FitConfig] = None,
        *,
        steps: Optional[int] = None,
        epochs: Optional[float] = None,
        checkpoint_dir: Optional[str] = None,
        checkpoint_every: Optional[int] = None,
        resume: Optional[bool] = None,
        max_logical_batch: Optional[int] = None,
        checkpoint_key: Union[str, bytes, None] = None,
        keep_last: Optional[int] = None,
        callback: Optional[Callable[[int, float, "PipelineDPTrainer"], None]] = None,
    ) -> FitResult:
        """DP training over ``dataset`` ((inputs, targets), a TensorDataset, or a map-style dataset of
        pairs) with pipedp's own sampler: Poisson at sample_rate, or shuffled epochs when
        PrivacyConfig.sampling is 'shuffle'. Options: a FitConfig (default: the trainer's), or its fields as
        keywords (a keyword overrides the config's field; see pipedp.config.FitConfig). With target_epsilon the
        run length is the trainer's, which the noise was calibrated for: another one is refused.
        ``callback(step, loss, trainer)`` runs after every step."""
        given: Dict[str, Any] = dict(
            steps=steps,
            epochs=epochs,
            checkpoint_dir=checkpoint_dir,
            checkpoint_every=checkpoint_every,
            resume=resume,
            max_logical_batch=max_logical_batch,
            checkpoint_key=checkpoint_key,
            keep_last=keep_last,
        )  # tests/unit/test_config.py checks that these are FitConfig's fields, all of them
        base = config or self.fit_config
        if steps is not None or epochs is not None:  # a run length given here replaces the default one
            base = dataclasses.replace(base, steps=None, epochs=None)
        config = dataclasses.replace(base, **{k: v for k, v in given.items() if v is not None}).validate()
        if self.privacy.target_epsilon is not None:
            planned, runs = planned_charges(self.privacy, self.fit_config), planned_charges(self.privacy, config)
            if runs != planned:
                raise ConfigError(
                    f"fit(steps={config.steps}, epochs={config.epochs}) makes {runs[1]} charges at sample rate "
                    f"{runs[0]:g}, but the noise was calibrated to target_epsilon={self.privacy.target_epsilon:g} over "
                    f"{planned[1]} at {planned[0]:g} (the trainer's steps={self.fit_config.steps}, epochs="
                    f"{self.fit_config.epochs}): declare the run length once, to the trainer, and call fit() without it",
                    "steps",
                )
        return fit(self, dataset, config, callback)

    def save_checkpoint(
        self, directory: str, key: Union[str, bytes, None] = None, keep_last: Optional[int] = None
    ) -> None:
        """Every rank calls this. ``key`` (or PIPEDP_CHECKPOINT_KEY) signs the manifest;
        ``keep_last`` keeps only the newest step folders. The first save draws the job's id (a
        loaded checkpoint's is kept): every step folder of this job carries it."""
        self._checkpoint_job = checkpoint.save(
            directory,
            self.state,
            self.runtime,
            self.identity(),
            self.pipeline.stages,
            checkpoint.resolve_key(key),
            keep_last,
            getattr(self, "_checkpoint_job", None),
        )

    def load_checkpoint(self, directory: str, key: Union[str, bytes, None] = None) -> None:
        """The newest checkpoint in ``directory`` (saved on any number of stages or replicas); with a key,
        only if every step folder there is signed with it and of one job."""
        self._checkpoint_job = checkpoint.load(
            directory, self.state, self.runtime, self.identity(), checkpoint.resolve_key(key)
        )

    # ---- leaving the user's model as it was ---------------------------------------------------
    def close(self) -> None:
        """Remove pipedp's hooks from the model (the trainer cannot step afterwards)."""
        self._finalizer()

    def __enter__(self) -> "PipelineDPTrainer":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()
