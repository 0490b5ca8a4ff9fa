"""Save and load a TrainingState across ranks: what training changes, by parameter name.

Each stage file holds the stage's trainable parameters (``p/NAME``) and its optimizer's tensor
state (``o/NAME/KEY``); the manifest holds the rest: the step, the accountant, the param groups, the
LR scheduler, a fingerprint of every frozen tensor (the base is not copied: resuming on other frozen
weights is refused) and the names of tied aliases. Loading looks each parameter up by name, so a
run saved on p stages (or r replicas) resumes on any other split: each stage reads the names it
holds from whichever file holds them. Every rank checks its part before any rank changes anything,
and all ranks raise together.
"""

from __future__ import annotations

import functools
import os
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ...errors import CheckpointError
from ...runtime.protocols import Runtime
from ...shards import Shard
from ..state import TrainingState
from . import folder, optim, tensorfile
from .format import FORMAT, Manifest, StageRecord, encode


# ---- all ranks together ----------------------------------------------------------------------------
def _together(runtime: Runtime, work: Callable[[], Any]) -> Any:
    """``work()`` on every rank; if it failed on any, every rank raises (its own error as it is, the others
    a CheckpointError naming the failed ranks), so that no rank waits for one that gave up."""
    try:
        result, problem, error = work(), None, None
    except Exception as exc:  # noqa: BLE001 - re-raised below, once the other ranks know
        result, problem, error = None, f"rank {runtime.rank}: {exc}", exc
    problems = [p for p in runtime.all_gather(problem) if p is not None]
    if error is not None:
        raise error
    if problems:
        raise CheckpointError("\n".join(problems))
    return result


def _from_rank0(runtime: Runtime, work: Callable[[], Any]) -> Any:
    """Rank 0's ``work()`` on every rank (the others do not run it), or every rank raises its error."""
    outcome: Any = None
    error: Optional[Exception] = None
    if runtime.rank == 0:
        try:
            outcome = ("ok", work())
        except Exception as exc:  # noqa: BLE001 - re-raised below, once the other ranks know
            outcome, error = ("error", f"rank 0: {exc}"), exc
    outcome = runtime.broadcast(outcome)
    if error is not None:
        raise error
    if outcome[0] == "error":
        raise CheckpointError(outcome[1])
    return outcome[1]


def _identity(t: torch.Tensor) -> Optional[Tuple[Any, ...]]:
    """Which memory a tensor is (a detached view of a parameter is the parameter); None on meta."""
    if t.is_meta:
        return None
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


def _trainable(runtime: Runtime) -> Dict[Any, str]:
    """Every trainable parameter of this process's stages, by memory -> its name."""
    out: Dict[Any, str] = {}
    for stage in runtime.local_stages:
        for p, name in zip(stage.parameters, stage.parameter_names()):
            ident = _identity(p)
            if ident is not None:
                out.setdefault(ident, name)
    return out


# ---- save ------------------------------------------------------------------------------------------
def save(
    directory: str,
    state: TrainingState,
    runtime: Runtime,
    identity: Dict[str, Any],
    stages: int,
    key: Optional[bytes] = None,
    keep_last: Optional[int] = None,
    job: Optional[str] = None,
) -> str:
    """Every rank calls this: replica 0 writes its stages' files into a temporary folder, rank 0 signs
    the manifest and renames the folder into place. Returns the job id (drawn at a job's first save)."""

    def prepare() -> Tuple[str, str, str]:
        name = folder.next_name(directory, state.step)
        return job or folder.new_job(), name, folder.make_temporary(directory, name)

    this_job, name, temporary = _from_rank0(runtime, prepare)
    try:
        elsewhere = _sharded_state(state, runtime)  # (every replica: the owners send theirs to replica 0)
        mine = _together(
            runtime, lambda: _write_stages(temporary, state, runtime, elsewhere) if runtime.replica == 0 else {}
        )
        merged: Dict[int, StageRecord] = {}
        for part in runtime.all_gather(mine):  # also the barrier: every stage file is complete
            merged.update(part)

        def finish() -> int:
            if sorted(merged) != list(range(stages)):
                raise CheckpointError(f"the save gathered stages {sorted(merged)}, not 0..{stages - 1}")
            accountant = state.accountant.state_dict()
            manifest = Manifest(
                format=FORMAT,
                job=this_job,
                step=state.step,
                folder=name,
                config=identity,
                mechanism=str(accountant["mechanism"]),
                history=[(float(s), float(q), int(n)) for s, q, n in accountant["history"]],
                stages=[merged[s] for s in range(stages)],
                seed=state.seed,
                epoch_units=state.charges.seen,
            )
            same = folder.unchanged(directory, manifest, key)
            if same is None:
                folder.commit(directory, temporary, manifest, key)
            else:  # byte for byte the save already there (its files' hashes included): keep that one
                folder.remove_temporary(temporary)
            return folder.prune(directory, same or name, this_job, keep_last, key)

        foreign = _together(runtime, finish if runtime.rank == 0 else lambda: 0)
    except BaseException:
        if runtime.rank == 0 and os.path.isdir(temporary):
            folder.remove_temporary(temporary)
        raise
    if foreign:
        warnings.warn(
            f"{directory!r} held {foreign} step folder(s) of another job (or unreadable ones): replaced by this "
            "job's checkpoint",
            stacklevel=3,
        )
    return this_job


def _whole(runtime: Runtime, stage: Any, named: List[Tuple[str, torch.Tensor, Optional[Shard]]]):
    """The tensors as one rank holds the whole stage: under tensor parallelism gathered on the stage's rank 0
    (which writes its file: the file is the one a run on one rank writes, so it resumes on any split); None on
    the stage's other ranks."""
    whole = runtime.gather_slices(stage, [(t, shard) for _, t, shard in named])
    return None if whole is None else [(name, t) for (name, _, _), t in zip(named, whole)]


def _sharded_state(state: TrainingState, runtime: Runtime) -> List[Dict[int, Dict[str, Any]]]:
    """Per local stage, under a sharded optimizer: the optimizer state of the parameters other replicas own, by
    parameter id, gathered onto replica 0 (which writes the stage's file: the one an unsharded run writes, so it
    resumes on any replica count, sharded or not); empty elsewhere."""
    out: List[Dict[int, Dict[str, Any]]] = []
    for stage, opt, owners in zip(
        runtime.local_stages, state.optimizers, state.owners or [None] * len(state.optimizers)
    ):
        if owners is None or opt is None:
            out.append({})
            continue
        own = [dict(opt.state.get(p) or {}) if o == runtime.replica else None for p, o in zip(stage.parameters, owners)]
        gathered = runtime.gather_owned(own, owners)
        theirs = zip(stage.parameters, gathered, owners)
        out.append({id(p): g for p, g, o in theirs if o != runtime.replica and g} if runtime.replica == 0 else {})
    return out


def _write_stages(
    temporary: str, state: TrainingState, runtime: Runtime, elsewhere: List[Dict[int, Dict[str, Any]]]
) -> Dict[int, StageRecord]:
    trainable = _trainable(runtime)
    schedulers = list(state.schedulers) or [None] * len(state.optimizers)
    out = {}
    for stage, opt, scheduler, theirs in zip(runtime.local_stages, state.optimizers, schedulers, elsewhere):
        names = stage.parameter_names()
        if opt is None and names:
            raise CheckpointError(f"stage {stage.index} trains {names[0]} but has no optimizer")
        groups, states, optimizer_tensors = optim.export(opt, stage.parameters, names, theirs)
        split = stage.slices()
        aliases, untrained = {}, []
        for tensor_name, t in stage.named_state().items():
            owner = trainable.get(_identity(t))
            if owner is None:
                untrained.append((tensor_name, t, split.get(tensor_name)))
            elif owner != tensor_name:
                aliases[tensor_name] = owner  # a tie: the same tensor saved once, under the other name
        params = {n: f"p/{n}" for n in names}
        saved = [(params[n], p, split.get(n)) for n, p in zip(names, stage.parameters)]
        of_param = {params[n]: p for n, p in zip(names, stage.parameters)}
        for key, v in optimizer_tensors:  # a moment has its parameter's slice; a step count is whole
            name = key[2:].rsplit("/", 1)[0]
            p, shard = of_param[f"p/{name}"], split.get(name)
            if shard is not None and v.shape != p.shape and v.dim() > 0:
                raise CheckpointError(
                    f"optimizer state {key} of the split parameter {name} has shape {tuple(v.shape)}, neither the "
                    f"slice's {tuple(p.shape)} nor a scalar: it cannot be joined into the whole tensor's"
                )
            saved.append((key, v, shard if v.shape == p.shape else None))
        frozen_whole, tensors = _whole(runtime, stage, untrained), _whole(runtime, stage, saved)
        if frozen_whole is None or tensors is None:  # another tensor-parallel rank writes this stage
            continue
        frozen = tensorfile.fingerprints(dict(frozen_whole))
        file = f"stage-{stage.index}.safetensors"
        sha256, size = tensorfile.write(os.path.join(temporary, file), tensors)
        sched = None
        if scheduler is not None:
            sched = encode(scheduler.state_dict(), f"the LR scheduler of stage {stage.index}")
        out[stage.index] = StageRecord(stage.index, file, sha256, size, params, groups, states, sched, aliases, frozen)
    return out


# ---- load ------------------------------------------------------------------------------------------
def load(
    directory: str,
    state: TrainingState,
    runtime: Runtime,
    identity: Dict[str, Any],
    key: Optional[bytes] = None,
) -> str:
    """Restore parameters, optimizers, LR schedulers, accountant and step from the newest checkpoint
    (see folder.newest for which one that is); return its job id."""
    manifest: Manifest = _from_rank0(runtime, lambda: folder.newest(directory, key))
    base = os.path.join(directory, manifest.folder)

    def check() -> None:
        check_compatible(manifest, identity)
        if manifest.mechanism != state.accountant.mechanism():
            raise CheckpointError(
                f"the checkpoint's accountant is {manifest.mechanism!r}, this run's {state.accountant.mechanism()!r}"
            )

    _naming(base, check)
    if any(fp.sha256 is None for fp in manifest.frozen().values()):
        warnings.warn(
            f"{os.path.join(base, folder.MANIFEST)!r} was written before checkpoints recorded the sha256 of every "
            "frozen tensor: the base weights are checked on a sample of 1024 elements per tensor only (the older "
            "rule); the next save records their sha256",
            stacklevel=3,
        )
    files: Dict[str, tensorfile.TensorFile] = {}
    try:
        loads = _together(runtime, lambda: _naming(base, lambda: _checked_loads(manifest, base, state, runtime, files)))
        _together(runtime, lambda: _apply(loads, state, files, runtime))
    finally:
        for f in files.values():
            f.close()
    state.accountant.load_state_dict({"mechanism": manifest.mechanism, "history": list(manifest.history)})
    state.step = manifest.step
    state.seed = manifest.seed
    state.charges.seen = manifest.epoch_units
    return manifest.job


def _naming(base: str, work: Callable[[], Any]) -> Any:
    """``work()``; a CheckpointError that names no file of the step folder is told which manifest it is about."""
    try:
        return work()
    except CheckpointError as exc:
        if base in str(exc):
            raise
        raise CheckpointError(f"checkpoint {os.path.join(base, folder.MANIFEST)!r}: {exc}") from exc


def check_compatible(manifest: Manifest, config: Dict[str, Any]) -> None:
    """The options that shape the update are those the checkpoint was trained with (an option one side
    lacks differs too)."""
    saved, absent = manifest.config, object()
    names = list(config) + [k for k in saved if k not in config]
    diffs = [
        f"{k}: checkpoint {_shown(saved.get(k, absent), absent)}, now {_shown(config.get(k, absent), absent)}"
        for k in names
        if k not in saved or k not in config or saved[k] != config[k]
    ]
    if isinstance(saved.get("seed"), int) and config.get("seed", absent) is None:
        diffs.append(
            f"(the checkpoint's run was given seed {saved['seed']}: pass seed={saved['seed']} to resume it; its noise "
            "is as public as that seed)"
        )
    if diffs:
        raise CheckpointError("checkpoint was written by a different configuration:\n  " + "\n  ".join(diffs))


def _shown(value: Any, absent: object) -> str:
    return "(not set)" if value is absent else repr(value)


class _StageLoad:
    def __init__(
        self, params: List[Tuple[torch.nn.Parameter, StageRecord, str, Optional[Shard]]], optimizer: Any, scheduler: Any
    ):
        self.params, self.optimizer, self.scheduler = params, optimizer, scheduler


def _checked_loads(
    manifest: Manifest, base: str, state: TrainingState, runtime: Runtime, files: Dict[str, tensorfile.TensorFile]
) -> List[_StageLoad]:
    """Check everything this rank will load (names, shapes, files' hashes, frozen tensors, optimizer
    groups) without changing anything."""
    where, frozen = manifest.where(), manifest.frozen()
    trainable = _trainable(runtime)

    def open_file(record: StageRecord) -> tensorfile.TensorFile:
        if record.file not in files:
            files[record.file] = tensorfile.TensorFile(os.path.join(base, record.file), record.sha256, record.size)
        return files[record.file]

    schedulers = list(state.schedulers) or [None] * len(state.optimizers)
    loads = []
    for stage, opt, scheduler in zip(runtime.local_stages, state.optimizers, schedulers):
        names = stage.parameter_names()
        sources: Dict[str, Tuple[StageRecord, str]] = {}
        params = []
        split = stage.slices()
        for p, name in zip(stage.parameters, names):
            if name not in where:
                was = "frozen in the checkpoint, trainable now" if name in frozen else "not in the checkpoint"
                raise CheckpointError(f"stage {stage.index}: parameter {name} is {was}: refused")
            record, saved = where[name], manifest.canonical(name)
            dtype, shape = open_file(record).meta(record.params[saved])
            whole_shape = split[name].full_shape if name in split else tuple(p.shape)  # a slice reads its part
            if (dtype, shape) != (p.dtype, whole_shape):
                raise CheckpointError(
                    f"parameter {name} is {p.dtype} {tuple(p.shape)} here but {dtype} {shape} in {record.file}"
                )
            sources[name] = (record, saved)
            params.append((p, record, record.params[saved]))
        untrained = {n: t for n, t in stage.named_state().items() if trainable.get(_identity(t)) is None}
        for tensor_name in untrained:
            if tensor_name not in frozen:
                was = "trained in the checkpoint, frozen now" if tensor_name in where else "not in the checkpoint"
                raise CheckpointError(f"stage {stage.index}: tensor {tensor_name} is {was}: refused")
        # fingerprints of the whole tensors: on the stage's tensor-parallel rank 0, which holds them gathered
        whole = _whole(runtime, stage, [(n, t, split.get(n)) for n, t in untrained.items()])
        for tensor_name, now in tensorfile.fingerprints(dict(whole or [])).items():
            recorded = frozen[tensor_name]
            if not now.matches(recorded):
                both = recorded.sha256 is not None and now.sha256 is not None
                what = "bytes' sha256" if both else "sampled fingerprint"
                raise CheckpointError(
                    f"stage {stage.index}: the frozen tensor {tensor_name} is not the one the checkpoint was trained "
                    f"on (its {what} differs): resume on the same base weights"
                )
        optimizer = sched = None
        if opt is not None:
            saved_scheduler = any(rec.scheduler is not None for rec, _ in sources.values())
            if saved_scheduler != (scheduler is not None):
                has, hasnt = ("the checkpoint", "this run") if saved_scheduler else ("this run", "the checkpoint")
                raise CheckpointError(
                    f"{has} has an LR scheduler for stage {stage.index}'s parameters, {hasnt} none: build the "
                    "trainer as the checkpointed run was (scheduler=...)"
                )
            optimizer, origins = optim.torch_state(
                opt, stage.parameters, names, sources, functools.partial(_deferred, open_file, split)
            )
            if scheduler is not None:
                sched = optim.scheduler_state(origins, stage.index, scheduler.state_dict())
        loads.append(_StageLoad([(p, r, k, split.get(n)) for (p, r, k), n in zip(params, names)], optimizer, sched))
    return loads


def _deferred(open_file: Callable, split: Dict[str, Shard], record: StageRecord, key: str) -> "_Deferred":
    """The optimizer-state tensor ``key`` ("o/<parameter>/<state>"), cut to its parameter's slice if it is split."""
    return _Deferred(open_file(record), key, split.get(key[2:].rsplit("/", 1)[0]))


class _Deferred:
    """An optimizer-state tensor read when it is loaded, not when it is planned (``shard``: its parameter's slice,
    which a tensor of the whole parameter's shape is cut to)."""

    def __init__(self, file: tensorfile.TensorFile, key: str, shard: Optional[Shard] = None):
        self.file, self.key, self.shard = file, key, shard
        file.meta(key)

    def read(self) -> torch.Tensor:
        value = self.file.read(self.key)
        if self.shard is not None and tuple(value.shape) == self.shard.full_shape:
            value = self.shard.of(value).clone()
        return value


def _apply(
    loads: List[_StageLoad], state: TrainingState, files: Dict[str, tensorfile.TensorFile], runtime: Runtime
) -> None:
    schedulers = list(state.schedulers) or [None] * len(state.optimizers)
    owners = state.owners or [None] * len(state.optimizers)
    for load, opt, scheduler, stage, owner in zip(loads, state.optimizers, schedulers, runtime.local_stages, owners):
        with torch.no_grad():
            for p, record, key, shard in load.params:
                value = files[record.file].read(key)
                p.copy_(shard.of(value) if shard is not None else value)
        if opt is not None:
            optimizer = load.optimizer
            if owner is not None:  # a sharded optimizer: the state of the parameters this replica owns, no other
                mine = {id(p) for p, o in zip(stage.parameters, owner) if o == runtime.replica}
                order = [p for group in opt.param_groups for p in group["params"]]
                optimizer["state"] = {i: v for i, v in optimizer["state"].items() if id(order[i]) in mine}
            for values in optimizer["state"].values():
                for k, v in values.items():
                    if isinstance(v, _Deferred):
                        values[k] = v.read()
            opt.load_state_dict(optimizer)
        if scheduler is not None:
            scheduler.load_state_dict(load.scheduler)


__all__ = ["check_compatible", "load", "save"]
