"""Optimizer and LR-scheduler state by parameter name, so that a checkpoint loads into any split.

torch keys optimizer state by integer position (``opt.param_groups[*]["params"]`` in order);
pipedp keys it by the model's own parameter name (``Stage.parameter_names()``), keeps each
parameter's param group and the groups' hyperparameters, and rebuilds torch's integer form for
whichever optimizer now holds the parameter. A stage that gathers parameters from several saved
stages takes its LR scheduler's per-group lists (base_lrs, ...) from each parameter's saved group.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ...errors import CheckpointError
from .format import ParamState, StageRecord, decode, encode

_NOT_HYPER = ("params", "param_names")  # a group's members, not its hyperparameters
# how this run's torch computes the step, not what it computes: always this run's own (a checkpoint written
# with fused=None resumes under the CLI's fused kernel, a CUDA run on a device without it)
_IMPLEMENTATION = ("fused", "foreach", "capturable", "differentiable")
_PER_GROUP = ("base_lrs", "_last_lr", "lr_lambdas", "min_lrs", "max_lrs")  # scheduler lists, one entry a group
Source = Tuple[StageRecord, str]  # the saved stage holding a parameter, and the name it is saved under


def export(
    opt: Optional[torch.optim.Optimizer],
    params: List[torch.nn.Parameter],
    names: List[str],
    elsewhere: Optional[Dict[int, Dict[str, Any]]] = None,
) -> Tuple[Optional[List[Dict[str, Any]]], Dict[str, ParamState], List[Tuple[str, torch.Tensor]]]:
    """(group hyperparameters, each parameter's state, the state's tensors keyed for the stage file).
    ``elsewhere``: the state of parameters another replica steps (a sharded optimizer), by id."""
    if opt is None:
        return None, {}, []
    name_of = {id(p): n for p, n in zip(params, names)}
    groups, states, tensors = [], {}, []
    for g, group in enumerate(opt.param_groups):
        groups.append({k: encode(v, f"optimizer option {k!r}") for k, v in group.items() if k not in _NOT_HYPER})
        for p in group["params"]:
            name = name_of.get(id(p))
            if name is None:
                raise CheckpointError(
                    "the optimizer holds a tensor that is not one of its stage's trainable parameters: build it "
                    "from the parameters pipedp passes to the optimizer factory"
                )
            keys, values = {}, {}
            for k, v in (opt.state.get(p) or (elsewhere or {}).get(id(p), {})).items():
                if isinstance(v, torch.Tensor):
                    keys[str(k)] = f"o/{name}/{k}"
                    tensors.append((keys[str(k)], v))
                else:
                    values[str(k)] = encode(v, f"optimizer state {k!r} of {name}")
            states[name] = ParamState(g, keys, values)
    return groups, states, tensors


def torch_state(
    opt: torch.optim.Optimizer,
    params: List[torch.nn.Parameter],
    names: List[str],
    sources: Dict[str, Source],
    read: Callable[[StageRecord, str], torch.Tensor],
) -> Tuple[Dict[str, Any], List[Optional[Tuple[StageRecord, int]]]]:
    """``opt``'s state_dict rebuilt from the checkpoint (tensors read through ``read``), and each of its
    groups' saved (stage, group) — the LR scheduler's per-group source; None for an empty group."""
    name_of = {id(p): n for p, n in zip(params, names)}
    state: Dict[int, Dict[str, Any]] = {}
    groups: List[Dict[str, Any]] = []
    origins: List[Optional[Tuple[StageRecord, int]]] = []
    index = 0
    for group in opt.param_groups:
        hyper: Optional[Dict[str, Any]] = None
        first = ""
        members = []
        for p in group["params"]:
            name = name_of[id(p)]
            record, saved_name = sources[name]
            saved = record.state[saved_name]
            if record.groups is None:
                raise CheckpointError(f"the checkpoint has no optimizer for {name}, which this run trains")
            theirs = record.groups[saved.group]
            if hyper is None:
                hyper, first = theirs, name
                origins.append((record, saved.group))
            elif _canon(_options(theirs)) != _canon(_options(hyper)):
                raise CheckpointError(
                    f"one param group of this run holds {first} and {name}, whose saved optimizer options differ "
                    f"({_diff(hyper, theirs)}): group the parameters as the checkpoint did"
                )
            if set(saved.tensors) | set(saved.values) != _state_keys(record, saved.group):
                raise CheckpointError(
                    f"{record.file}'s optimizer state of {name} holds {sorted(set(saved.tensors) | set(saved.values))}"
                    f", unlike the rest of its param group: the manifest is damaged"
                )
            values = {k: read(record, key) for k, key in saved.tensors.items()}
            values.update(decode(saved.values, f"state of {name}", record.file))
            if values:
                state[index] = values
            members.append(index)
            index += 1
        if hyper is None:  # an empty group (the factory's, for parameters another stage holds): as it is
            origins.append(None)
            groups.append({k: v for k, v in group.items() if k not in _NOT_HYPER} | {"params": []})
            continue
        saved_group = decode(hyper, "param group", "manifest")
        flags = {k: saved_group[k] for k in _IMPLEMENTATION if k in saved_group}
        if any(v is not None and not isinstance(v, bool) for v in flags.values()):  # absent: an older torch
            raise CheckpointError(f"the optimizer flags of {first} are not booleans ({flags}): a damaged manifest")
        options = _options(saved_group)
        _same_kind(options, _options(group), f"the optimizer options of {first}")
        mine = {k: group[k] for k in _IMPLEMENTATION if k in group}
        groups.append({**options, **mine, "params": members})
    return {"state": state, "param_groups": groups}, origins


def _state_keys(record: StageRecord, group: int) -> set:
    """The state keys the first parameter of a saved group has (every parameter of a group steps together)."""
    first = next(s for s in record.state.values() if s.group == group)
    return set(first.tensors) | set(first.values)


def _same_kind(saved: Any, now: Any, where: str) -> None:
    """The saved value has the shape of this run's: the same keys, list lengths and kinds of leaves (any
    number for a number), so that a damaged or foreign value is refused here, not at the next step."""

    def number(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    if number(now) and number(saved):
        return
    if type(saved) is not type(now):
        raise CheckpointError(
            f"{where} is a {type(saved).__name__} in the checkpoint but a {type(now).__name__} in this run: refused"
        )
    if isinstance(now, dict):
        if saved.keys() != now.keys():
            keys = sorted(set(saved) ^ set(now), key=str)[:5]
            raise CheckpointError(f"{where} differ from this run's in {keys}: another optimizer, or a damaged manifest")
        for k in now:
            _same_kind(saved[k], now[k], f"{where}[{k!r}]")
    elif isinstance(now, (list, tuple)):
        if len(saved) != len(now):
            raise CheckpointError(f"{where} has {len(saved)} entries in the checkpoint, {len(now)} in this run")
        for k, (a, b) in enumerate(zip(saved, now)):
            _same_kind(a, b, f"{where}[{k}]")


def scheduler_state(origins: List[Optional[Tuple[StageRecord, int]]], stage: int, current: Dict[str, Any]) -> Any:
    """The LR scheduler's state for a stage whose groups come from ``origins``: the saved stages' states,
    which must agree but for their per-group lists, each entry taken from the group's own saved stage (an
    empty group's from this run's ``current`` state)."""
    states = {rec.index: rec.scheduler for rec, _ in filter(None, origins)}
    if not states:
        return current
    assert all(s is not None for s in states.values())  # store._plan checked
    sources = [None if o is None else (o[0].index, o[1]) for o in origins]
    saved = decode(_regroup(states, sources, current, "scheduler"), "scheduler", "manifest")
    _same_kind(saved, current, f"the LR scheduler state of stage {stage}")
    return saved


def _regroup(states: Dict[int, Any], sources: List[Optional[Tuple[int, int]]], current: Any, where: str) -> Any:
    first = next(iter(states.values()))
    if isinstance(first, dict) and all(isinstance(s, dict) and s.keys() == first.keys() for s in states.values()):
        out = {}
        for k in first:
            values = {r: s[k] for r, s in states.items()}
            now = current.get(k) if isinstance(current, dict) else None
            if k in _PER_GROUP and all(isinstance(v, list) for v in values.values()) and isinstance(now, list):
                try:
                    out[k] = [now[g] if src is None else values[src[0]][src[1]] for g, src in enumerate(sources)]
                except IndexError:
                    raise CheckpointError(f"the checkpoint's {where}.{k} has fewer entries than param groups") from None
            else:
                out[k] = _regroup(values, sources, now, f"{where}.{k}")
        return out
    if isinstance(first, list) and all(isinstance(s, list) and len(s) == len(first) for s in states.values()):
        now = current if isinstance(current, list) and len(current) == len(first) else [None] * len(first)
        return [
            _regroup({r: s[i] for r, s in states.items()}, sources, now[i], f"{where}[{i}]") for i in range(len(first))
        ]
    if any(_canon(s) != _canon(first) for s in states.values()):
        raise CheckpointError(
            f"this stage gathers parameters from saved stages {sorted(states)}, whose LR schedulers differ in "
            f"{where}: they cannot become one scheduler"
        )
    return first


def _options(group: Dict[str, Any]) -> Dict[str, Any]:
    """A group's hyperparameters: without its members and this run's implementation choices."""
    return {k: v for k, v in group.items() if k not in _NOT_HYPER and k not in _IMPLEMENTATION}


def _canon(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def _diff(a: Dict[str, Any], b: Dict[str, Any]) -> str:
    keys = sorted(k for k in set(a) | set(b) if _canon(a.get(k)) != _canon(b.get(k)))
    return ", ".join(f"{k}: {a.get(k)!r} vs {b.get(k)!r}" for k in keys[:4])


__all__ = ["export", "scheduler_state", "torch_state"]
