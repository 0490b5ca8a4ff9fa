"""The one typed configuration of a run: how the model is pipelined, and its privacy.

Every option the trainer, the CLI, the rank-agreement check and the checkpoint check know
is a field here, written once, with its help text, its choices and whether it is a CLI
flag. ``validate()`` is the one place where options are checked; ``steps_for_epochs`` is
the one rule that turns epochs into steps. Both classes are frozen: a resolved option
(e.g. the calibrated noise multiplier) is a new object, made with ``dataclasses.replace``.

Layer: bottom. Imports only ``pipedp.errors`` and the pure ``schedules`` package.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Dict, Optional, Sequence, Tuple, Union

import schedules

from .errors import ConfigError

GRAD_MODES = ("ghost", "materialize", "keep")
CLIPPING_MODES = ("flat", "per_stage", "per_layer")
ACCOUNTANTS = ("prv", "rdp", "gdp")
TRANSPORTS = ("auto", "inprocess", "distributed")
PRECISIONS = ("32", "bf16-mixed", "bf16-true")
MAX_TARGET_EPSILON = 100.0  # calibrating beyond it is meaningless, and prv's search slows to minutes

# "params", "uniform", a list of per-block costs, or a function of the blocks returning one
Balance = Union[str, Sequence[float], Callable[[Sequence[Any]], Sequence[float]]]


def option(
    default: Any,
    help: str,
    *,
    choices: Optional[Sequence[str]] = None,
    cli: bool = True,
    exclusive: Optional[str] = None,
    resume: bool = False,
) -> Any:
    """A config field with what the CLI and the checks need to know of it.

    cli: generate a ``--flag`` for it; exclusive: flags of one group are mutually exclusive;
    resume: a checkpoint may only be resumed with the same value (it shapes the update).
    """
    meta = {
        "help": help,
        "choices": tuple(choices) if choices else None,
        "cli": cli,
        "exclusive": exclusive,
        "resume": resume,
    }
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class PipelineConfig:
    """How the model is split and driven through the pipeline."""

    stages: int = option(2, "pipeline stages (processes per replica)", resume=True)
    microbatches: int = option(4, "micro-batches per pipeline pass", resume=True)
    schedule: str = option("1f1b", "pipeline schedule", choices=sorted(schedules.BUILDERS), resume=True)
    schedule_costs: Optional[Tuple[float, float, float]] = option(
        None,
        "relative costs of F, I and W that the cost-aware schedules (dp-zb) place actions by "
        "(default equal; python -m bench.schedule_sim measures them)",
        cli=False,
        resume=True,
    )
    microbatch_size: Optional[int] = option(
        None, "static micro-batch size; a larger logical batch runs as several passes (virtual steps)"
    )
    grad_mode: str = option(
        "ghost",
        "per-sample norms: ghost (Gram matrices where cheaper), materialize, or keep (every Linear's and "
        "LayerNorm's per-sample gradients computed once in I and held until W: fastest, and micro-batch size x "
        "those parameters of memory per micro-batch between I and W)",
        choices=GRAD_MODES,
        resume=True,
    )
    replicas: int = option(1, "data-parallel replicas (world size = stages x replicas)", resume=True)
    precision: str = option(
        "32",
        "32: as the model is; bf16-mixed: bf16 autocast forward, float32 weights, "
        "optimizer and per-sample arithmetic; bf16-true: the model in bf16 (weights, "
        "optimizer), per-sample arithmetic in float32",
        choices=PRECISIONS,
        resume=True,
    )
    balance: Balance = option(
        "params",
        "how blocks are grouped into stages: 'params', 'uniform', a list of "
        "block costs or pipedp.measured_costs(sample)",
        cli=False,
    )
    untie_weights: bool = option(
        False,
        "give a head tied to the input embedding its own copy (by default a tie across stages is trained exactly)",
    )
    timeout: float = option(
        300.0,
        "seconds one operation between ranks (a receive, a collective) may wait; past it "
        "the run stops and names the rank that stopped answering",
    )
    transport: str = option(
        "auto",
        "'auto' (distributed when torch.distributed runs with world size > 1), 'inprocess' or 'distributed'",
        choices=TRANSPORTS,
        cli=False,
    )

    def validate(self) -> "PipelineConfig":
        _at_least(self, "stages", 1)
        _at_least(self, "microbatches", 1)
        _at_least(self, "replicas", 1)
        if self.microbatch_size is not None:
            _at_least(self, "microbatch_size", 1)
        _one_of(self, "schedule", schedules.canonical_name(self.schedule))
        if self.schedule_costs is not None and (
            len(self.schedule_costs) != 3
            or not all(isinstance(c, (int, float)) and math.isfinite(c) and c >= 0 for c in self.schedule_costs)
        ):
            raise ConfigError(
                f"schedule_costs: three finite costs (F, I, W) >= 0, got {self.schedule_costs!r}", "schedule_costs"
            )
        _one_of(self, "grad_mode")
        _one_of(self, "transport")
        _one_of(self, "precision")
        _finite(self, "timeout", minimum=0.0, strict=True)
        return self


@dataclass(frozen=True)
class PrivacyConfig:
    """The DP-SGD mechanism (Opacus semantics) and its accounting."""

    expected_batch_size: Optional[int] = option(
        None, "the clipped sum is divided by this (Opacus semantics); required", cli=False, resume=True
    )
    noise_multiplier: float = option(1.0, "sigma: noise std = sigma * max_grad_norm", exclusive="noise", resume=True)
    max_grad_norm: Union[float, Tuple[float, ...], Dict[str, float]] = option(
        1.0,
        "clipping norm C (per_stage: split as C/sqrt(stages), or one per stage; per_layer: split as "
        "C/sqrt(layers), or a {layer name: C} dict)",
        resume=True,
    )
    clipping: str = option(
        "flat",
        "flat: one norm over all stages; per_stage / per_layer: each stage / layer "
        "clips its own part (no cross-stage norm sum)",
        choices=CLIPPING_MODES,
        resume=True,
    )
    sample_rate: Optional[float] = option(None, "Poisson rate q, for sampling and accounting", cli=False, resume=True)
    accountant: str = option("prv", "Opacus accountant", choices=ACCOUNTANTS, resume=True)
    delta: float = option(1e-5, "target delta of the (epsilon, delta) guarantee")
    target_epsilon: Optional[float] = option(
        None, "calibrate noise_multiplier to reach this epsilon after total_steps (or epochs)", exclusive="noise"
    )
    total_steps: Optional[int] = option(None, "steps the calibration plans for", cli=False)
    epochs: Optional[float] = option(None, "epochs the calibration plans for (steps = ceil(epochs / q))", cli=False)
    max_epsilon: Optional[float] = option(None, "budget guard: stop before a step would exceed this epsilon")
    secure_mode: bool = option(False, "noise and sampling from the OS CSPRNG (not reproducible)")
    seed: int = option(0, "seed of the noise and sampling streams", resume=True)

    def validate(self) -> "PrivacyConfig":
        if self.expected_batch_size is None:
            raise ConfigError(
                "expected_batch_size is required: the clipped sum is divided by it (Opacus "
                "semantics); pass the expected logical batch size, e.g. sample_rate * dataset size",
                "expected_batch_size",
            )
        _at_least(self, "expected_batch_size", 1)
        _finite(self, "noise_multiplier", minimum=0.0)
        norms = (
            self.max_grad_norm
            if isinstance(self.max_grad_norm, (tuple, list))
            else (tuple(self.max_grad_norm.values()) if isinstance(self.max_grad_norm, dict) else (self.max_grad_norm,))
        )
        for c in norms:
            if not (isinstance(c, (int, float)) and math.isfinite(c) and c > 0):
                raise ConfigError(f"max_grad_norm: must be > 0 and finite, got {self.max_grad_norm}", "max_grad_norm")
        _one_of(self, "clipping")
        _one_of(self, "accountant")
        if self.sample_rate is not None and not (math.isfinite(self.sample_rate) and 0 < self.sample_rate <= 1):
            raise ConfigError(f"sample_rate: must be in (0, 1], got {self.sample_rate}", "sample_rate")
        if not (math.isfinite(self.delta) and 0 < self.delta < 1):
            raise ConfigError(f"delta: must be in (0, 1), got {self.delta}", "delta")
        for name in ("target_epsilon", "max_epsilon", "epochs"):
            if getattr(self, name) is not None:
                _finite(self, name, minimum=0.0, strict=True)
        if self.total_steps is not None:
            _at_least(self, "total_steps", 1)
        if self.max_epsilon is not None and self.sample_rate is None:
            raise ConfigError(
                "max_epsilon needs sample_rate (the Poisson rate) to account the privacy spent", "max_epsilon"
            )
        if self.target_epsilon is not None:
            if self.target_epsilon > MAX_TARGET_EPSILON:
                raise ConfigError(
                    f"target_epsilon: {self.target_epsilon:g} is above {MAX_TARGET_EPSILON:g}, where no meaningful "
                    "privacy is left (and Opacus's prv calibration takes minutes): aim lower, or give "
                    "noise_multiplier directly",
                    "target_epsilon",
                )
            if self.sample_rate is None:
                raise ConfigError(
                    "target_epsilon needs sample_rate (the Poisson rate) to calibrate the noise", "target_epsilon"
                )
            if (self.total_steps is None) == (self.epochs is None):
                raise ConfigError(
                    "target_epsilon needs exactly one of total_steps or epochs to calibrate the noise", "target_epsilon"
                )
        return self

    def planned_steps(self) -> Optional[int]:
        """The steps the noise calibration plans for (None without a target epsilon)."""
        if self.total_steps is not None:
            return self.total_steps
        if self.epochs is not None and self.sample_rate is not None:
            return steps_for_epochs(self.epochs, self.sample_rate)
        return None


def steps_for_epochs(epochs: float, sample_rate: float) -> int:
    """Poisson steps in ``epochs`` epochs: ceil(epochs / q), each step seeing q of the data on average.

    The one rule used by the calibration, the fit loop and the CLI. The tiny tolerance
    keeps float noise (2 / 0.02 = 100.00000000000001) from adding a step.
    """
    return max(1, math.ceil(epochs / sample_rate - 1e-9))


def split_options(options: Dict[str, Any]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """Sort keyword options into (PipelineConfig fields, PrivacyConfig fields); refuse unknown ones."""
    pipeline_names = {f.name for f in fields(PipelineConfig)}
    privacy_names = {f.name for f in fields(PrivacyConfig)}
    unknown = sorted(set(options) - pipeline_names - privacy_names)
    if unknown:
        raise TypeError(
            f"unknown option(s) {unknown}: PipelineDPTrainer takes the fields of PipelineConfig "
            f"{sorted(pipeline_names)} and PrivacyConfig {sorted(privacy_names)}"
        )
    return (
        {k: v for k, v in options.items() if k in pipeline_names},
        {k: v for k, v in options.items() if k in privacy_names},
    )


def describe(config: Any, only_resume: bool = False) -> Dict[str, Any]:
    """The config as plain JSON-able values (for the rank check and the checkpoint manifest)."""
    out = {}
    for f in fields(config):
        if only_resume and not f.metadata["resume"]:
            continue
        value = getattr(config, f.name)
        if isinstance(value, tuple):
            value = list(value)
        elif value is not None and not isinstance(value, (bool, int, float, str, list, dict)):
            describe_rule = getattr(value, "describe", None)  # a balance rule: by name
            value = describe_rule() if describe_rule is not None else type(value).__name__
        out[f.name] = value
    return out


# ---- checks shared by the two classes ---------------------------------------------------------
def _at_least(config: Any, name: str, minimum: int) -> None:
    value = getattr(config, name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name}: must be an integer, got {value!r}", name)
    if value < minimum:
        raise ConfigError(f"{name}: must be >= {minimum}, got {value!r}", name)


def _finite(config: Any, name: str, minimum: float, strict: bool = False) -> None:
    value = getattr(config, name)
    ok = isinstance(value, (int, float)) and math.isfinite(value) and (value > minimum if strict else value >= minimum)
    if not ok:
        raise ConfigError(f"{name}: must be {'>' if strict else '>='} {minimum:g} and finite, got {value!r}", name)


def _one_of(config: Any, name: str, value: Any = None) -> None:
    value = getattr(config, name) if value is None else value
    choices = next(f.metadata["choices"] for f in fields(config) if f.name == name)
    if value not in choices:
        raise ConfigError(f"unknown {name} {getattr(config, name)!r}: choose one of {list(choices)}", name)
