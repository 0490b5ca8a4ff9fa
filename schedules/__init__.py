"""Pure-Python pipeline schedules for DP-SGD: actions, builders, validator, simulator.

Layer 0: imports nothing of pipedp, torch or torch.distributed. It stays a top-level
package (the design card fixes the folder), so it can be used and tested on its own.
"""

from .actions import ACTIVATIONS, CHANNEL_NAMES, COMMUNICATION_KINDS, COMPUTE_KINDS, GRADIENTS, Action, Kind, Schedule
from .builders import forward_only, gpipe, one_f_one_b
from .registry import BUILDERS, build, canonical_name
from .simulator import DeadlockError, SimResult, simulate
from .validator import ScheduleError, validate
from .zero_bubble import dp_zero_bubble

__all__ = [
    "Action",
    "Kind",
    "Schedule",
    "COMPUTE_KINDS",
    "COMMUNICATION_KINDS",
    "ACTIVATIONS",
    "GRADIENTS",
    "CHANNEL_NAMES",
    "BUILDERS",
    "build",
    "canonical_name",
    "gpipe",
    "forward_only",
    "one_f_one_b",
    "dp_zero_bubble",
    "simulate",
    "SimResult",
    "DeadlockError",
    "validate",
    "ScheduleError",
]
