"""Errors pipedp raises. Each message names the problem and how to fix it.

Layer: bottom; imports nothing.
"""


class PipeDPError(Exception):
    """Base class of every error pipedp raises on purpose."""


class ConfigError(PipeDPError, ValueError):
    """An option is out of range or contradicts another; ``field`` names the option."""

    def __init__(self, message: str, field: str = ""):
        super().__init__(message)
        self.field = field


class UnsupportedModelError(PipeDPError, ValueError):
    """The model has a layer or structure DP pipelining cannot handle."""


class PartitionError(PipeDPError, ValueError):
    """The model cannot be split into the requested stages."""


class BatchError(PipeDPError, ValueError):
    """A batch (or what loss_fn returns for it) has the wrong shape or type."""


class ConfigMismatchError(PipeDPError, RuntimeError):
    """Ranks disagree on the configuration of the run."""


class RankFailedError(PipeDPError, RuntimeError):
    """A rank of a multi-process run raised; the message names the rank and the cause."""

    def __init__(self, message: str, rank=None, exitcodes=None):
        super().__init__(message)
        self.rank = rank
        self.exitcodes = exitcodes or []


class TransportError(PipeDPError, RuntimeError):
    """A message between stages was not what the receiver expected."""


class PrivacyBudgetExceeded(PipeDPError, RuntimeError):
    """The next step would spend more privacy than max_epsilon allows."""


class CheckpointError(PipeDPError, RuntimeError):
    """A checkpoint is missing, truncated or does not match the run."""


class NonFiniteError(PipeDPError, FloatingPointError):
    """A clipped sum, its noise or an update is NaN/inf: the optimizer step was refused."""


class AgentLostError(PipeDPError, RuntimeError):
    """The launcher that started this rank (torchrun's agent) died: the rank stops instead of training alone."""


class StepFailedError(PipeDPError, RuntimeError):
    """A step of a multi-process run failed on one rank; every rank raises it, naming that rank and its error.
    ``report``: that rank and its error; ``dropped``: every rank dropped the step together, so the run can go
    on (the next step is the one it would have been); else the ranks are out of step and every later call
    is refused with this error."""

    def __init__(self, message: str, report: str = "", dropped: bool = False):
        super().__init__(message)
        self.report = report or message
        self.dropped = dropped
