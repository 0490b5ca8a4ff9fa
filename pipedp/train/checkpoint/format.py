"""The manifest: what one save holds, as typed records, parsed and validated in one place.

``Manifest.parse`` is the only reader of manifest.json: a missing field, a field of the wrong
type or a value that does not decode is a CheckpointError naming the file and the field. Plain
values that JSON cannot hold as they are (tuples, dicts with non-string keys, Counters, small
tensors: optimizer hyperparameters and LR-scheduler state) go through ``encode`` / ``decode``.
"""

from __future__ import annotations

import collections
import json
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

from ...errors import CheckpointError

FORMAT = "pipedp-checkpoint-3"
# the format before the secret seed: its streams' seed is the one in its config (always given then)
_SEEDLESS = "pipedp-checkpoint-2"
_TAGS = ("__tuple__", "__dict__", "__counter__", "__tensor__")
_SMALL_TENSOR = 4096  # elements: a tensor-valued hyperparameter, not a weight


@dataclass(frozen=True)
class Fingerprint:
    """A frozen tensor's identity: shape, dtype, the sha256 of its bytes, and a float64 weighted sum of a
    strided sample (all a checkpoint written before the sha256 has: compared only then)."""

    shape: Tuple[int, ...]
    dtype: str
    value: float
    scale: float  # the sum of the terms' magnitudes: the comparison's rounding scale
    sha256: Optional[str] = None  # of every byte (None: an older checkpoint's entry, or a meta tensor)

    def matches(self, other: "Fingerprint") -> bool:
        if (self.shape, self.dtype) != (other.shape, other.dtype):
            return False
        if self.sha256 is not None and other.sha256 is not None:
            return self.sha256 == other.sha256
        if math.isnan(self.value) or math.isnan(other.value):
            return math.isnan(self.value) and math.isnan(other.value)
        # equal on one device to the bit; across devices (another summation order) to float64 rounding
        return self.value == other.value or abs(self.value - other.value) <= 1e-9 * max(self.scale, other.scale)


@dataclass(frozen=True)
class ParamState:
    """One trainable parameter's optimizer state: its param group, tensors (by key in the stage file) and
    plain values (encoded)."""

    group: int
    tensors: Dict[str, str] = field(default_factory=dict)
    values: Dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class StageRecord:
    """One saved stage: its file and what it holds, by the model's own parameter names."""

    index: int
    file: str  # a file name inside the step folder
    sha256: str
    size: int
    params: Dict[str, str]  # trainable parameter name -> tensor key in the file, in optimizer order
    groups: Optional[List[Dict[str, Any]]]  # the optimizer's param-group hyperparameters (encoded); None: none
    state: Dict[str, ParamState]  # parameter name -> its optimizer state
    scheduler: Any  # the LR scheduler's state_dict (encoded), or None
    aliases: Dict[str, str]  # another name of a trainable tensor (a tie) -> the name it is saved under
    frozen: Dict[str, Fingerprint]  # every other tensor of the stage: not saved, fingerprinted


@dataclass(frozen=True)
class Manifest:
    format: str
    job: str  # drawn at a job's first save: every step folder of a job carries it
    step: int
    folder: str  # the step folder's own name (a renamed or copied folder no longer matches)
    config: Dict[str, Any]  # the run's identity: what resuming must agree on (trainer.identity())
    mechanism: str  # the accountant
    history: List[Tuple[float, float, int]]  # its (noise multiplier, sample rate, steps) entries
    stages: List[StageRecord]
    seed: int  # the noise's and the sampling's root seed: secret unless the run was given one
    epoch_units: int = 0  # privacy units of the shuffled epoch in progress (its charge is paid)

    def where(self) -> Dict[str, StageRecord]:
        """Every trainable parameter name (and tied alias) -> the stage record holding its tensor."""
        out = {name: rec for rec in self.stages for name in rec.params}
        for rec in self.stages:
            for alias, name in rec.aliases.items():
                out.setdefault(alias, out[name])
        return out

    def canonical(self, name: str) -> str:
        for rec in self.stages:
            if name in rec.aliases:
                return rec.aliases[name]
        return name

    def frozen(self) -> Dict[str, Fingerprint]:
        return {name: fp for rec in self.stages for name, fp in rec.frozen.items()}

    # ---- bytes ------------------------------------------------------------------------------
    def to_bytes(self) -> bytes:
        stages = [
            {
                "index": r.index,
                "file": r.file,
                "sha256": r.sha256,
                "size": r.size,
                "params": r.params,
                "groups": r.groups,
                "state": {n: {"group": s.group, "tensors": s.tensors, "values": s.values} for n, s in r.state.items()},
                "scheduler": r.scheduler,
                "aliases": r.aliases,
                "frozen": {
                    n: {"shape": list(f.shape), "dtype": f.dtype, "value": f.value, "scale": f.scale}
                    | ({} if f.sha256 is None else {"sha256": f.sha256})
                    for n, f in r.frozen.items()
                },
            }
            for r in self.stages
        ]
        body = {
            "format": self.format,
            "job": self.job,
            "step": self.step,
            "folder": self.folder,
            "config": self.config,
            "accountant": {"mechanism": self.mechanism, "history": [list(h) for h in self.history]},
            "seed": self.seed,
            "epoch_units": self.epoch_units,
            "stages": stages,
        }
        return json.dumps(body, indent=1).encode()

    @staticmethod
    def parse(data: bytes, source: str) -> "Manifest":
        """The manifest in ``data`` (read from ``source``), checked field by field."""
        try:
            raw = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise CheckpointError(f"checkpoint manifest {source!r} is not valid JSON ({exc}): damaged") from exc
        top = _Fields(raw, "", source)
        if "format" not in raw and "stage_sha256" in raw:
            raise CheckpointError(
                f"checkpoint manifest {source!r} is of pipedp's earlier format (stage-K.pt files), which this version "
                "does not resume: finish that run with the version that wrote it, or start afresh"
            )
        fmt = top.get("format", str)
        if fmt not in (FORMAT, _SEEDLESS):
            raise CheckpointError(
                f"checkpoint manifest {source!r} has format {fmt[:40]!r}, not {FORMAT!r}: written by another "
                "version of pipedp, it cannot be resumed by this one"
            )
        accountant = top.sub("accountant")
        history = []
        for k, entry in enumerate(accountant.get("history", list)):
            e = _Fields(entry, f"accountant.history[{k}]", source, expect=list)
            if len(entry) != 3:
                e.fail("", "is not [noise multiplier, sample rate, steps]")
            history.append((e.number(0), e.number(1), e.integer(2)))
        stages = [_stage(_Fields(s, f"stages[{k}]", source)) for k, s in enumerate(top.get("stages", list))]
        if [s.index for s in stages] != list(range(len(stages))):
            top.fail("stages", f"are numbered {[s.index for s in stages]}, not 0..{len(stages) - 1}")
        config = top.get("config", dict)
        if fmt == _SEEDLESS and not isinstance(config.get("seed"), int):
            top.fail("config", "holds no integer seed (a checkpoint of this format always did)")
        manifest = Manifest(
            format=fmt,
            job=top.get("job", str),
            step=top.integer("step"),
            folder=top.get("folder", str),
            config=config,
            mechanism=accountant.get("mechanism", str),
            history=history,
            stages=stages,
            seed=config["seed"] if fmt == _SEEDLESS else top.integer("seed"),
            epoch_units=0 if fmt == _SEEDLESS else top.integer("epoch_units"),
        )
        _check_names(manifest, top)
        return manifest


def _stage(f: "_Fields") -> StageRecord:
    groups = f.get("groups", (list, type(None)))
    for k, g in enumerate(groups or []):
        if not isinstance(g, dict):
            f.fail(f"groups[{k}]", "is not an object")
        decode(g, f.where("groups"), f.source)
    state = {}
    for name, entry in f.get("state", dict).items():
        e = _Fields(entry, f.where(f"state[{name!r}]"), f.source)
        group = e.integer("group")
        if groups is None or not 0 <= group < len(groups):
            e.fail("group", f"is {group}, but the stage has {len(groups or [])} param groups")
        values = e.get("values", dict)
        decode(values, e.where("values"), f.source)
        state[name] = ParamState(group, _strings(e, "tensors"), values)
    scheduler = f.get("scheduler", object)
    decode(scheduler, f.where("scheduler"), f.source)
    frozen = {}
    for name, entry in f.get("frozen", dict).items():
        e = _Fields(entry, f.where(f"frozen[{name!r}]"), f.source)
        shape = e.get("shape", list)
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            e.fail("shape", "is not a list of sizes")
        sha256 = e.get("sha256", str) if "sha256" in entry else None  # (absent in checkpoints written before it)
        frozen[name] = Fingerprint(tuple(shape), e.get("dtype", str), e.number("value"), e.number("scale"), sha256)
    params = _strings(f, "params")
    for name in params:
        if name not in state:
            f.fail("state", f"has no entry for parameter {name!r}")
    return StageRecord(
        index=f.integer("index"),
        file=f.get("file", str),
        sha256=f.get("sha256", str),
        size=f.integer("size"),
        params=params,
        groups=groups,
        state=state,
        scheduler=scheduler,
        aliases=_strings(f, "aliases"),
        frozen=frozen,
    )


def _check_names(m: Manifest, top: "_Fields") -> None:
    seen: Dict[str, int] = {}
    for rec in m.stages:
        if "/" in rec.file or rec.file.startswith("."):
            top.fail(f"stages[{rec.index}].file", f"is {rec.file[:80]!r}, not a file name inside the step folder")
        for name in rec.params:
            if name in seen:
                top.fail(f"stages[{rec.index}].params", f"repeats {name!r} (also on stage {seen[name]})")
            seen[name] = rec.index
    for rec in m.stages:
        for alias, name in rec.aliases.items():
            if name not in seen:
                top.fail(f"stages[{rec.index}].aliases", f"maps {alias!r} to {name!r}, which no stage holds")


class _Fields:
    """Typed access to one JSON object of the manifest; every failure names the file and the field."""

    def __init__(self, data: Any, where: str, source: str, expect: type = dict):
        self.data, self._where, self.source = data, where, source
        if not isinstance(data, expect):
            self.fail("", f"is a {type(data).__name__}, not a JSON {'object' if expect is dict else 'list'}")

    def where(self, key: str) -> str:
        return f"{self._where}.{key}" if self._where else key

    def fail(self, key: Any, problem: str) -> None:
        name = self.where(str(key)) if key != "" else (self._where or "the top level")
        raise CheckpointError(f"checkpoint manifest {self.source!r} is damaged: {name} {problem}")

    def get(self, key: Any, kind: Any) -> Any:
        try:
            value = self.data[key]
        except (KeyError, IndexError):
            self.fail(key, "is missing")
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if kind is not object and (not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds)):
            self.fail(key, f"is a {type(value).__name__}, not a {'/'.join(k.__name__ for k in kinds)}")
        return value

    def sub(self, key: str) -> "_Fields":
        return _Fields(self.get(key, dict), self.where(key), self.source)

    def integer(self, key: Any) -> int:
        value = self.get(key, int)
        if value < 0:
            self.fail(key, f"is {value}, not >= 0")
        return value

    def number(self, key: Any) -> float:
        return float(self.get(key, (int, float)))


def _strings(f: _Fields, key: str) -> Dict[str, str]:
    value = f.get(key, dict)
    if not all(isinstance(v, str) for v in value.values()):
        f.fail(key, "maps a name to something other than a string")
    return value


# ---- plain values that JSON cannot hold as they are ----------------------------------------------
def encode(value: Any, where: str) -> Any:
    """``value`` as JSON; tuples, non-string keys, Counters and small tensors tagged; anything else refused."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [encode(v, where) for v in value]
    if isinstance(value, tuple):
        return {"__tuple__": [encode(v, where) for v in value]}
    if isinstance(value, collections.Counter):
        return {"__counter__": [[encode(k, where), encode(v, where)] for k, v in value.items()]}
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in value):
            return {k: encode(v, where) for k, v in value.items()}
        return {"__dict__": [[encode(k, where), encode(v, where)] for k, v in value.items()]}
    if isinstance(value, torch.Tensor) and value.numel() <= _SMALL_TENSOR and not value.is_complex():
        data = value.detach().cpu()
        return {"__tensor__": {"dtype": str(data.dtype).removeprefix("torch."), "data": data.tolist()}}
    raise CheckpointError(
        f"{where} holds a {type(value).__name__}, which a checkpoint cannot store (plain values, tuples, dicts "
        "and small tensors only): refused rather than saved incompletely"
    )


def decode(value: Any, where: str, source: str) -> Any:
    """The value ``encode`` was given; a malformed tag is a CheckpointError naming ``source``."""

    def bad(problem: str) -> CheckpointError:
        return CheckpointError(f"checkpoint manifest {source!r} is damaged: {where} {problem}")

    if isinstance(value, list):
        return [decode(v, where, source) for v in value]
    if not isinstance(value, dict):
        return value
    tag = next(iter(value)) if len(value) == 1 else None
    if tag not in _TAGS:
        return {k: decode(v, where, source) for k, v in value.items()}
    body = value[tag]
    if tag == "__tuple__" and isinstance(body, list):
        return tuple(decode(v, where, source) for v in body)
    if tag in ("__dict__", "__counter__") and isinstance(body, list) and all(_pair(p) for p in body):
        pairs = {_hashable(decode(k, where, source), bad): decode(v, where, source) for k, v in body}
        return collections.Counter(pairs) if tag == "__counter__" else pairs
    if tag == "__tensor__" and isinstance(body, dict) and isinstance(body.get("dtype"), str):
        dtype = getattr(torch, body["dtype"], None)
        if isinstance(dtype, torch.dtype):
            try:
                return torch.tensor(body.get("data"), dtype=dtype)
            except (TypeError, ValueError, RuntimeError) as exc:
                raise bad(f"holds a tensor that does not decode ({exc})") from exc
    raise bad(f"holds a malformed {tag[:20]!r} value")


def _pair(p: Any) -> bool:
    return isinstance(p, list) and len(p) == 2


def _hashable(key: Any, bad) -> Any:
    try:
        hash(key)
    except TypeError:
        raise bad("holds a dict key that is not hashable") from None
    return key


__all__ = ["FORMAT", "Fingerprint", "Manifest", "ParamState", "StageRecord", "decode", "encode"]
