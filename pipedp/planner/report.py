"""The plan: one micro-batch's memory (``Profile``), a pass composed of them along the schedule's actions
(``compose``), each stage's plan, the whole plan and its text form.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from .static import StaticBytes


def format_bytes(n: float) -> str:
    """Binary units, 3 significant digits (GiB for a GPU's memory)."""
    sign, n = ("-" if n < 0 else ""), abs(float(n))
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            value = n / scale
            return f"{sign}{value:.3g} {unit}" if value < 100 else f"{sign}{value:.0f} {unit}"
    return f"{sign}{n:.0f} B"


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
