"""pipedp: DP-SGD on micro-batched pipeline-parallel models.

The public API is what this module exports; everything else is internal. The layers
(each a subpackage, importing only the layers below it; tests/unit/test_architecture.py
checks this):

    errors, config           bottom: errors, the typed configuration
    models, data             bottom: small built-in models, a generated corpus and text windows
    schedules (top level)    pure-Python schedules: actions, builders, validator, simulator
    privacy/                 pure DP math: per-sample norms, clipping, noise, streams, accounting, sampling
    split/                   blocks, adapters (Sequential, pipeline_blocks, HF, graph capture), partition
    runtime/                 capture, stage, executor, transports, in-process / distributed runtimes, launch
    train/                   PipelineDPTrainer, training state, fit loop, checkpoints
    audit/                   the one-run privacy audit
    cli/                     the `pipedp` command

Heavy names (the trainer, torch) load on first use, so `pipedp schedule show` stays light.
"""

from typing import Any

from .config import PipelineConfig, PrivacyConfig
from .errors import (
    AgentLostError,
    BatchError,
    CheckpointError,
    ConfigError,
    ConfigMismatchError,
    NonFiniteError,
    PartitionError,
    PipeDPError,
    PrivacyBudgetExceeded,
    RankFailedError,
    StepFailedError,
    TransportError,
    UnsupportedModelError,
)

_LAZY = {
    "PipelineDPTrainer": ("pipedp.train.trainer", "PipelineDPTrainer"),
    "FitResult": ("pipedp.train.loop", "FitResult"),
    "SplitModel": ("pipedp.split.graph", "SplitModel"),
    "measured_costs": ("pipedp.runtime.measure", "measured_costs"),
    "load_stage": ("pipedp.split.stage_loading", "load_stage"),
    "launch": ("pipedp.runtime.launch", "launch"),
    "init_from_env": ("pipedp.runtime.launch", "init_from_env"),
    "settle_process": ("pipedp.runtime.process", "settle_process"),
}

__all__ = [
    "PipelineDPTrainer",
    "PipelineConfig",
    "PrivacyConfig",
    "FitResult",
    "SplitModel",
    "measured_costs",
    "load_stage",
    "launch",
    "init_from_env",
    "settle_process",
    "PipeDPError",
    "ConfigError",
    "UnsupportedModelError",
    "PartitionError",
    "BatchError",
    "ConfigMismatchError",
    "RankFailedError",
    "StepFailedError",
    "AgentLostError",
    "TransportError",
    "PrivacyBudgetExceeded",
    "CheckpointError",
    "NonFiniteError",
]
__version__ = "0.2.0"


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'pipedp' has no attribute {name!r}")
