"""The memory planner's model side: what each stage holds, in bytes, before anything is run.

``pipedp plan`` (pipedp/cli/plan.py) predicts each stage's peak memory from the model built on the
meta device and split by pipedp's own adapter and partition, so the stages are the ones training uses:

- weights: the stage's own parameters and buffers (each rank loads only its stage), in their dtype;
- trainable state: the float32 clipped-sum buffer of each trainable parameter (it becomes ``p.grad``;
  under bf16-true a bf16 copy of it is made for the step);
- optimizer state: Adam / AdamW 2 tensors, SGD with momentum 1, per trainable parameter, in its dtype
  (float32 masters under bf16-mixed, bf16 under bf16-true), created at the first step;
- activations: not a formula. Micro-batches run on fake tensors (no memory, no arithmetic) through
  pipedp's own stages and executor (pipedp/cli/plan.py), while ``MemoryTracker`` counts the bytes of every
  storage each stage's operations create and frees them when torch frees them: autograd's saved
  tensors, the captured layer inputs and outputs, the output-gradients and kept per-sample gradients
  between I and W, Gram matrices, messages, the clipped sums. Each action's effect (a ``Profile``) is
  composed along the schedule's action order into the stage's peak (``compose``).

This module holds what needs no runtime (layer 2): the tracker, the static bytes, the profiles and their
composition, the result types, their text form and the search for the largest micro-batch size that fits.
"""

from __future__ import annotations

import weakref
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..shards import owners
from .blocks import Block


def format_bytes(n: float) -> str:
    """Binary units, 3 significant digits (GiB for a GPU's memory)."""
    sign, n = ("-" if n < 0 else ""), abs(float(n))
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            value = n / scale
            return f"{sign}{value:.3g} {unit}" if value < 100 else f"{sign}{value:.0f} {unit}"
    return f"{sign}{n:.0f} B"


# ---- the tracker ------------------------------------------------------------------------------------
_aten = torch.ops.aten
_READS = (_aten._local_scalar_dense.default, _aten.equal.default, _aten.is_nonzero.default)


class MemoryTracker(TorchDispatchMode):
    """Counts, per stage, the bytes of the storages that operations create while it is active (on real or
    fake tensors alike), and frees them when torch frees the storage. ``stage`` and ``phase`` say whom an
    allocation belongs to; storages that existed before (parameters, buffers) are never counted.

    On fake tensors, a value read back (``.item()``, ``bool(t)``, ``torch.equal``) gets a stand-in: True for
    a bool (an all-ones attention mask; "some row has clip factor 0", so W takes its zeroing path, as with
    padded micro-batches; equal tensors), 0.0 for a float (a self-check error of zero), 1 for an integer."""

    def __init__(self, stages: int, answer_reads: bool = True):
        super().__init__()
        self.stage, self.phase = 0, ""
        self.answer_reads = answer_reads
        self.current = [0] * stages
        self.peak = [0] * stages
        self.peak_phase = [""] * stages
        self.live: Dict[int, Tuple[int, int, str]] = {}  # storage -> (stage, bytes, phase)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.answer_reads and func in _READS and is_fake(args[0]):
            t = args[0]
            if func is not _aten._local_scalar_dense.default:
                return True
            return True if t.dtype == torch.bool else 0.0 if t.is_floating_point() else 1
        out = func(*args, **kwargs)
        fresh = _fresh_outputs(func)
        if isinstance(out, torch.Tensor):
            if fresh[0]:
                self._add(out)
        elif isinstance(out, (tuple, list)):
            for t, new in zip(out, fresh):
                if new and isinstance(t, torch.Tensor):
                    self._add(t)
                elif new and isinstance(t, (tuple, list)):  # a list of tensors (split, unbind, foreach ops)
                    for u in t:
                        if isinstance(u, torch.Tensor):
                            self._add(u)
        return out

    def _add(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self.live:  # (an op may return one new tensor twice)
            return
        nbytes = storage.nbytes()
        self.live[key] = (self.stage, nbytes, self.phase)
        s = self.stage
        self.current[s] += nbytes
        if self.current[s] > self.peak[s]:
            self.peak[s], self.peak_phase[s] = self.current[s], self.phase
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        entry = self.live.pop(key, None)
        if entry is not None:
            self.current[entry[0]] -= entry[1]


_FRESH: Dict[object, Tuple[bool, ...]] = {}


def _fresh_outputs(func) -> Tuple[bool, ...]:
    """Per output of the operator, whether it is a new tensor: its schema marks the outputs that alias an
    input (views, in-place and out= variants), which own no new storage."""
    fresh = _FRESH.get(func)
    if fresh is None:
        returns = getattr(getattr(func, "_schema", None), "returns", None)
        fresh = tuple(r.alias_info is None for r in returns) if returns else (True,)
        _FRESH[func] = fresh or (True,)
    return fresh


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def is_fake(t: torch.Tensor) -> bool:
    return t.is_meta or type(t).__name__ == "FakeTensor"


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """The bytes of the distinct storages behind ``tensors``."""
    seen: Dict[int, int] = {}
    for t in tensors:
        seen.setdefault(_key(t), t.untyped_storage().nbytes())
    return sum(seen.values())


# ---- what a stage holds whatever the batch ------------------------------------------------------------
@dataclass(frozen=True)
class StaticBytes:
    params: int  # parameter elements of the stage
    trainable: int  # of them trainable
    frozen_bytes: int  # frozen parameters, in their dtype
    trainable_bytes: int  # trainable parameters (float32 masters under bf16-mixed)
    buffer_bytes: int  # buffers (rotary frequencies, ...)
    grads: int  # the clipped sums (p.grad), float32 (float64 for float64 parameters)
    grad_copies: int  # at the step, p.grad in the parameter's dtype where it is not the sum's (bf16-true)
    largest_copy: int  # the largest of those: it exists next to every sum (they are converted one at a time)
    stepped_grads: int  # p.grad as the optimizer steps: the copies, and the sums that need none
    optimizer: int  # the optimizer's state, created at the first step
    step_temporaries: int  # the optimizer's largest transient (Adam: one temporary of the largest tensor)


def stage_tensors(blocks: Sequence[Block]) -> Tuple[List[nn.Parameter], List[torch.Tensor]]:
    """The distinct parameters and buffers of a stage's blocks."""
    params: Dict[int, nn.Parameter] = {}
    buffers: Dict[int, torch.Tensor] = {}
    for b in blocks:
        for p in b.module.parameters():
            params.setdefault(id(p), p)
        for t in b.module.buffers():
            buffers.setdefault(id(t), t)
    return list(params.values()), list(buffers.values())


def static_bytes(
    blocks: Sequence[Block],
    optimizer: str = "adamw",
    momentum: float = 0.0,
    fused: bool = True,
    weight_decay: float = 0.0,
    shard_over: int = 1,
) -> StaticBytes:
    """``blocks`` as the trainer holds them (after LoRA and the precision's dtype changes). With Adam's fused
    kernel (``fused``, the CLI's on CPU and CUDA) or SGD without weight decay the gradients are narrowed
    inside the float32 sums' storage, so no copy exists beside the sums (train/narrowing.py's
    ``steps_without_temporaries``; SGD's weight decay is taken as applying to some trainable parameter).
    ``shard_over``: the replicas a sharded optimizer splits the stage's parameters over (pipedp.shards.owners):
    the optimizer's state and the gradients it steps are those of the replica that owns the most bytes."""
    params, buffers = stage_tensors(blocks)
    trainable = [p for p in params if p.requires_grad]
    every = trainable
    if shard_over > 1:  # the replica with the largest share
        owner = owners([p.numel() * p.element_size() for p in trainable], shard_over)
        shares = [[p for p, o in zip(trainable, owner) if o == r] for r in range(shard_over)]
        trainable = max(shares, key=lambda ps: sum(p.numel() * p.element_size() for p in ps))
    frozen = [p for p in params if not p.requires_grad]

    def size(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    def sum_dtype(p: torch.Tensor) -> torch.dtype:  # per-sample arithmetic is float32 at least
        return torch.float64 if p.dtype == torch.float64 else torch.float32

    grads = sum(p.numel() * sum_dtype(p).itemsize for p in every)  # every replica makes every clipped sum
    stepped = sum(p.numel() * sum_dtype(p).itemsize for p in trainable)  # the sums that become gradients here
    copies = sum(size(p) for p in trainable if p.dtype != sum_dtype(p))
    per_param = {"adam": 2, "adamw": 2}.get(optimizer, 1 if momentum else 0)
    largest = max((size(p) for p in trainable), default=0)
    largest_copy = max((size(p) for p in trainable if p.dtype != sum_dtype(p)), default=0)
    adam = optimizer in ("adam", "adamw")
    in_storage = fused if adam else not weight_decay  # narrowing.steps_without_temporaries
    if in_storage:  # each gradient keeps its sum's storage: no copy beside the sums, the sums' bytes stepped
        largest_copy, copies = 0, 0
    return StaticBytes(
        params=sum(p.numel() for p in params),
        trainable=sum(p.numel() for p in every),
        frozen_bytes=sum(size(p) for p in frozen),
        trainable_bytes=sum(size(p) for p in every),
        buffer_bytes=sum(size(t) for t in buffers),
        grads=grads,
        grad_copies=copies,
        largest_copy=largest_copy,
        stepped_grads=stepped if in_storage else sum(size(p) for p in trainable),  # else p.grad in p's dtype
        optimizer=per_param * sum(size(p) for p in trainable),
        step_temporaries=largest if per_param and not (adam and fused) else 0,
    )


# ---- one micro-batch's memory, and a pass composed of them ---------------------------------------------
@dataclass
class Profile:
    """What each action of one micro-batch does to a stage's memory, from a simulated pass:
    ``actions[kind] = (delta, rise)``, the bytes it leaves held (negative: frees) and its peak above the
    level before it."""

    actions: Dict[str, Tuple[int, int]]
    held: int = 0  # the micro-batch's bytes from its F to its I (graph, captures, the received input)
    kept: int = 0  # its per-sample gradients kept from I to W

    def towards(self, other: "Profile", t: float) -> "Profile":
        """The profile a fraction ``t`` of the way to ``other`` (t may be outside [0, 1]): every held tensor
        has the batch first, so a profile is affine in the micro-batch size."""

        def mix(a: float, b: float) -> int:
            return int(round(a + t * (b - a)))

        zero = (0, 0)
        actions = {}
        for k in set(self.actions) | set(other.actions):
            (d0, r0), (d1, r1) = self.actions.get(k, zero), other.actions.get(k, zero)
            actions[k] = (mix(d0, d1), mix(r0, r1))
        return Profile(actions, mix(self.held, other.held), mix(self.kept, other.kept))


def compose(actions: Sequence, first: Profile, rest: Profile) -> Tuple[int, str]:
    """(peak bytes, the action kind at it) of a stage running ``actions`` (schedules.Action, one pass), its
    micro-batch 0 doing what ``first`` says (it makes the clipped sums; the self-check probes it) and the
    others what ``rest`` says."""
    level = peak = 0
    phase = ""
    for a in actions:
        kind = a.kind.value
        delta, rise = (first if a.microbatch == 0 else rest).actions.get(kind, (0, 0))
        if level + rise > peak:
            peak, phase = level + rise, kind
        level += delta
    return peak, phase


# ---- the result -----------------------------------------------------------------------------------------
@dataclass
class StagePlan:
    index: int
    blocks: str  # the block names, shortened
    static: StaticBytes
    per_microbatch: int  # bytes one micro-batch's forward leaves held until its I (graph and captures)
    in_flight: int  # the schedule's peak in-flight micro-batches on this stage
    kept: int  # per-sample gradients kept from I to W at the pass's peak (those of one micro-batch x held)
    pass_peak: int  # the simulated peak of one pass (activations, messages, clipped sums, transients)
    pass_phase: str  # the action during which it happened (F, I, W, ...)
    first_pass_peak: Optional[int] = None  # the first step's pass, with the self-check (None: off)
    ways: Dict[str, int] = field(default_factory=dict)  # how many layers take each way (keep / ghost / ...)

    @property
    def weights(self) -> int:
        return self.static.frozen_bytes + self.static.trainable_bytes + self.static.buffer_bytes

    @property
    def activations(self) -> int:
        return self.per_microbatch * self.in_flight

    @property
    def steady(self) -> int:
        """A later step's pass: weights, the optimizer's state, the pass."""
        return self.weights + self.static.optimizer + self.pass_peak

    @property
    def at_step(self) -> int:
        """The update: weights and optimizer state, with every clipped sum (noised in place) while they become
        the optimizer's gradients one at a time, or the gradients and the optimizer's temporary as it steps."""
        s = self.static
        converting = s.grads + s.largest_copy
        stepping = s.stepped_grads + s.step_temporaries
        return self.weights + s.optimizer + max(converting, stepping)

    @property
    def first_step(self) -> int:
        """The first step's pass (with the self-check; no optimizer state yet)."""
        return self.weights + (self.first_pass_peak if self.first_pass_peak is not None else self.pass_peak)

    @property
    def total(self) -> int:
        return max(self.steady, self.at_step, self.first_step)

    @property
    def on_gpu(self) -> int:
        """``total`` with the CUDA allowance of one process per stage (an estimate: see cuda_allowance)."""
        return cuda_allowance(self.total)

    @property
    def binding(self) -> str:
        """Which moment sets the peak."""
        moments = {"later steps": self.steady, "optimizer step": self.at_step, "first step": self.first_step}
        return max(moments, key=moments.__getitem__)

    @property
    def other(self) -> int:
        """The steady peak less its named parts: transients of I and W (output-gradients, per-sample
        gradients, Gram matrices), captures held from I to W, messages in flight."""
        s = self.static
        return self.steady - (self.weights + s.grads + s.optimizer + self.activations + self.kept)

    def as_dict(self) -> dict:
        out = asdict(self)
        for name in ("weights", "activations", "steady", "at_step", "first_step", "total", "on_gpu", "binding"):
            out[name] = getattr(self, name)
        return out


# What a CUDA process holds beyond its tensors. ESTIMATES, not yet measured (no GPU has run pipedp): a first
# GPU run (python -m bench.gpu_check, its "peak memory vs planner" rows) replaces them with measured figures.
CUDA_CONTEXT_BYTES = 512 << 20  # the CUDA context, kernels loaded lazily, cuBLAS / cuDNN workspaces
ALLOCATOR_SLACK = 0.10  # reserved but unused by the caching allocator (fragmentation), of the tensor peak
NCCL_BUFFER_BYTES = 128 << 20  # NCCL's buffers for a stage's communicators (its neighbours, the norm reduce)


def cuda_allowance(tensor_bytes: int) -> int:
    """A stage's predicted bytes on a GPU, one process per stage: its tensors, the allocator's slack, the
    CUDA context and NCCL's buffers."""
    return int(tensor_bytes * (1 + ALLOCATOR_SLACK)) + CUDA_CONTEXT_BYTES + NCCL_BUFFER_BYTES


@dataclass
class Plan:
    description: str
    microbatch_size: int
    seq_len: int
    stages: List[StagePlan]
    device_memory: Optional[int] = None
    largest_fit: Optional[int] = None  # the largest micro-batch size that fits on every stage (0: none)
    fit_note: str = ""

    def as_dict(self) -> dict:
        return {
            "description": self.description,
            "microbatch_size": self.microbatch_size,
            "seq_len": self.seq_len,
            "device_memory": self.device_memory,
            "largest_fit": self.largest_fit,
            "stages": [s.as_dict() for s in self.stages],
        }


def format_plan(plan: Plan) -> str:
    cols = ["stage", "blocks", "weights", "grads", "optimizer", "activations", "kept", "other", "peak", "set by"]
    rows = []
    for s in plan.stages:
        act = f"{s.in_flight} x {format_bytes(s.per_microbatch)}"
        rows.append(
            [
                str(s.index),
                s.blocks,
                format_bytes(s.weights),
                format_bytes(s.static.grads),
                format_bytes(s.static.optimizer),
                act,
                format_bytes(s.kept),
                format_bytes(s.other),
                format_bytes(s.total),
                s.binding,
            ]
        )
    widths = [max(len(c), *(len(r[k]) for r in rows)) for k, c in enumerate(cols)]
    lines = [plan.description, ""]
    lines.append("  ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip())
    for r in rows:
        lines.append("  ".join(v.ljust(w) if k < 2 else v.rjust(w) for k, (v, w) in enumerate(zip(r, widths))))
    lines.append("")
    for s in plan.stages:
        parts = [
            f"later steps {format_bytes(s.steady)} (pass peak in {s.pass_phase or '-'})",
            f"optimizer step {format_bytes(s.at_step)}",
        ]
        if s.first_pass_peak is not None:
            parts.append(f"first step with the self-check {format_bytes(s.first_step)}")
        ways = ", ".join(f"{n} {w}" for w, n in sorted(s.ways.items()))
        lines.append(f"stage {s.index}: " + "; ".join(parts) + (f"; layers: {ways}" if ways else ""))
    lines.append(
        "weights: the stage's own parameters and buffers; grads: its clipped sums (float32); optimizer: its state "
        "from the first step on; activations: what one micro-batch holds from F to I (autograd's saved tensors, "
        "the captures) x the schedule's most in flight; kept: per-sample gradients held from I to W; other: the "
        "rest of a later step's simulated peak (I and W transients, captures held until W, messages); peak: the "
        "largest of a later step, the optimizer step and the first step (its self-check). Tensor bytes only: "
        "allocator slack and a CUDA context come on top."
    )
    on_gpu = " / ".join(format_bytes(s.on_gpu) for s in plan.stages)
    lines.append(
        f"on a GPU (one process per rank), estimated: {on_gpu} (the peak + {ALLOCATOR_SLACK:.0%} allocator slack + "
        f"{format_bytes(CUDA_CONTEXT_BYTES)} CUDA context + {format_bytes(NCCL_BUFFER_BYTES)} NCCL buffers; "
        "estimates until a GPU run measures them)"
    )
    if plan.device_memory is not None:
        lines.append(plan.fit_note)
    return "\n".join(lines)


# ---- the largest micro-batch size that fits ---------------------------------------------------------
def largest_fit(fits: Callable[[int], bool], limit: int = 1 << 20) -> int:
    """The largest B in 1..limit with ``fits(B)`` (0 if none), for ``fits`` true up to some B and false after
    (memory grows with the micro-batch size)."""
    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and fits(hi):
        lo, hi = hi, 2 * hi
    hi = min(hi, limit + 1)
    while hi - lo > 1:  # fits(lo), not fits(hi) (or hi past the limit)
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo
