"""PipelineDPTrainer: DP-SGD on a micro-batched pipeline, equal to Opacus on one device."""
from __future__ import annotations

import math
from typing import Callable, List, Optional, Sequence, Union

import torch
import torch.nn as nn
from opacus.accountants import create_accountant

import schedules

from .accounting import calibrate_noise, steps_within_budget
from .balance import cost_unit, report
from .errors import PipeDPError, PrivacyBudgetExceeded
from .microbatch import check_batch, make_pass, microbatch_size_for, plan_passes, replica_rows
from .partition import Balance, block_costs, model_blocks, model_signature, partition
from .privacy import Clipping, add_noise
from .runtime import InProcessRuntime
from .stage import Stage
from .validation import validate_model

OptimizerFactory = Callable[[List[nn.Parameter]], torch.optim.Optimizer]


def _default_optimizer(params):
    return torch.optim.SGD(params, lr=0.1)


class PipelineDPTrainer:
    """DP-SGD with the model split into ``stages`` pipeline stages.

    Each ``step(inputs, targets)`` is one DP-SGD step on one logical batch: per-sample
    gradients of ``loss_fn`` (which returns per-sample losses, shape [n]) are clipped to
    ``max_grad_norm`` with their norm taken over *all* stages, summed, noised with
    N(0, (noise_multiplier * max_grad_norm)^2), divided by ``expected_batch_size``, and
    given to one optimizer per stage. ``clipping="per_stage"`` clips each stage's part on
    its own instead (``max_grad_norm`` a list of per-stage norms, or one norm split as
    C / sqrt(stages)); the noise is then scaled to sqrt(sum C_k^2).

    With torch.distributed initialised and world size > 1 (or ``transport="distributed"``),
    each rank runs one stage of one data-parallel replica; otherwise every stage runs in
    this process.
    """

    def __init__(
        self,
        model: nn.Module,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        optimizer: OptimizerFactory = _default_optimizer,
        *,
        stages: int = 2,
        microbatches: int = 4,
        schedule: str = "1f1b",
        noise_multiplier: float = 1.0,
        max_grad_norm: Union[float, Sequence[float]] = 1.0,
        expected_batch_size: int,
        sample_rate: Optional[float] = None,
        grad_mode: str = "ghost",
        seed: int = 0,
        accountant: str = "prv",
        microbatch_size: Optional[int] = None,
        balance: Balance = "params",
        untie_weights: bool = False,
        replicas: int = 1,
        transport: str = "auto",
        secure_mode: bool = False,
        target_epsilon: Optional[float] = None,
        delta: float = 1e-5,
        total_steps: Optional[int] = None,
        epochs: Optional[float] = None,
        max_epsilon: Optional[float] = None,
        clipping: str = "flat",
    ):
        if expected_batch_size is None or expected_batch_size <= 0:
            raise ValueError(f"expected_batch_size must be > 0, got {expected_batch_size}")
        if noise_multiplier < 0:
            raise ValueError(f"noise_multiplier must be >= 0, got {noise_multiplier}")
        if sample_rate is not None and not 0 < sample_rate <= 1:
            raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}")
        if microbatch_size is not None and microbatch_size < 1:
            raise ValueError(f"microbatch_size must be >= 1, got {microbatch_size}")
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        if secure_mode:
            from .secure import require_secure_mode

            require_secure_mode()
        self.clipping = Clipping.make(clipping, max_grad_norm, stages)
        self.schedule = schedules.build(schedule, stages, microbatches)
        schedules.validate(self.schedule)
        validate_model(model)
        self.model = model
        self.stages, self.microbatches, self.replicas = stages, microbatches, replicas
        self.noise_multiplier = float(noise_multiplier)
        self.expected_batch_size, self.sample_rate = expected_batch_size, sample_rate
        self.microbatch_size, self.seed, self.secure_mode = microbatch_size, seed, secure_mode
        self.grad_mode = grad_mode
        self.accountant_name = accountant
        self.accountant = create_accountant(mechanism=accountant)
        self.delta, self.max_epsilon = delta, max_epsilon
        self.steps_taken = 0
        self.last_batch_size = 0
        if target_epsilon is not None:
            self.noise_multiplier = calibrate_noise(target_epsilon, delta, sample_rate, total_steps, epochs, accountant)
        if max_epsilon is not None and sample_rate is None:
            raise PipeDPError("max_epsilon needs sample_rate (the Poisson rate) to account the privacy spent")
        self._budget = None

        blocks = model_blocks(model, untie_weights)
        costs = block_costs(blocks, balance)
        stage_blocks = partition(blocks, stages, balance, costs)
        self.partition_report = report(stage_blocks, costs, cost_unit(balance))
        self.runtime = self._make_runtime(transport, stage_blocks, loss_fn, grad_mode)
        self.optimizers = [optimizer(stage.parameters) for stage in self.runtime.local_stages]

    def _make_runtime(self, transport, stage_blocks, loss_fn, grad_mode):
        import torch.distributed as dist

        distributed = transport == "distributed" or (
            transport == "auto" and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        )
        if transport not in ("auto", "distributed", "inprocess"):
            raise ValueError(f"unknown transport {transport!r}: use 'auto', 'inprocess' or 'distributed'")
        if distributed:
            from .distributed import DistributedRuntime

            return DistributedRuntime.create(self, stage_blocks, loss_fn, grad_mode)
        if self.replicas != 1:
            raise ValueError("replicas > 1 needs one process per (stage, replica): launch with torchrun")
        stages = [
            Stage(i, len(stage_blocks), blocks, loss_fn, grad_mode) for i, blocks in enumerate(stage_blocks)
        ]
        return InProcessRuntime(stages, self.schedule, self.clipping)

    # ---- one DP-SGD step ---------------------------------------------------------------------
    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """One DP-SGD step on a logical batch of any size >= 0; returns its mean loss
        (NaN for an empty batch, whose update is noise only)."""
        n = check_batch(inputs, targets)
        self.last_batch_size = n
        self.check_budget()
        self.runtime.check_same_batch(inputs, targets)
        rows = replica_rows(n, self.replicas, self.runtime.replica)
        inputs, targets = inputs[rows], targets[rows]
        local_n = inputs.shape[0]
        loss_sum = torch.zeros((), dtype=torch.float64)
        for part in plan_passes(local_n, self.microbatches, self.microbatch_size):
            size = microbatch_size_for(part.stop - part.start, self.microbatches, self.microbatch_size)
            batch = make_pass(inputs[part], targets[part], self.microbatches, size)
            loss_sum = loss_sum + self.runtime.run_pass(batch)
        self._apply_update()
        if self.sample_rate is not None:
            self.accountant.step(noise_multiplier=self.noise_multiplier, sample_rate=self.sample_rate)
        self.steps_taken += 1
        total = float(self.runtime.total(loss_sum))
        return total / n if n else math.nan

    def _apply_update(self) -> None:
        std = self.noise_multiplier * self.clipping.sensitivity
        for stage, opt in zip(self.runtime.local_stages, self.optimizers):
            grads = stage.take_clipped_sum()
            if self.runtime.replica == 0:  # noise once, before the sum over replicas
                grads = add_noise(grads, std, self.seed, self.steps_taken, stage.index, self.secure_mode)
            grads = self.runtime.sum_over_replicas(grads)
            for p, g in zip(stage.parameters, grads):
                p.grad = (g / self.expected_batch_size).to(p.dtype)
            opt.step()
            opt.zero_grad(set_to_none=True)

    def run_config(self) -> dict:
        """What must agree between the ranks of a run and between a checkpoint and its resumption."""
        return {
            "stages": self.stages, "replicas": self.replicas, "microbatches": self.microbatches,
            "schedule": self.schedule.name, "grad_mode": self.grad_mode, "noise_multiplier": self.noise_multiplier,
            "clipping": [self.clipping.mode, list(self.clipping.stage_norms)],
            "expected_batch_size": self.expected_batch_size, "sample_rate": self.sample_rate, "seed": self.seed,
            "accountant": self.accountant_name, "model": model_signature(self.model),
        }

    # ---- state and privacy --------------------------------------------------------------------
    def state_dict(self) -> Optional[dict]:
        """The whole model's state dict with its original names (see README for ranks)."""
        return self.runtime.gather_state() if self.runtime.is_distributed else self.model.state_dict()

    def check_budget(self) -> None:
        """Raise PrivacyBudgetExceeded if one more step would spend more than max_epsilon."""
        if self.max_epsilon is None:
            return
        if self._budget is None:
            self._budget = steps_within_budget(
                self.max_epsilon, self.delta, self.noise_multiplier, self.sample_rate, self.accountant_name
            )
        if self.steps_taken + 1 > self._budget:
            raise PrivacyBudgetExceeded(
                f"step {self.steps_taken + 1} would exceed max_epsilon={self.max_epsilon} at delta={self.delta}: "
                f"{self.steps_taken} steps spent epsilon {self.epsilon(self.delta):.4f} and the budget allows "
                f"{self._budget} steps at noise_multiplier={self.noise_multiplier:.4f}, sample_rate={self.sample_rate}"
            )

    # ---- the training loop and checkpoints (see loop.py) -----------------------------------------
    def fit(self, dataset, **kwargs):
        """Poisson-sampled DP training over ``dataset``; see pipedp.loop.fit for the arguments."""
        from .loop import fit

        return fit(self, dataset, **kwargs)

    def save_checkpoint(self, directory: str) -> None:
        from .loop import save_checkpoint

        save_checkpoint(self, directory)

    def load_checkpoint(self, directory: str) -> None:
        from .loop import load_checkpoint

        load_checkpoint(self, directory)

    def epsilon(self, delta: float = 1e-5) -> float:
        if self.sample_rate is None:
            raise PipeDPError(
                "epsilon() needs the Poisson sample rate: pass sample_rate=q (expected batch size / "
                "dataset size) to PipelineDPTrainer"
            )
        if not self.accountant.history:
            return 0.0
        if any(sigma == 0 for sigma, _, _ in self.accountant.history):
            return math.inf  # a step without noise has no finite privacy guarantee
        return float(self.accountant.get_epsilon(delta=delta))
