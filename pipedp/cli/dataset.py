"""A rank's rows: read from the tokenisation cache the preflight wrote, grouped into privacy units and split
exactly as the preflight did (deterministic: every rank builds the same tensors)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple

from ..data import UnitGroups, assemble, hold_out, record_units, user_units
from ..data.cache import load
from ..errors import PipeDPError
from .spec import Job

Pair = Tuple[Any, Any]  # (inputs: a tensor or {"input_ids", "attention_mask"}, targets)


@dataclass
class RankData:
    train: Pair
    eval: Optional[Pair]  # None without evaluation data; in units of ``unit_rows`` rows, padded
    eval_rows: int = 0  # the real rows among them
    unit_rows: int = 1


def _rows(path: Optional[str]):
    rows = load(path) if path else None
    if rows is None:
        raise PipeDPError(f"the tokenised rows {path!r} are missing or unreadable: run the job again to rebuild them")
    return rows


def _inputs(job: Job, ids, mask):
    """The built-in model takes the ids (its padding is on the right, after every real token: causal
    attention never reads it); Hugging Face models the ids and the attention mask."""
    return ids if job.model.name == "tiny-gpt" else {"input_ids": ids, "attention_mask": mask}


def rank_data(job: Job) -> RankData:
    rows = _rows(job.train_rows)
    data = job.data
    units = user_units(rows, job.privacy.unit_rows) if data.privacy_unit == "user" else record_units(rows)
    train_units, held = hold_out(len(units), data.eval_fraction, job.privacy.public_seed())
    ids, labels, mask = assemble(rows, units, train_units)
    train = (_inputs(job, ids, mask), labels)
    if held:
        source, real = rows, [r for u in held for r in units.rows[u]]
    elif job.eval_rows is not None:
        source = _rows(job.eval_rows)
        real = list(range(source.rows))
    else:
        return RankData(train, None)
    # evaluation counts rows, whatever the unit: real rows in groups of unit_rows, the last group padded
    # (the trainer evaluates whole units; a padding row's loss is 0, so the rows' mean loss comes out exact)
    k = units.unit_rows
    groups = UnitGroups([real[i : i + k] for i in range(0, len(real), k)], k, {})
    ids, labels, mask = assemble(source, groups, list(range(len(groups))))
    return RankData(train, (_inputs(job, ids, mask), labels), len(real), k)
