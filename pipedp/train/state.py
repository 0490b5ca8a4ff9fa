"""The state a DP training run carries from step to step, owned by the trainer.

Saved and restored as a whole by checkpoint.py: the step counter, the privacy accountant
(through Opacus's own ``state_dict``), the stages' optimizers and their learning-rate schedulers, and the
root seed of the noise and sampling streams, and how far a shuffled epoch has gone (secret unless the user gave one: it lives here and in the
checkpoints, nowhere else).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional

import torch
from opacus.accountants import IAccountant

from ..privacy.accounting import Charges


@dataclass
class TrainingState:
    step: int  # DP steps taken (the next step's index)
    accountant: IAccountant
    optimizers: List[Optional[torch.optim.Optimizer]]  # per local stage (None: nothing to train there)
    schedulers: List[Optional[Any]] = field(default_factory=list)  # per local stage: an LRScheduler, or None
    seed: int = 0  # the noise's and the sampling's root seed (privacy/streams.py run_seed), the same on every rank
    charges: Charges = field(default_factory=Charges)  # where a shuffled epoch stands (what the next step costs)
    # per local stage, under a sharded optimizer: the replica that owns (noises, steps, keeps the state of) each of
    # its parameters (pipedp.shards.owners); None: every replica steps every parameter
    owners: List[Optional[List[int]]] = field(default_factory=list)
