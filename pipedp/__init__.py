"""pipedp: DP-SGD on micro-batched pipeline-parallel models."""
from .errors import (
    BatchError,
    CheckpointError,
    ConfigMismatchError,
    PartitionError,
    PipeDPError,
    PrivacyBudgetExceeded,
    RankFailedError,
    TransportError,
    UnsupportedModelError,
)
from .trainer import PipelineDPTrainer

__all__ = [
    "PipelineDPTrainer",
    "PipeDPError", "UnsupportedModelError", "PartitionError", "BatchError", "ConfigMismatchError",
    "RankFailedError", "TransportError", "PrivacyBudgetExceeded", "CheckpointError",
]
__version__ = "0.1.0"
