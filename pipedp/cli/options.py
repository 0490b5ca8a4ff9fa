"""``pipedp train``'s own options: the job the command line runs around the trainer (its model, data, optimizer
and run folder), as config fields like the trainer's (pipedp/config.py), each with its flag's help, its help group
and what a change of it does to a resumed run. The Python API takes none of these: it is given a model, data and
optimizers.

Each field is written once, here: cli/flags.py makes its flag, cli/record.py its place in RUN/config.toml and its
rule on --resume. Imports no torch (``--help`` stays fast).
"""

from __future__ import annotations

import argparse
import enum
import math
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Optional, Sequence, Tuple

from ..config import FitConfig, PipelineConfig, PrivacyConfig, at_least, finite, one_of, option
from ..errors import ConfigError


class OnResume(enum.Enum):
    """What changing an option does to a resumed run (RunFolder.compare). The trainer's options that shape the
    mechanism are refused by the checkpoint's own check as well (config.option's ``resume``)."""

    SAME_RECORDS = (True, "the resumed run must train the same model on the same records")
    SAME_PRIVACY = (True, "a private run and a non-private one cannot continue each other")
    FROM_HERE_ON = (False, "applies from the resumed step on; the privacy accounting is unaffected")
    FREE = (False, "does not change the update")
    NOT_COMPARED = (False, "run control: not recorded in config.json")

    @property
    def refused(self) -> bool:
        return self.value[0]

    @property
    def reason(self) -> str:
        return self.value[1]


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be > 0 and finite, got {value}")
    return value


def job_option(
    default: Any,
    help: str,
    *,
    group: str,
    on_resume: OnResume = OnResume.FREE,
    parse: Optional[Callable[[str], Any]] = None,
    metavar: Optional[str] = None,
    choices: Optional[Sequence[str]] = None,
    exclusive: Optional[str] = None,
    newer_than_records: bool = False,
) -> Any:
    """A config.option with what only the command line needs: its ``--help`` group, its rule on --resume, and
    ``parse`` / ``metavar`` for argparse (a flag refused while parsing, e.g. a batch size of 0).

    newer_than_records: a refused-on-resume flag that early run records lack (they ran at its default); any other
    refused flag missing from a record is a damaged record, and refused as a change."""
    base = option(default, help, choices=choices, exclusive=exclusive)
    extra = {
        "group": group,
        "on_resume": on_resume,
        "parse": parse,
        "metavar": metavar,
        "newer_than_records": newer_than_records,
    }
    return field(default=default, metadata={**base.metadata, **extra})


def on_resume(f: Any) -> OnResume:
    """A field's rule on --resume (the trainer's own options: FREE here; the checkpoint refuses those that shape
    the mechanism)."""
    return f.metadata.get("on_resume", OnResume.FREE)


STRATEGIES = ("steps", "epoch", "no")  # Hugging Face's eval_strategy / save_strategy values
FORMATS = ("auto", "text", "instruction", "chat")
PRIVACY_UNITS = ("record", "user")
OPTIMIZERS = ("adamw", "adam", "sgd")
LR_SCHEDULES = ("constant", "linear", "cosine")
NO_DECAY_KINDS = ("bias", "norm", "embedding")
data_option = partial(job_option, group="data", on_resume=OnResume.SAME_RECORDS)
optimizer_option = partial(job_option, group="optimization", on_resume=OnResume.FROM_HERE_ON)


@dataclass(frozen=True)
class DataConfig:
    """What ``pipedp train`` trains on: where the records come from, how one becomes a row, and the privacy unit."""

    data: Optional[str] = data_option(
        None,
        "training records: a .txt file (one record per line), a .jsonl / .json / .csv / .parquet file of records, "
        "or a folder written by datasets' save_to_disk (one split); default: the generated corpus",
    )
    format: str = data_option(
        "auto",
        "record format: text (the --text-field column), instruction (prompt + completion: trains on the completion "
        "only), chat (messages, rendered with the tokenizer's chat template: trains on the assistant turns only), "
        "or auto (from the first record's fields)",
        choices=FORMATS,
    )
    text_field: str = data_option("text", "the field holding a text record's text")
    seq_len: Optional[int] = data_option(
        None,
        "tokens per row: each record is one row, truncated or right-padded to this length (default: 36 for "
        "tiny-gpt; for a Hugging Face model, from the training records' token lengths: see docs/cli.md)",
    )
    privacy_unit: str = data_option(
        "record",
        "what DP protects: record (each record is one sample, sampled and clipped alone) or user (every record of "
        "one --user-field value forms one unit, sampled and clipped as one: user-level DP)",
        choices=PRIVACY_UNITS,
    )
    user_field: Optional[str] = data_option(None, "the field naming a record's user (with --privacy-unit user)")
    max_records_per_user: Optional[int] = data_option(
        None, "rows per user unit (--privacy-unit user): a user's first K records; fewer are padded with empty rows"
    )
    eval_data: Optional[str] = data_option(
        None,
        "evaluation records (any --data source); their loss is published without noise",
        exclusive="eval",
        on_resume=OnResume.FREE,
    )
    eval_fraction: Optional[float] = data_option(
        None,
        "hold out this fraction of the privacy units for evaluation (seeded); their loss is not differentially private",
        exclusive="eval",
    )
    eval_every: Optional[int] = data_option(
        None, "steps between evaluations (default: only at the end)", on_resume=OnResume.FREE
    )
    cache_dir: Optional[str] = data_option(
        None,
        "where tokenised data is cached, keyed by a hash of the data, tokenizer and options (default: RUN/data-cache)",
        on_resume=OnResume.FREE,
    )

    def validate(self) -> "DataConfig":
        one_of(self, "format")
        one_of(self, "privacy_unit")
        if self.seq_len is not None:
            at_least(self, "seq_len", 1)
        if not self.text_field:
            raise ConfigError("text_field: must name a field, got ''", "text_field")
        if self.privacy_unit == "user":
            if not self.user_field:
                raise ConfigError(
                    "privacy_unit: 'user' needs user_field, the field that names each record's user", "privacy_unit"
                )
            if self.max_records_per_user is None:
                raise ConfigError(
                    "privacy_unit: 'user' needs max_records_per_user K: each user's unit is K rows (the user's first K "
                    "records, padded with empty rows), so that every unit has the same sensitivity",
                    "privacy_unit",
                )
        elif self.user_field is not None or self.max_records_per_user is not None:
            name = "user_field" if self.user_field is not None else "max_records_per_user"
            raise ConfigError(f"{name}: only with privacy_unit 'user' (the unit is now one record)", name)
        if self.max_records_per_user is not None:
            at_least(self, "max_records_per_user", 1)
        if self.eval_fraction is not None and not (
            isinstance(self.eval_fraction, (int, float)) and 0 < self.eval_fraction < 1
        ):
            raise ConfigError(f"eval_fraction: must be in (0, 1), got {self.eval_fraction!r}", "eval_fraction")
        if self.eval_every is not None:
            at_least(self, "eval_every", 1)
            if self.eval_data is None and self.eval_fraction is None:
                raise ConfigError("eval_every: give evaluation data (eval_data or eval_fraction)", "eval_every")
        return self


@dataclass(frozen=True)
class OptimizerConfig:
    """The optimizer every stage builds for its own parameters, and its learning-rate schedule."""

    optimizer: str = optimizer_option(
        "adamw",
        "adamw (decoupled weight decay), adam (weight decay added to the gradient), both torch's fused kernel on "
        "CPU and CUDA, or sgd",
        choices=OPTIMIZERS,
        on_resume=OnResume.SAME_RECORDS,  # a stage's optimizer state is of its kind
    )
    lr: float = optimizer_option(3e-3, "learning rate (the peak, after any warmup)")
    weight_decay: float = optimizer_option(0.0, "weight decay, except on the parameter kinds of --no-decay")
    no_decay: str = optimizer_option(
        "bias,norm,embedding",
        "parameters without weight decay, comma-separated kinds: bias, norm (LayerNorm / RMSNorm / GroupNorm "
        "weights), embedding; '' decays every parameter",
    )
    momentum: float = optimizer_option(0.0, "SGD momentum")
    adam_beta1: float = optimizer_option(0.9, "Adam(W) beta1")
    adam_beta2: float = optimizer_option(0.999, "Adam(W) beta2")
    adam_epsilon: float = optimizer_option(1e-8, "Adam(W) epsilon")
    lr_schedule: str = optimizer_option(
        "constant", "constant, or linear / cosine decay to 0 at the last step (after any warmup)", choices=LR_SCHEDULES
    )
    warmup_steps: Optional[int] = optimizer_option(
        None, "steps of linear warmup: step s (from 0) uses lr x (s + 1) / warmup", exclusive="warmup"
    )
    warmup_ratio: Optional[float] = optimizer_option(
        None, "warmup as a fraction of the total steps", exclusive="warmup"
    )

    def validate(self) -> "OptimizerConfig":
        one_of(self, "optimizer")
        one_of(self, "lr_schedule")
        finite(self, "lr", minimum=0.0, strict=True)
        for name in ("weight_decay", "momentum", "adam_epsilon"):
            finite(self, name, minimum=0.0)
        for name in ("adam_beta1", "adam_beta2"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 <= value < 1):
                raise ConfigError(f"{name}: must be in [0, 1), got {value!r}", name)
        unknown = [k for k in self.no_decay_kinds() if k not in NO_DECAY_KINDS]
        if unknown:
            raise ConfigError(
                f"no_decay: unknown kind(s) {unknown}: choose among {list(NO_DECAY_KINDS)} (comma-separated)",
                "no_decay",
            )
        if self.warmup_steps is not None:
            at_least(self, "warmup_steps", 0)
        if self.warmup_ratio is not None and not (
            isinstance(self.warmup_ratio, (int, float)) and 0 <= self.warmup_ratio < 1
        ):
            raise ConfigError(f"warmup_ratio: must be in [0, 1), got {self.warmup_ratio!r}", "warmup_ratio")
        return self

    def no_decay_kinds(self) -> Tuple[str, ...]:
        return tuple(k.strip() for k in self.no_decay.split(",") if k.strip())

    def warmup(self, total_steps: int) -> int:
        """Warmup steps of a run of ``total_steps``."""
        if self.warmup_steps is not None:
            return self.warmup_steps
        if self.warmup_ratio is not None:
            return math.ceil(self.warmup_ratio * total_steps)
        return 0

    def lr_factor(self, step: int, total_steps: int) -> float:
        """The learning rate of step ``step`` (0-based) as a fraction of ``lr``: (s + 1) / warmup during the
        warmup, then constant, or decayed linearly / along a half cosine to 0 at step ``total_steps``
        (never 0 at a step that runs)."""
        warmup = self.warmup(total_steps)
        if step < warmup:
            return (step + 1) / warmup
        if self.lr_schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        if self.lr_schedule == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass(frozen=True)
class JobConfig:
    """What ``pipedp train`` trains and writes: the model, LoRA, the batch, the export, and whether it is private."""

    model: str = job_option(
        "tiny-gpt",
        "'tiny-gpt' (built in) or a local Hugging Face model folder (nothing is downloaded)",
        group="model",
        on_resume=OnResume.SAME_RECORDS,
    )
    lora_r: Optional[int] = job_option(
        None,
        "PEFT LoRA adapters of this rank (base weights frozen); needs a Hugging Face --model",
        group="model",
        on_resume=OnResume.SAME_RECORDS,
        parse=positive_int,
    )
    lora_targets: str = job_option(
        "q_proj,v_proj",
        "comma-separated module names LoRA adapts (GPT-2: c_attn), or an expert bank's weights "
        "(experts.gate_up_proj, experts.down_proj)",
        group="model",
        on_resume=OnResume.SAME_RECORDS,
    )
    export: Optional[str] = job_option(
        None,
        "after training, write the Hugging Face model (config + safetensors + tokenizer; with --lora-r the "
        "adapter folder, naming its base model by absolute path) to this folder; a folder holding files is refused "
        "without --overwrite",
        group="model",
    )
    export_merged: Optional[str] = job_option(
        None,
        "with --lora-r: after training, write the whole model with the adapter merged into its weights (config "
        "+ safetensors + tokenizer: loads without peft) to this folder; rank 0 loads the full base model to merge",
        group="model",
        metavar="DIR",
    )
    disable_dp: bool = job_option(
        False,
        "a non-private baseline: the same pipeline without clipping or noise (epsilon is infinite; no "
        "accountant charge), for utility comparisons",
        group="privacy",
        on_resume=OnResume.SAME_PRIVACY,
        newer_than_records=True,
    )
    sample_rate: Optional[float] = job_option(
        None, "Poisson sampling rate q", group="optimization", parse=positive_float, exclusive="rate"
    )
    batch_size: int = job_option(
        32,
        "expected logical batch size in privacy units (q = B / N)",
        group="optimization",
        parse=positive_int,
        exclusive="rate",
    )
    no_checkpoint: bool = job_option(
        False,
        "save no checkpoints (the run cannot be resumed); the run's config, metrics and plot still go to "
        "--checkpoint-dir",
        group="run",
    )


@dataclass(frozen=True)
class RunConfig:
    """How ``pipedp train`` runs its job: evaluation and checkpoint timing, logging, trackers and processes."""

    eval_batch_size: Optional[int] = job_option(
        None,
        "rows per evaluation batch, over the whole pipeline (default --batch-size)",
        group="data",
        parse=positive_int,
    )
    eval_strategy: str = job_option(
        "steps",
        "when to evaluate during training: steps (every --eval-every), epoch (every epoch's steps: ceil(1 / q) "
        "Poisson steps), no (only at the end, when there is evaluation data)",
        group="data",
        choices=STRATEGIES,
    )
    inprocess: bool = job_option(False, "run every stage in this one process (debugging)", group="pipeline")
    threads: int = job_option(1, "torch threads per process", group="pipeline", parse=positive_int)
    overwrite: bool = job_option(
        False,
        "start afresh in a --checkpoint-dir that holds another run: that run is moved aside to DIR.previous-TIME",
        group="run",
        on_resume=OnResume.NOT_COMPARED,
    )
    save_strategy: str = job_option(
        "steps",
        "when to checkpoint: steps (every --checkpoint-every), epoch (every epoch's steps), no (as --no-checkpoint)",
        group="run",
        choices=STRATEGIES,
    )
    report_to: str = job_option(
        "none",
        "also log the metrics to trackers: a comma-separated list of tensorboard (RUN/tensorboard), wandb "
        "(WANDB_MODE=offline works offline), mlflow (MLFLOW_TRACKING_URI, default sqlite:///RUN/mlflow.db); all: "
        "every one installed. Each needs its package",
        group="run",
        metavar="none|all|LIST",
    )
    epsilon_every: Optional[int] = job_option(
        None,
        "steps between epsilon evaluations and progress lines (metrics.jsonl gets every step; default: about "
        "20 per run, and always the last step; the prv accountant takes ~0.1 s each)",
        group="run",
        parse=positive_int,
    )
    no_progress: bool = job_option(False, "no progress bars", group="run", on_resume=OnResume.NOT_COMPARED)


# every class whose fields are pipedp train's flags, as RUN/config.toml's tables (in this order)
TABLES: Tuple[Tuple[str, type], ...] = (
    ("pipeline", PipelineConfig),
    ("privacy", PrivacyConfig),
    ("fit", FitConfig),
    ("data", DataConfig),
    ("optimizer", OptimizerConfig),
    ("job", JobConfig),
    ("run", RunConfig),
)
JOB_CLASSES = tuple(cls for _, cls in TABLES)
