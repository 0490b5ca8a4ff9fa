"""What a resolved ``pipedp train`` job is: the configs and paths every rank receives (picklable)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from ..config import (  # noqa: F401 - the built-in model's name and shape, as the CLI's modules import them
    TINY_GPT,
    TINY_GPT_SHAPE,
    FitConfig,
    PipelineConfig,
    PrivacyConfig,
)
from .options import DataConfig, OptimizerConfig

TINY_GPT_SEQ_LEN = 36  # its --seq-len default (a Hugging Face model's comes from the data)


@dataclass(frozen=True)
class Model:
    """What the preflight learnt of the model from its structure."""

    name: str  # "tiny-gpt" or a local Hugging Face folder
    vocab_size: int
    blocks: int
    positions: Optional[int] = None  # a Hugging Face model's max_position_embeddings (n_positions), if it says


@dataclass(frozen=True)
class Job:
    """Everything a rank needs, resolved and validated before any process starts: the run's configs
    (the same objects the trainer and fit take) and what only the command line's job knows."""

    pipeline: PipelineConfig
    privacy: PrivacyConfig  # resolved: sample rate, expected batch, dataset size, the calibrated noise
    fit: FitConfig  # resolved: total steps; checkpoint_dir None with --no-checkpoint
    data: DataConfig
    optim: OptimizerConfig
    model: Model
    run_dir: str
    resume: bool
    overwrite: bool
    train_rows: Optional[str]  # the cache file of the tokenised training rows
    eval_rows: Optional[str]  # of the --eval-data rows
    export: Optional[str]
    export_merged: Optional[str]  # the LoRA-merged whole model (cli.export)
    lora_r: Optional[int]
    lora_targets: Tuple[str, ...]
    report_to: Tuple[str, ...]  # the trackers (cli.trackers), () for none
    epsilon_every: int
    eval_batch_size: int
    threads: int
    progress: bool
    inprocess: bool
    resume_notes: Tuple[str, ...] = ()
    privacy_warnings: Tuple[str, ...] = ()  # said before the run and again in its summary (preflight.privacy_warnings)

    @property
    def steps(self) -> int:
        assert self.fit.steps is not None
        return self.fit.steps
