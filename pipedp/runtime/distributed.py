"""The multi-process runtime: one process per (stage, replica), over torch.distributed.

Ranks form a stages x replicas mesh: rank = replica * stages + stage. The pipeline group
of a replica holds its stages (P2P and the per-sample norm all-reduce); the data-parallel
group of a stage holds that stage on every replica (sum of clipped gradients); a group of
every rank serves the step's checks and totals. All are explicit objects held here, each
created with the run's timeout (the default group only serves the first agreement check).

What it changes on the user's model: on each rank, the blocks of the other stages are
moved to the meta device (their memory is freed); only this rank's stage stays real.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from schedules import Schedule, forward_only

from ..config import PipelineConfig
from ..errors import (
    AgentLostError,
    BatchError,
    ConfigError,
    ConfigMismatchError,
    PipeDPError,
    StepFailedError,
    TransportError,
    UnsupportedModelError,
)
from ..parallel.layers import Group
from ..parallel.plan import split_stage
from ..shards import Shard
from ..split.blocks import Block
from ..split.partition import Tie
from ..wire import Wire, carrier
from .dist_transport import DistTransport, PipelineGroups
from .executor import Executor
from .launch import bounded, cuda_device_of_rank, nccl_fault_handling, shared_cuda_device
from .microbatch import Inputs, PassBatch, rows, tensors_of
from .placement import no_cuda
from .protocols import PeerAborted
from .stage import Stage, StageOptions
from .tie import TieRole


@dataclass(frozen=True)
class Mesh:
    """rank = (replica * stages + stage) * tensor_parallel + t: tensor-parallel ranks innermost (one node's
    GPUs), then the stages of a replica, then the replicas."""

    stages: int
    replicas: int
    rank: int
    tensor_parallel: int = 1

    @property
    def t(self) -> int:
        """This rank's index among its stage's tensor-parallel ranks."""
        return self.rank % self.tensor_parallel

    @property
    def stage(self) -> int:
        return (self.rank // self.tensor_parallel) % self.stages

    @property
    def replica(self) -> int:
        return self.rank // (self.stages * self.tensor_parallel)

    def rank_of(self, replica: int, stage: int, t: int = 0) -> int:
        return (replica * self.stages + stage) * self.tensor_parallel + t

    def pipeline_ranks(self, replica: int, t: int = 0) -> List[int]:
        """The stages of one replica at tensor-parallel index t: point to point between neighbours."""
        return [self.rank_of(replica, s, t) for s in range(self.stages)]

    def replica_ranks(self, replica: int) -> List[int]:
        """Every rank of one replica: the per-sample norms (flat clipping) are summed over them."""
        return [self.rank_of(replica, s, t) for s in range(self.stages) for t in range(self.tensor_parallel)]

    def tensor_parallel_ranks(self, replica: int, stage: int) -> List[int]:
        return [self.rank_of(replica, stage, t) for t in range(self.tensor_parallel)]

    def data_parallel_ranks(self, stage: int, t: int = 0) -> List[int]:
        return [self.rank_of(r, stage, t) for r in range(self.replicas)]

    @property
    def world(self) -> int:
        return self.stages * self.replicas * self.tensor_parallel


CHECKSUM_PIECE = 1 << 20  # elements summed at a time
_TENSOR = "__tensor__"  # in an optimizer state's header: a tensor that follows, by (shape, dtype)
BUCKET = 1 << 24  # elements of the sums all-reduced over replicas at a time (64 MiB of float32)


def _buckets(grads: List[torch.Tensor]) -> List[List[torch.Tensor]]:
    """The clipped sums in consecutive groups of one dtype and at most BUCKET elements (a larger sum alone),
    for one all-reduce each."""
    out: List[List[torch.Tensor]] = []
    size = 0
    for g in grads:
        if out and out[-1][0].dtype == g.dtype and size + g.numel() <= BUCKET:
            out[-1].append(g)
            size += g.numel()
        else:
            out.append([g])
            size = g.numel()
    return out


def _by_owner(
    tensors: List[torch.Tensor], owners: Optional[List[int]], replicas: int
) -> List[Tuple[Optional[int], List[torch.Tensor]]]:
    """The tensors grouped by the replica that owns them (one group owned by none: no sharded optimizer)."""
    if owners is None:
        return [(None, tensors)]
    return [(r, [t for t, o in zip(tensors, owners) if o == r]) for r in range(replicas)]


def _checksum(parameters: Sequence[torch.Tensor]) -> float:
    """A float64 sum of the parameters, a piece at a time: on the CPU ``sum(dtype=float64)``
    converts its whole input first (a float64 copy: 1 GB for a 32000 x 4096 bf16 head)."""
    total = 0.0
    with torch.no_grad():
        for p in parameters:
            flat = p.reshape(-1)
            for start in range(0, flat.numel(), CHECKSUM_PIECE):
                total += float(flat[start : start + CHECKSUM_PIECE].sum(dtype=torch.float64))
    return total


@dataclass(frozen=True)
class Groups:
    pipelines: Dict[Tuple[int, int], PipelineGroups]  # per (replica, t): its stages' P2P channels and norm sum
    data_parallel: Dict[Tuple[int, int], Any]  # per (stage, t): it on every replica (sum of clipped gradients)
    world: Any  # every rank: the step's checks and totals
    # per (replica, t): its first and last stage, when an embedding is tied to the head
    ties: Dict[Tuple[int, int], Any]
    tensor_parallel: Dict[Tuple[int, int], Any]  # per (replica, stage): its tensor-parallel ranks


def _agree(config: Dict[str, Any]) -> None:
    """Every rank must run the same configuration (compared before any check that could make one
    rank leave early)."""
    configs: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(configs, config)
    mismatches = [
        f"rank {r} has {key}={cfg[key]!r} but rank 0 has {configs[0][key]!r}"
        for r, cfg in enumerate(configs)
        for key in config
        if cfg[key] != configs[0][key]
    ]
    if mismatches:
        raise ConfigMismatchError("ranks disagree on the configuration:\n  " + "\n  ".join(mismatches))


def _create_groups(mesh: "Mesh", wait: timedelta, tied: bool, across_stages: bool) -> Groups:
    """Every rank creates every group, in the same order (torch.distributed requires it); each waits at
    most ``wait`` for a peer, so a hung rank ends the run instead of stalling it for good. The norms are summed
    over a replica's stages (flat clipping) and its tensor-parallel ranks: over the replica's every rank, or with
    per-stage and per-layer clipping over the stage's tensor-parallel ranks."""
    T = mesh.tensor_parallel

    def group(ranks: List[int]):
        return dist.new_group(ranks, timeout=wait)

    tensor_parallel = {}
    if T > 1:
        for r in range(mesh.replicas):
            for s in range(mesh.stages):
                tensor_parallel[(r, s)] = group(mesh.tensor_parallel_ranks(r, s))
    replicas = [group(mesh.replica_ranks(r)) for r in range(mesh.replicas)] if T > 1 else []
    pipelines = {}
    for r in range(mesh.replicas):
        for t in range(T):
            ranks = mesh.pipeline_ranks(r, t)
            activations, gradients = group(ranks), group(ranks)
            norms = group(ranks) if T == 1 else replicas[r] if across_stages else None
            pipelines[(r, t)] = PipelineGroups(activations, gradients, norms)
    data_parallel = {(s, t): group(mesh.data_parallel_ranks(s, t)) for s in range(mesh.stages) for t in range(T)}
    world = group(list(range(mesh.world)))
    ties = {}
    if tied:  # under tensor parallelism the embedding's and the head's slices of one vocabulary range
        for r in range(mesh.replicas):
            for t in range(T):
                ties[(r, t)] = group([mesh.rank_of(r, 0, t), mesh.rank_of(r, mesh.stages - 1, t)])
    return Groups(pipelines, data_parallel, world, ties, tensor_parallel)


def _free(module: nn.Module) -> None:
    """Another stage's module: each of its tensors replaced by a new one on the meta device. New objects, so that a
    weight this stage holds too (an embedding tied to the head) stays this stage's, whatever the split does to it
    (a tensor-parallel split swaps a weight the loader left unread for its slice in place)."""
    for m in module.modules():
        for name, p in m._parameters.items():
            if p is not None:
                m._parameters[name] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
        for name, b in m._buffers.items():
            if b is not None:
                m._buffers[name] = torch.empty_like(b, device="meta")


def _check_same_weights(stage: Stage, mesh: "Mesh") -> None:
    """Ranks holding one stage's same slices hold the same values; its tensor-parallel ranks the same whole
    tensors (the parameters none of them splits)."""
    whole = [p for p in stage.parameters if id(p) not in stage.tensor_parallel.shards]
    mine = (mesh.stage, mesh.t, _checksum(stage.parameters), _checksum(whole))
    entries: List[Optional[tuple]] = [None] * mesh.world
    dist.all_gather_object(entries, mine)
    for r, entry in enumerate(entries):
        s, t, value, shared = entry  # type: ignore[misc]
        if s == mesh.stage and ((t == mesh.t and value != mine[2]) or shared != mine[3]):
            raise ConfigMismatchError(
                f"ranks {mesh.rank} and {r} hold stage {s} with different weights: build the model from the "
                "same seed (torch.manual_seed before constructing it) or load the same checkpoint on every rank"
            )


def _device_for_backend(device: str = "auto") -> torch.device:
    """This rank's device: under NCCL its own GPU (init_from_env set it; a group the user made may have left
    every rank on cuda:0, so that one comes from LOCAL_RANK); under gloo the CPU, or with ``device="cuda"`` a GPU
    that several ranks may share (its tensors cross through host memory: pipedp/wire.py). ``device`` is
    PipelineConfig.device, refused where the backend cannot put the stage there."""
    backend = dist.get_backend()
    if carrier(backend, "cuda") != "nccl" or (device == "cpu" and carrier(backend, "cpu") == "gloo"):
        if device != "cuda":  # (a mixed "cpu:gloo,cuda:nccl" group runs a CPU stage over gloo)
            return torch.device("cpu")
        if not torch.cuda.is_available():
            raise no_cuda()
        index = torch.cuda.current_device()
        if index == 0:  # the default: nobody chose (as under NCCL below)
            index = shared_cuda_device()
            torch.cuda.set_device(index)
        return torch.device("cuda", index)
    if device == "cpu":
        raise ConfigError(
            "device 'cpu' but the process group runs NCCL (GPU tensors only): init_process_group('gloo')", "device"
        )
    index = torch.cuda.current_device()
    if index == 0:  # the default: nobody chose (rank 0 of a node takes 0 either way)
        index = cuda_device_of_rank()
        torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _fingerprint_tensor(t: torch.Tensor) -> torch.Tensor:
    """A position-weighted float64 sum, on the tensor's own device."""
    flat = t.detach().reshape(-1).to(torch.float64)
    weights = 1.0 + (torch.arange(flat.numel(), dtype=torch.float64, device=flat.device) % 7919) / 7919
    return (flat * weights).sum()


def _fingerprint(t: torch.Tensor) -> float:
    """Equal batches agree exactly, different ones almost never."""
    return float(_fingerprint_tensor(t))


FAILURE_KEY = "pipedp/step-failure"  # in the default group's store: a failure no collective carried
POLL_S = 0.05  # a waiting collective looks for that key this often (after waiting this long)


def _store_get(key: str) -> Optional[str]:
    """The key's value in the default group's store, or None (absent, or the store is gone)."""
    try:
        store = dist.distributed_c10d._get_default_store()
        return store.get(key).decode() if store.check([key]) else None
    except (RuntimeError, ValueError):  # a killed launcher's store: nothing to learn there
        return None


def _store_set(key: str, value: str) -> None:
    try:
        dist.distributed_c10d._get_default_store().set(key, value)
    except (RuntimeError, ValueError):  # the others then learn of it by their timeout or a broken connection
        pass


def _refusal(report: str) -> str:
    return (
        f"{report}; the ranks are out of step, so this run refuses every later step, evaluation, state_dict() "
        "and checkpoint: restart it (resume from the last checkpoint)"
    )


class DistributedRuntime:
    def __init__(
        self,
        mesh: Mesh,
        stage: Stage,
        executor: Executor,
        dp_group,
        world_group,
        tie_group,
        wire: Wire,
        state_keys: Sequence[str],
    ):
        self.mesh, self.wire = mesh, wire
        self.rank = mesh.rank
        self.replicas, self.replica = mesh.replicas, mesh.replica
        self.stage = stage
        self.executor = executor
        self.dp_group, self.world_group = dp_group, world_group
        self.tie_group = tie_group  # first and last stage of this replica, when an embedding is tied to the head
        self.state_keys = list(state_keys)
        self.failure: Optional[str] = None  # an earlier step raised here: the ranks are out of step
        self.tp_group: Any = None  # this stage's tensor-parallel ranks (tensor_parallel > 1)

    @property
    def device(self) -> torch.device:
        """The stage's device."""
        return self.wire.device

    @property
    def local_stages(self) -> List[Stage]:
        return [self.stage]

    @classmethod
    def create(
        cls,
        pipeline: PipelineConfig,
        schedule: Schedule,
        options: StageOptions,
        stage_blocks: List[List[Block]],
        loss_fn: Callable,
        agreement: Dict[str, Any],
        state_keys: Sequence[str],
        tie: Optional[Tie] = None,
        tensor_parallel_plan: Optional[Dict[str, str]] = None,
    ) -> "DistributedRuntime":
        """``agreement``: what every rank must agree on (the run's configuration and model signature);
        ``tensor_parallel_plan``: the layers split across each stage's tensor-parallel ranks (parallel/plan.py)."""
        world, rank = dist.get_world_size(), dist.get_rank()
        device = _device_for_backend(pipeline.device)  # first: the agreement's own collective runs on it
        wire = Wire.of(device, dist.get_backend())
        if carrier(dist.get_backend(), device.type) == "nccl":
            nccl_fault_handling()  # the groups below read it when created (also under the user's own init)
        _agree({"world size": world, **agreement})
        mesh = Mesh(pipeline.stages, pipeline.replicas, rank, pipeline.tensor_parallel)
        if world != mesh.world:
            raise ConfigMismatchError(
                f"world size {world} != stages {pipeline.stages} x replicas {pipeline.replicas} x tensor_parallel "
                f"{pipeline.tensor_parallel}: launch torchrun --nproc_per_node {mesh.world} (or fix the three)"
            )
        across = options.clip.across_stages
        with bounded("creating the process groups", pipeline.timeout):
            groups = _create_groups(
                mesh, timedelta(seconds=pipeline.timeout), tied=tie is not None, across_stages=across
            )
        for s, blocks in enumerate(stage_blocks):
            if s != mesh.stage:
                for b in blocks:  # keep only this rank's stage; free the rest
                    _free(b.module)
        tp_group = groups.tensor_parallel.get((mesh.replica, mesh.stage))
        part = None
        if tp_group is not None:  # this rank's slices, cut before the stage moves to its device
            part = split_stage(
                stage_blocks[mesh.stage],
                tensor_parallel_plan or {},
                Group(mesh.t, mesh.tensor_parallel, tp_group, wire),
            )
        for b in stage_blocks[mesh.stage]:
            b.module.to(device)
        role = TieRole.for_stage(mesh.stage, mesh.stages, tie, own_copy=True)
        stage = Stage(mesh.stage, mesh.stages, stage_blocks[mesh.stage], loss_fn, options, role, part)
        _check_same_weights(stage, mesh)
        ranks = mesh.pipeline_ranks(mesh.replica, mesh.t)
        pipeline_groups = groups.pipelines[(mesh.replica, mesh.t)]
        if pipeline_groups.norms is None:  # per-stage / per-layer clipping: the stage's ranks' parts
            pipeline_groups = PipelineGroups(pipeline_groups.activations, pipeline_groups.gradients, tp_group)
        transport = DistTransport(
            mesh.stage,
            rank,
            ranks[mesh.stage - 1] if mesh.stage > 0 else None,
            ranks[mesh.stage + 1] if mesh.stage < mesh.stages - 1 else None,
            pipeline_groups,
            wire,
        )
        executor = Executor(stage, transport, schedule.for_stage(mesh.stage))
        tie_group = groups.ties.get((mesh.replica, mesh.t))
        dp_group = groups.data_parallel[(mesh.stage, mesh.t)]
        runtime = cls(mesh, stage, executor, dp_group, groups.world, tie_group, wire, state_keys)
        runtime.tp_group = tp_group
        return runtime

    def check_same_batch(self, inputs: Inputs, targets: torch.Tensor) -> None:
        """Every rank must step on the same logical batch: compare its size and a fingerprint."""
        self._refuse_if_failed()
        mine = torch.tensor(
            [float(rows(inputs)), sum(_fingerprint(t) for t in tensors_of(inputs)), _fingerprint(targets)],
            dtype=torch.float64,
        )
        extremes = self.wire.copy(torch.cat([mine, -mine]))  # one MAX all-reduce gives both max and -min
        self._polled(
            "batch check",
            lambda: dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=self.world_group, async_op=True),
        )
        high, low = extremes.cpu().split(3)
        if not (torch.equal(high, mine) and torch.equal(-low, mine)):
            raise BatchError(
                f"ranks got different logical batches (rank {self.mesh.rank} has {rows(inputs)} rows; sizes "
                f"across ranks range {int(-low[0])}..{int(high[0])}, and/or the contents differ): every rank must "
                "call step() with the same inputs and targets"
            )

    def run_pass(self, batch: PassBatch) -> torch.Tensor:
        self._run(batch, None)
        return self._counted(self.executor.totals().cpu())

    def run_eval(self, batch: PassBatch) -> torch.Tensor:
        self._run(batch, forward_only(self.mesh.stages, len(batch.masks)).for_stage(self.mesh.stage))
        return self._counted(self.executor.totals().cpu())

    def _counted(self, totals: torch.Tensor) -> torch.Tensor:
        """The losses and counts once per stage: its tensor-parallel ranks all compute them (the flag stays)."""
        if self.mesh.t != 0:
            totals[:3] = 0
        return totals

    def broadcast_whole(self, stage: Stage, grads: List[torch.Tensor]) -> List[torch.Tensor]:
        if self.tp_group is None:
            return grads
        source = self.mesh.rank_of(self.replica, self.mesh.stage, 0)
        for p, g in zip(stage.parameters, grads):
            if id(p) not in stage.tensor_parallel.shards:
                wired = self.wire.out(g)
                self._collective(
                    "tensor-parallel broadcast", functools.partial(dist.broadcast, wired, source, self.tp_group)
                )
                self.wire.into(g, wired)
        return grads

    def refuse_unequal_whole(self, stage: Stage, grads: List[torch.Tensor]) -> None:
        """Every rank of a stage computes the clipped sums of the whole tensors alike (same activations, same
        gradients) unless such a tensor reads one rank's own slice (a norm over its heads): then each rank holds
        only its part of the gradient. Verified at every step before the noise (secure mode draws each rank's own),
        by each sum's float64 sum and sum of squares across the stage's ranks (the broadcast would hide it)."""
        whole = [(p, g) for p, g in zip(stage.parameters, grads) if id(p) not in stage.tensor_parallel.shards]
        if self.tp_group is None or not whole:
            return
        mine = self.wire.copy(
            torch.stack([torch.stack([g.double().sum(), g.double().square().sum()]) for _, g in whole])
        )
        parts = [self.wire.empty(mine.shape, mine.dtype) for _ in range(self.mesh.tensor_parallel)]
        self._collective("tensor-parallel check", functools.partial(dist.all_gather, parts, mine, self.tp_group))
        names = stage.names()
        # the same arithmetic on the same values: equal but for a kernel's order of additions (atomics on a GPU)
        rtol = 1e-9 if all(g.dtype == torch.float64 for _, g in whole) else 1e-4
        for t, theirs in enumerate(parts):
            close = torch.isclose(theirs.cpu(), mine.cpu(), rtol=rtol, atol=1e-12).all(1)
            if not bool(close.all()):
                k = int((~close).nonzero()[0])
                raise UnsupportedModelError(
                    f"stage {stage.index}: the clipped sum of {names[id(whole[k][0])]}, held whole by every "
                    f"tensor-parallel rank, differs between ranks {self.mesh.t} and {t}: it reads a rank's own slice "
                    "(e.g. a norm over the heads a rank computes), so each rank has only part of its gradient; freeze "
                    "it, or use tensor_parallel=1"
                )

    def _run(self, batch: PassBatch, actions) -> None:
        """One pass; a pass that fails on any rank raises the same StepFailedError on every rank. The failing
        rank drains the pass (Executor.drain: the rest of its communication, abort headers for its sends), its
        neighbours drain once they receive an abort header, and a failure flag over every rank at the end
        tells the rest: every rank leaves the pass in step, with nothing in flight, and drops the step."""
        self._refuse_if_failed()
        failed: Optional[BaseException] = None
        try:
            self.executor.start_pass(batch, actions)
            self.executor.run()
            if actions is None:
                self.executor.end_pass()
        except PeerAborted:
            self.executor.drain(received_abort=True)
        except TransportError:
            self._refuse_if_announced()  # a peer that failed outside a pass said why
            raise
        except Exception as exc:
            broken = self.executor.transport.broken  # type: ignore[attr-defined]
            if isinstance(exc, AgentLostError) or broken or self.executor.failed_communicating:
                raise  # the channels are not in step: nothing to drain through
            if self.tp_group is not None and not isinstance(exc, StepFailedError):
                # this rank's tensor-parallel peers may wait inside a layer's collective that it will not join,
                # so no drain can end the pass in step: the first failure goes to the store, and every rank
                # (its peers at their timeout) raises it; the run is refused from then on
                self._refuse_if_announced()  # a peer failed first: that is why this collective broke
                self.failure = self._report(exc)
                _store_set(FAILURE_KEY, self.failure)
                raise
            self.executor.drain()
            failed = exc
        self._agree_on_pass(failed)

    def _agree_on_pass(self, failed: Optional[BaseException]) -> None:
        """Every rank learns whether a rank's pass failed (one MAX all-reduce of a flag); if one did, every
        rank raises the failing ranks' first report."""
        flag = self.wire.copy(torch.tensor([float(failed is not None)], dtype=torch.float64))
        self._polled(
            "failure check", lambda: dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.world_group, async_op=True)
        )
        if float(flag.cpu()[0]) == 0:
            return
        reports = self.all_gather(self._report(failed) if failed is not None else None)
        report = next(r for r in reports if r is not None)
        raise StepFailedError(
            f"{report}; every rank dropped the step (nothing of it was applied): the next step is the one it would "
            "have been",
            report,
            dropped=True,
        ) from failed

    def _report(self, error: BaseException) -> str:
        """'rank R (stage S) failed in a step: Type: first line' (one line, at most 300 characters)."""
        text = str(error).splitlines()[0][:300] if str(error) else ""
        return f"rank {self.rank} (stage {self.mesh.stage}) failed in a step: {type(error).__name__}: {text}"

    def sum_over_replicas(self, grads: List[torch.Tensor], owners: Optional[List[int]] = None) -> List[torch.Tensor]:
        if self.replicas == 1 or not grads:
            return grads
        for owner, part in _by_owner(grads, owners, self.replicas):
            if owner is None:
                op = functools.partial(dist.all_reduce, op=dist.ReduceOp.SUM, group=self.dp_group, async_op=True)
            else:  # a sharded optimizer: the sum is needed on its owner only
                dst = self.mesh.rank_of(owner, self.mesh.stage, self.mesh.t)
                op = functools.partial(dist.reduce, dst=dst, op=dist.ReduceOp.SUM, group=self.dp_group, async_op=True)
            self._bucketed("sum over replicas", part, op, keep=owner in (None, self.replica))
        return grads

    def share_owned(self, parameters: List[torch.nn.Parameter], owners: List[int]) -> None:
        """A sharded optimizer: every parameter as its owner stepped it, on every replica (one broadcast a bucket)."""
        if self.replicas == 1:
            return
        with torch.no_grad():
            for owner in range(self.replicas):
                part = [p.detach() for p, o in zip(parameters, owners) if o == owner]
                src = self.mesh.rank_of(owner, self.mesh.stage, self.mesh.t)
                op = functools.partial(dist.broadcast, src=src, group=self.dp_group, async_op=True)
                self._bucketed("parameter broadcast", part, op, keep=owner != self.replica)

    def _bucketed(self, what: str, tensors: List[torch.Tensor], op: Callable, keep: bool) -> None:
        """``op(flat)`` (an asynchronous collective) on ``tensors``, a bucket at a time, in place: one flat copy of
        them all would hold them twice. ``keep``: copy its result back into a bucket of several tensors."""
        for bucket in _buckets(tensors):
            alone = len(bucket) == 1 and bucket[0].is_contiguous()
            flat = bucket[0].view(-1) if alone else torch.cat([t.reshape(-1) for t in bucket])
            wired = self.wire.out(flat)
            self._polled(what, functools.partial(op, wired))
            if keep:
                self.wire.into(flat, wired)
            if not alone and keep:
                for t, chunk in zip(bucket, flat.split([t.numel() for t in bucket])):
                    t.copy_(chunk.view_as(t))

    def gather_owned(self, states: List[Optional[Dict[str, Any]]], owners: List[int]) -> List[Optional[Dict[str, Any]]]:
        """A sharded optimizer's state on replica 0 (which writes the stage's checkpoint file): each parameter's
        state as its owner holds it (``states[k]``: this replica's, None where another owns it), sent point to
        point, one tensor in flight, onto replica 0's CPU. The other replicas get ``states`` back as they were."""
        if self.replicas == 1:
            return states
        out = list(states)
        for k, owner in enumerate(owners):
            if owner != 0 and self.replica == owner:
                self._send_state(states[k] or {}, self.mesh.rank_of(0, self.mesh.stage, self.mesh.t))
            elif owner != 0 and self.replica == 0:
                out[k] = self._recv_state(self.mesh.rank_of(owner, self.mesh.stage, self.mesh.t))
        return out

    def _send_state(self, state: Dict[str, Any], dst: int) -> None:
        """One parameter's optimizer state to ``dst``: a header (plain values, and each tensor's shape and dtype),
        then each tensor from this rank's device."""
        header = [{k: (_TENSOR, tuple(v.shape), v.dtype) if torch.is_tensor(v) else v for k, v in state.items()}]
        send = functools.partial(dist.send_object_list, header, dst, self.dp_group, self.wire.host)
        self._collective("optimizer state gather", send)
        for v in state.values():
            if torch.is_tensor(v):
                tensor = self.wire.out(v, pinned=False)
                self._collective("optimizer state gather", functools.partial(dist.send, tensor, dst, self.dp_group))

    def _recv_state(self, src: int) -> Dict[str, Any]:
        """``_send_state``'s state from ``src``, its tensors on the CPU."""
        header: List[Any] = [None]
        receive = functools.partial(dist.recv_object_list, header, src, self.dp_group, self.wire.host)
        self._collective("optimizer state gather", receive)
        out: Dict[str, Any] = {}
        for k, v in header[0].items():
            if isinstance(v, tuple) and v and v[0] == _TENSOR:
                buffer = self.wire.empty(v[1], v[2], pinned=False)
                self._collective("optimizer state gather", functools.partial(dist.recv, buffer, src, self.dp_group))
                v = buffer.cpu()
            out[k] = v
        return out

    def combine_tied(self, stage: Stage, grads: List[torch.Tensor]) -> List[torch.Tensor]:
        if stage.tie is None or self.tie_group is None:
            return grads

        def all_reduce(total: torch.Tensor) -> None:
            wired = self.wire.out(total)
            self._polled(
                "tied weight sum",
                lambda: dist.all_reduce(wired, op=dist.ReduceOp.SUM, group=self.tie_group, async_op=True),
            )
            self.wire.into(total, wired)

        return stage.tie.combine_across(grads, stage.parameters, all_reduce)

    def total(self, value: torch.Tensor) -> torch.Tensor:
        value = self.wire.copy(value.to(torch.float64))
        self._polled(
            "loss total", lambda: dist.all_reduce(value, op=dist.ReduceOp.SUM, group=self.world_group, async_op=True)
        )
        return value.cpu()

    def all_gather(self, obj: Any) -> List[Any]:
        out: List[Any] = [None] * dist.get_world_size()
        self._collective("all-gather", lambda: dist.all_gather_object(out, obj, group=self.world_group))
        return out

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        box = [obj]
        self._collective("broadcast", lambda: dist.broadcast_object_list(box, src=0, group=self.world_group))
        return box[0]

    def gather_state(self) -> Optional[Dict[str, torch.Tensor]]:
        """The whole model's state dict on rank 0 (CPU tensors); None on the other ranks.

        Tensor by tensor, point to point: replica 0's stage k sends its tensors to rank 0 one at
        a time, so no other rank ever holds another stage's weights, and rank 0 holds only what
        it returns (plus one tensor in flight). Under tensor parallelism the stage's rank 0 first joins
        each split tensor's slices, one tensor at a time. Refused, with the failure, once the ranks are out of
        step."""
        self._refuse_if_failed()
        self._refuse_if_announced()
        own = self._whole_state() if self.replica == 0 else {}
        if self.rank == 0:
            merged = {k: v.detach().cpu() for k, v in own.items()}
            for stage in range(1, self.mesh.stages):
                src = self.mesh.rank_of(0, stage)
                header: List[Any] = [None]
                self._collective(
                    "state gather", functools.partial(dist.recv_object_list, header, src, self.world_group)
                )
                for name, dtype, shape in header[0]:
                    buffer = self.wire.empty(shape, dtype, pinned=False)
                    self._collective("state gather", functools.partial(dist.recv, buffer, src, self.world_group))
                    merged[name] = buffer.cpu()
            return {k: merged[k] for k in self.state_keys if k in merged}
        if self.replica == 0 and self.mesh.t == 0:
            listing = [[(k, v.dtype, tuple(v.shape)) for k, v in own.items()]]
            self._collective("state gather", functools.partial(dist.send_object_list, listing, 0, self.world_group))
            for v in own.values():
                sent = self.wire.out(v.detach(), pinned=False)
                self._collective("state gather", functools.partial(dist.send, sent, 0, self.world_group))
        return None

    def _whole_state(self) -> Dict[str, torch.Tensor]:
        """The stage's state dict with every split tensor whole (on its tensor-parallel rank 0; the slices
        elsewhere, which are not used)."""
        state = self.stage.named_state()
        split = self.stage.slices()
        whole = self.gather_slices(self.stage, [(v, split.get(k)) for k, v in state.items()])
        return dict(zip(state, whole)) if whole is not None else state

    def gather_slices(
        self, stage: Stage, items: List[Tuple[torch.Tensor, Optional[Shard]]]
    ) -> Optional[List[torch.Tensor]]:
        """Each (tensor, its slice or None: held whole) whole on the stage's tensor-parallel rank 0, one tensor at a
        time; None on the other ranks (every rank of the stage calls it with its own slices, in one order)."""
        if self.tp_group is None:
            return [t for t, _ in items]
        root, mine = self.mesh.rank_of(self.replica, self.mesh.stage, 0), self.mesh.t == 0
        out = []
        for value, shard in items:
            if shard is None:
                out.append(value)
                continue
            # on the wire (NCCL: the rank's GPU, where a sharded optimizer's gathered state is on the CPU)
            sent = self.wire.out(value.detach(), pinned=False)
            parts = (
                [self.wire.empty(sent.shape, sent.dtype, pinned=False) for _ in range(self.mesh.tensor_parallel)]
                if mine
                else None
            )
            self._collective("tensor-parallel gather", functools.partial(dist.gather, sent, parts, root, self.tp_group))
            out.append(torch.cat(parts, dim=shard.dim).to(value.device) if parts is not None else value)
        return out if mine else None

    def abort_step(self, error: BaseException) -> None:
        """Drop what the step left here. A step every rank dropped together (StepFailedError.dropped) leaves the
        run in step; any other failure does not (another rank may be past this step, or waiting in it): it is
        remembered, refused from then on, and said in the store, where waiting collectives look for it."""
        self.stage.reset()
        self.executor.state = None
        if isinstance(error, StepFailedError) and error.dropped:
            return
        if self.failure is None:
            if isinstance(error, StepFailedError):  # another rank's failure, learnt from the store
                self.failure = error.report
            else:
                self.failure = self._report(error)
                _store_set(FAILURE_KEY, self.failure)

    def close(self) -> None:
        self.stage.close()

    def _refuse_if_failed(self) -> None:
        if self.failure is not None:
            raise StepFailedError(_refusal(self.failure), self.failure)

    def _refuse_if_announced(self) -> None:
        """Raise (and remember) a failure another rank said in the store."""
        report = _store_get(FAILURE_KEY)
        if report is not None:
            self.failure = self.failure or report
            raise StepFailedError(_refusal(report), report)

    def _polled(self, what: str, start: Callable[[], Any]) -> None:
        """An asynchronous collective, waited for while looking in the store for another rank's failure
        (every POLL_S once it takes that long): a rank whose step failed outside a pass, or that gave up,
        ends the wait at once instead of after the timeout."""
        self._refuse_if_failed()
        began, pause = time.monotonic(), 1e-4
        try:
            work = start()
            while not work.is_completed():
                time.sleep(pause)
                pause = min(2 * pause, POLL_S)
                if time.monotonic() - began >= POLL_S:
                    self._refuse_if_announced()
            work.wait()
        except PipeDPError:
            raise
        except RuntimeError as exc:
            self._refuse_if_announced()
            raise TransportError(
                f"rank {self.rank}: the {what} over every rank got no answer (a rank stopped answering or died; "
                f"{str(exc).splitlines()[0][:200]})"
            ) from exc

    def _collective(self, what: str, operation: Callable[[], Any]) -> None:
        """Run a blocking collective (refused once the ranks are out of step); a timeout or a broken peer
        becomes an error that says so (another rank's failure, if it said one)."""
        self._refuse_if_failed()
        try:
            operation()
        except RuntimeError as exc:
            self._refuse_if_announced()
            raise TransportError(
                f"rank {self.rank}: the {what} over every rank got no answer (a rank stopped answering or died; "
                f"{str(exc).splitlines()[0][:200]})"
            ) from exc
