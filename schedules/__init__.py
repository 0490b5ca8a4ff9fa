"""Pure-Python pipeline schedules for DP-SGD: actions, builders, validator, simulator."""
from .actions import COMM_KINDS, COMPUTE_KINDS, Action, Kind, Schedule
from .builders import BUILDERS, build, gpipe, one_f_one_b
from .simulator import DeadlockError, SimResult, simulate
from .validator import ScheduleError, validate

__all__ = [
    "Action", "Kind", "Schedule", "COMM_KINDS", "COMPUTE_KINDS",
    "BUILDERS", "build", "gpipe", "one_f_one_b",
    "simulate", "SimResult", "DeadlockError",
    "validate", "ScheduleError",
]
