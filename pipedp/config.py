"""The one typed configuration of a run: how the model is pipelined, and its privacy.

Every option the trainer, the rank-agreement check and the checkpoint check know is a field
here, written once, with its help text, its choices and whether it is a CLI flag (the command
line's own job options, its data, optimizer and run folder, are fields of pipedp/cli/options.py). ``validate()`` is the one place where options are checked; ``FitConfig.planned_steps`` is
the one rule for the run's length (``steps`` or ``epochs``). The classes are frozen: a resolved option
(e.g. the calibrated noise multiplier) is a new object, made with ``dataclasses.replace``.

Layer: bottom. Imports only ``pipedp.errors`` and the pure ``schedules`` package.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Dict, Optional, Sequence, Tuple, Union

import schedules

from .errors import ConfigError

GRAD_MODES = ("auto", "ghost", "materialize", "keep")
CLIPPING_MODES = ("flat", "per_stage", "per_layer")
ACCOUNTANTS = ("prv", "rdp", "gdp")
TRANSPORTS = ("auto", "inprocess", "distributed")
PRECISIONS = ("32", "bf16-mixed", "bf16-true")
SAMPLINGS = ("poisson", "shuffle")
TINY_GPT = "tiny-gpt"  # the built-in model's name (pipedp train and plan): a GPT of this shape over UTF-8 bytes
TINY_GPT_SHAPE = dict(d_model=64, n_heads=4, n_layers=4)
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

    # resume=False where the update does not depend on the option: the noise is drawn per parameter and the
    # norms are summed over every stage, so a run may resume on another split, schedule or micro-batch count
    stages: int = option(2, "pipeline stages (processes per replica)")
    microbatches: int = option(4, "micro-batches per pipeline pass")
    schedule: str = option("1f1b", "pipeline schedule", choices=sorted(schedules.BUILDERS))
    schedule_costs: Optional[Tuple[float, float, float]] = option(
        None,
        "relative costs of F, I and W that the cost-aware schedules (dp-zb) place actions by "
        "(default equal; python -m bench.schedule_sim measures them)",
        cli=False,
    )
    microbatch_size: Optional[int] = option(
        None, "static micro-batch size; a larger logical batch runs as several passes (virtual steps)"
    )
    grad_mode: str = option(
        "auto",
        "how each layer gets its per-sample norms and clipped sum: auto (each layer the way a cost model of "
        "multiply-adds and memory traffic says is cheapest), ghost (Gram matrices where cheaper), materialize, or keep (every "
        "Linear's and LayerNorm's per-sample gradients computed once in I and held until W: micro-batch size x "
        "those parameters of memory per micro-batch between I and W)",
        choices=GRAD_MODES,
    )
    keep_memory_ratio: float = option(
        1.0,
        "auto, ghost, materialize: keep a layer's per-sample gradients from I to W only while they take at most "
        "this many times the memory of the captures they free (1: never more memory; 0: never keep)",
    )
    replicas: int = option(1, "data-parallel replicas (world size = stages x replicas x tensor_parallel)")
    shard_optimizer: bool = option(
        False,
        "ZeRO stage 1 over the replicas: each replica owns whole parameters (balanced by size), receives only their "
        "clipped sums, adds their noise, keeps their optimizer state and steps them, then sends them to the other "
        "replicas; the update is the unsharded one, each rank's optimizer state about 1/replicas of it",
    )
    tensor_parallel: int = option(
        1,
        "tensor-parallel ranks per stage: a Hugging Face decoder's attention heads, MLP widths, vocabulary and "
        "head split across them (transformers' own plan), exact as on one rank",
    )
    precision: str = option(
        "32",
        "32: as the model is; bf16-mixed: bf16 autocast forward, float32 weights, "
        "optimizer and per-sample arithmetic; bf16-true: the model in bf16 (weights, "
        "optimizer), per-sample arithmetic in float32",
        choices=PRECISIONS,
        resume=True,
    )
    activation_checkpointing: bool = option(
        False,
        "recompute each block's intermediate activations in the backward (torch.utils.checkpoint, non-reentrant): "
        "less memory per in-flight micro-batch for one more forward per block; the inputs of layers with trainable "
        "parameters are kept either way (per-sample gradients need them)",
    )
    devices: Optional[Tuple[str, ...]] = option(
        None,
        "in one process, each stage's device (e.g. ('cuda:0', 'cuda:1'): a micro-batched split across GPUs, as a "
        "device_map split but pipelined); its blocks are moved there and its micro-batches and messages follow. "
        "Across processes each rank uses its backend's device",
        cli=False,
    )
    device: str = option(
        "auto",
        "where the stages run: auto (pipedp train: one process per stage, each on its own GPU over NCCL, when there "
        "are as many GPUs as ranks; every stage in one process spread over fewer GPUs; the CPU over gloo without "
        "a GPU. The Python API: where the model is, or the backend's device across processes), cpu (forces the "
        "CPU) or cuda (refused where a stage would not be on a GPU; across processes over gloo, ranks sharing a GPU, "
        "their tensors crossing through host memory)",
        choices=("auto", "cpu", "cuda"),
    )
    balance: Balance = option(
        "compute",
        "how blocks are grouped into stages: 'compute' (multiply-adds per token: an embedding is a lookup), "
        "'params', 'uniform', a list of block costs or pipedp.measured_costs(sample)",
        cli=False,
    )
    untie_weights: bool = option(
        False,
        "give a head tied to the input embedding its own copy (by default a tie across stages is trained exactly)",
    )
    self_check: bool = option(
        True,
        "at the first step of each input shape, compare the per-sample gradients of a few samples with each "
        "sample's gradient computed alone, and refuse the model, naming the layers, if they differ (a layer that "
        "does not see the batch first, a parameter used outside its module, a wrong layer rule)",
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
        at_least(self, "stages", 1)
        at_least(self, "microbatches", 1)
        at_least(self, "replicas", 1)
        at_least(self, "tensor_parallel", 1)
        if self.microbatch_size is not None:
            at_least(self, "microbatch_size", 1)
        one_of(self, "schedule", schedules.canonical_name(self.schedule))
        if self.schedule_costs is not None and (
            len(self.schedule_costs) != 3
            or not all(isinstance(c, (int, float)) and math.isfinite(c) and c >= 0 for c in self.schedule_costs)
        ):
            raise ConfigError(
                f"schedule_costs: three finite costs (F, I, W) >= 0, got {self.schedule_costs!r}", "schedule_costs"
            )
        one_of(self, "grad_mode")
        one_of(self, "transport")
        one_of(self, "device")
        if self.device != "auto" and any(not str(d).startswith(self.device) for d in self.devices or ()):
            raise ConfigError(f"device {self.device!r} but devices {list(self.devices or ())}: drop one", "device")
        if self.devices is not None and len(self.devices) != self.stages:
            raise ConfigError(f"devices: one per stage ({self.stages}), got {list(self.devices)}", "devices")
        one_of(self, "precision")
        finite(self, "timeout", minimum=0.0, strict=True)
        finite(self, "keep_memory_ratio", minimum=0.0)
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
        "clipping norm C (per_stage / per_layer: split as C/sqrt(stages) / C/sqrt(layers); the Python API also "
        "takes one norm per stage as a tuple, or a {layer name: C} dict)",
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
    sampling: Optional[str] = option(
        None,
        "how the batches given to step() are drawn: 'poisson' (each record independently with probability "
        "sample_rate, as fit() and Opacus's DPDataLoader draw them: accounted with subsampling amplification) or "
        "'shuffle' (each epoch a random permutation cut into batches of expected_batch_size: each record in one "
        "step per epoch, accounted without amplification); unset, step() accounts every step as if it held every "
        "record (no amplification), and fit() draws Poisson batches",
        choices=SAMPLINGS,
        resume=True,
    )
    dataset_size: Optional[int] = option(
        None,
        "records (privacy units) in the training data: delta must be below 1/dataset_size; fit() sets it from its data",
        cli=False,
    )
    unit_rows: int = option(
        1,
        "rows per privacy unit: the batch's rows come in consecutive groups of this size, each group one unit (e.g. "
        "one user's records: user-level DP), sampled, clipped and counted as one; fill a unit with fewer records "
        "with rows whose loss is zero (all labels -100). sample_rate, expected_batch_size and dataset_size count units",
        cli=False,
        resume=True,
    )
    accountant: str = option("prv", "Opacus accountant", choices=ACCOUNTANTS, resume=True)
    delta: float = option(1e-5, "target delta of the (epsilon, delta) guarantee")
    target_epsilon: Optional[float] = option(
        None,
        "calibrate noise_multiplier to reach this epsilon at the end of the run (FitConfig's steps or epochs, "
        "given to the trainer; the CLI's --steps or --epochs)",
        exclusive="noise",
    )
    max_epsilon: Optional[float] = option(None, "budget guard: stop before a step would exceed this epsilon")
    secure_mode: bool = option(False, "noise and sampling from the OS CSPRNG (not reproducible)")
    seed: Optional[int] = option(
        None,
        "seed of the noise and sampling streams; unset (the default): a secret one drawn from the OS's entropy and "
        "kept in the checkpoint only. A given seed makes the run reproducible, and anyone who learns it can "
        "regenerate the noise and strip it (no privacy left): keep it secret",
        resume=True,
    )
    enabled: bool = option(
        True,
        "False: the same pipeline without clipping or noise (a non-private baseline for utility comparisons): no "
        "step is charged and epsilon is infinite",
        cli=False,  # pipedp train's --disable-dp
        resume=True,
    )

    def validate(self) -> "PrivacyConfig":
        if self.expected_batch_size is None:
            raise ConfigError(
                "expected_batch_size is required: the clipped sum is divided by it (Opacus "
                "semantics); pass the expected logical batch size, e.g. sample_rate * dataset size",
                "expected_batch_size",
            )
        at_least(self, "expected_batch_size", 1)
        finite(self, "noise_multiplier", minimum=0.0)
        norms = (
            self.max_grad_norm
            if isinstance(self.max_grad_norm, (tuple, list))
            else (tuple(self.max_grad_norm.values()) if isinstance(self.max_grad_norm, dict) else (self.max_grad_norm,))
        )
        for c in norms:
            if not (isinstance(c, (int, float)) and math.isfinite(c) and c > 0):
                raise ConfigError(f"max_grad_norm: must be > 0 and finite, got {self.max_grad_norm}", "max_grad_norm")
        one_of(self, "clipping")
        one_of(self, "accountant")
        at_least(self, "unit_rows", 1)
        if self.seed is not None:
            at_least(self, "seed", 0)
        if self.sample_rate is not None and not (math.isfinite(self.sample_rate) and 0 < self.sample_rate <= 1):
            raise ConfigError(f"sample_rate: must be in (0, 1], got {self.sample_rate}", "sample_rate")
        if not (math.isfinite(self.delta) and 0 < self.delta < 1):
            raise ConfigError(f"delta: must be in (0, 1), got {self.delta}", "delta")
        if self.sampling is not None:
            one_of(self, "sampling")
        if self.dataset_size is not None:
            at_least(self, "dataset_size", 1)
            if self.enabled and self.delta >= 1 / self.dataset_size:
                raise ConfigError(
                    f"delta: {self.delta:g} is not below 1/N = 1/{self.dataset_size} (N records): a mechanism that "
                    "publishes one random record in full meets such a delta; use delta well below 1/N (e.g. "
                    f"{_suggested_delta(self.dataset_size):g})",
                    "delta",
                )
        if self.sampling == "shuffle" and self.secure_mode:
            raise ConfigError(
                "sampling='shuffle' with secure_mode: an epoch's permutation must be redrawn identically on every "
                "rank and after a resume, which OS randomness cannot; use sampling='poisson' with secure_mode",
                "sampling",
            )

        for name in ("target_epsilon", "max_epsilon"):
            if getattr(self, name) is not None:
                finite(self, name, minimum=0.0, strict=True)
            if getattr(self, name) is not None and not self.enabled:
                raise ConfigError(f"{name}: a run with DP disabled (enabled=False) spends no epsilon: drop it", name)
        if self.max_epsilon is not None and self.sample_rate is None and self.sampling == "poisson":
            raise ConfigError(
                "max_epsilon needs sample_rate (the Poisson rate) to account the privacy spent", "max_epsilon"
            )
        if self.sampling == "poisson" and self.sample_rate is None:
            raise ConfigError(
                "sampling='poisson' needs sample_rate (the probability each record is in a batch) to account the "
                "steps: pass sample_rate = expected batch size / records",
                "sampling",
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
        return self

    def public_seed(self) -> int:
        """The seed of what needs no secrecy (the model's and LoRA's initialisation, the evaluation split, the
        generated corpus): the given seed, else 0. Never the noise's or the sampling's (privacy/streams.py run_seed)."""
        return self.seed if self.seed is not None else 0


@dataclass(frozen=True)
class FitConfig:
    """How ``fit`` runs: its length, its checkpoints and its batch cap (the mechanism is PrivacyConfig's)."""

    steps: Optional[int] = option(None, "total DP steps, including those before a resume", exclusive="length")
    epochs: Optional[float] = option(
        None,
        "epochs: ceil(epochs / sample_rate) Poisson steps, or ceil(epochs x ceil(N / batch)) shuffled ones",
        exclusive="length",
    )
    checkpoint_dir: Optional[str] = option(None, "save checkpoints here; the folder is locked while training")
    checkpoint_every: Optional[int] = option(None, "steps between checkpoints (default: only at the end)")
    resume: bool = option(False, "continue from the newest checkpoint in checkpoint_dir, as if never stopped")
    max_logical_batch: Optional[int] = option(
        None, "cap each sampled batch at this many records (truncated Poisson: adds to delta, reported)"
    )
    checkpoint_key: Optional[str] = option(
        None, "HMAC key that signs the checkpoints and refuses unsigned or altered ones (or PIPEDP_CHECKPOINT_KEY)"
    )
    keep_last: Optional[int] = option(None, "keep only the newest N checkpoints")

    def validate(self) -> "FitConfig":
        if (self.steps is None) == (self.epochs is None):
            raise ConfigError("fit() takes exactly one of steps or epochs", "steps")
        if self.steps is not None:
            at_least(self, "steps", 1)
        if self.epochs is not None:
            finite(self, "epochs", minimum=0.0, strict=True)
        for name in ("checkpoint_every", "max_logical_batch", "keep_last"):
            if getattr(self, name) is not None:
                at_least(self, name, 1)
        if self.resume and self.checkpoint_dir is None:
            raise ConfigError("resume needs checkpoint_dir", "resume")
        return self

    def planned_steps(self, privacy: PrivacyConfig) -> int:
        """The steps of the run, the one rule the calibration, fit() and the CLI use: ``steps``; or for
        ``epochs``, ceil(epochs / sample_rate) Poisson steps, or with PrivacyConfig.sampling='shuffle'
        ceil(epochs x steps_per_epoch) shuffled steps (a fractional epoch runs its first batches)."""
        if self.steps is not None:
            return self.steps
        if self.epochs is None:
            raise ConfigError("the run length is not given: pass steps= or epochs= (FitConfig)", "steps")
        if privacy.sampling == "shuffle":
            if privacy.dataset_size is None or privacy.expected_batch_size is None:
                raise ConfigError(
                    "epochs of shuffled batches need dataset_size and expected_batch_size (an epoch is "
                    "ceil(dataset_size / expected_batch_size) steps; fit() sets dataset_size from its data)",
                    "dataset_size",
                )
            per_epoch = steps_per_epoch(privacy.dataset_size, privacy.expected_batch_size)
            return max(1, math.ceil(self.epochs * per_epoch - 1e-9))
        if privacy.sample_rate is None:
            raise ConfigError("epochs of Poisson batches need sample_rate to turn epochs into steps", "epochs")
        return steps_for_epochs(self.epochs, privacy.sample_rate)


def _suggested_delta(records: int) -> float:
    """A delta well below 1/N: the largest power of ten at most 1/(10 N)."""
    return 10.0 ** math.floor(math.log10(1 / (10 * records)))


def steps_for_epochs(epochs: float, sample_rate: float) -> int:
    """Poisson steps in ``epochs`` epochs: ceil(epochs / q), each step seeing q of the data on average.

    The one rule used by the calibration, the fit loop and the CLI. The tiny tolerance
    keeps float noise (2 / 0.02 = 100.00000000000001) from adding a step.
    """
    return max(1, math.ceil(epochs / sample_rate - 1e-9))


def steps_per_epoch(num_examples: int, batch_size: int) -> int:
    """Shuffled batches of one epoch: ceil(N / B) (the last one holds the rest)."""
    return max(1, math.ceil(num_examples / batch_size))


def split_options(options: Dict[str, Any]) -> Tuple[Dict[str, Any], ...]:
    """Sort keyword options into (PipelineConfig, PrivacyConfig, FitConfig fields); refuse unknown ones."""
    if "total_steps" in options:
        raise TypeError("total_steps: the run length is FitConfig's: pass steps= (or epochs=) instead")
    names = [{f.name for f in fields(cls)} for cls in (PipelineConfig, PrivacyConfig, FitConfig)]
    unknown = sorted(set(options).difference(*names))
    if unknown:
        raise TypeError(
            f"unknown option(s) {unknown}: PipelineDPTrainer takes the fields of PipelineConfig {sorted(names[0])}, "
            f"PrivacyConfig {sorted(names[1])} and FitConfig {sorted(names[2])}"
        )
    return tuple({k: v for k, v in options.items() if k in group} for group in names)


def describe(config: Any, only_resume: bool = False) -> Dict[str, Any]:
    """The config as plain JSON-able values (for the rank check and the checkpoint manifest)."""
    out = {}
    for f in fields(config):
        if only_resume and not f.metadata["resume"]:
            continue
        if only_resume and f.name == "enabled" and config.enabled:  # checkpoints made before the field stay valid
            continue
        value = getattr(config, f.name)
        if isinstance(value, tuple):
            value = list(value)
        elif value is not None and not isinstance(value, (bool, int, float, str, list, dict)):
            describe_rule = getattr(value, "describe", None)  # a balance rule: by name
            value = describe_rule() if describe_rule is not None else type(value).__name__
        out[f.name] = value
    return out


# ---- checks shared by the config classes (here and pipedp/cli/options.py) -----------------------------
def at_least(config: Any, name: str, minimum: int) -> None:
    value = getattr(config, name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name}: must be an integer, got {value!r}", name)
    if value < minimum:
        raise ConfigError(f"{name}: must be >= {minimum}, got {value!r}", name)


def finite(config: Any, name: str, minimum: float, strict: bool = False) -> None:
    value = getattr(config, name)
    ok = isinstance(value, (int, float)) and math.isfinite(value) and (value > minimum if strict else value >= minimum)
    if not ok:
        raise ConfigError(f"{name}: must be {'>' if strict else '>='} {minimum:g} and finite, got {value!r}", name)


def one_of(config: Any, name: str, value: Any = None) -> None:
    value = getattr(config, name) if value is None else value
    choices = next(f.metadata["choices"] for f in fields(config) if f.name == name)
    if value not in choices:
        raise ConfigError(f"unknown {name} {getattr(config, name)!r}: choose one of {list(choices)}", name)
