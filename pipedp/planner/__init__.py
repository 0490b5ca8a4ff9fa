"""The memory planner (``pipedp plan``): each stage's predicted peak memory, and the largest micro-batch that fits.

``static`` (what a stage holds whatever the batch), ``tracker`` (the bytes operations allocate), ``simulate`` (a pass
on fake tensors through the real stages and executors, counted by an executor observer), ``report`` (profiles, their
composition along the schedule, the plan and its text), ``estimate`` (the entry point: the model prepared as the
trainer prepares it, the search for the largest micro-batch that fits).

Layer 5: above the trainer (it prepares a run as the trainer does) and the runtime (it runs it on fake tensors);
never ``cli``.
"""

from .estimate import Setup, estimate, largest_fit
from .report import Plan, StagePlan, format_plan

__all__ = ["Plan", "Setup", "StagePlan", "estimate", "format_plan", "largest_fit"]
