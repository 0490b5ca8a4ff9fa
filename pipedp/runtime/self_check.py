"""The self-check: at the first step of each input shape, pipedp's per-sample gradients are compared
with each sample's gradient computed alone — a check that verifies rather than guesses.

For every real row r of the pass's first micro-batch, every stage also backpropagates the gradient of
row r's loss alone (a separate backward through the stage's retained graph, seeded on the last stage
by the loss of row r and then by the probe messages each stage sends back behind its gradient), and
compares, for each trainable parameter p of the stage:
- the per-sample gradient its W pass would use for row r (the kept tensor, or the layer's rule
  applied to row r's captures) with d loss_r / d p;
- the per-sample squared norm its I pass computed for row r with ||d loss_r / d p||^2.
Whatever makes pipedp's per-sample gradients wrong shows as a mismatch: a layer that sees the batch
in another dimension (time-first attention), samples mixed inside a layer, a parameter read outside
the call of its module, an in-place change of a layer's output, a wrong layer rule. The sum over the
micro-batch (W with every clip factor 1 against autograd's gradient of the micro-batch) tells those
causes apart in the refusal. The comparison is exact up to the arithmetic of the parameters' dtype
(relative, with an absolute floor relative to the sample's whole gradient on the stage), or of the dtype a
layer's outputs had where it computes in less; the check that the forward keeps samples apart, up to the
output dtype's rounding, or FLOAT32_INSIDE for a float64 output whose forward computed in float32 too
(``Precisions`` records what it computed in).
"""

from __future__ import annotations

import copy
import math
import warnings
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from ..errors import UnsupportedModelError
from ..rounding import ELEMENT_WISE, FLOAT32_INSIDE
from .microbatch import Activation, Inputs


@dataclass(frozen=True)
class Probe:
    """Which privacy units of a micro-batch are checked, and (off the last stage) the gradient of each unit's
    loss alone with respect to this stage's output, received behind the gradient message."""

    units: Tuple[int, ...]
    messages: Tuple[Activation, ...] = ()


def signature(inputs: Inputs) -> tuple:
    """The shapes and dtypes of a micro-batch's inputs, its rows included (a cross-sample effect shows only
    where a micro-batch holds two samples or more): a new one is checked anew."""
    if isinstance(inputs, dict):
        return tuple((k, tuple(v.shape), v.dtype) for k, v in sorted(inputs.items()))
    return (tuple(inputs.shape), inputs.dtype)


def units_to_check(mask: torch.Tensor) -> Tuple[int, ...]:
    """Every real privacy unit of the micro-batch (``mask``: one entry per unit): a model that mixes two units is
    caught whichever."""
    return tuple(torch.nonzero(mask > 0).flatten().tolist())


def refuse_coupled_loss(stage: int, loss_fn, out, targets, losses, size: int, spans: Sequence[slice]) -> None:
    """A per-sample loss depends on its own sample only: each checked unit's loss computed from its own outputs
    and targets alone must equal its loss in the batch. A loss reading other samples (a contrastive loss
    against in-batch targets, a loss normalised over the batch) passes the gradient check, since its gradients
    are per-sample functions of the parameters, yet one record moves every other sample's loss, so the clipped
    sum's sensitivity is no longer C."""
    if not any(isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == size for t in _leaves(out)):
        return  # no batch-first output to take a sample's rows of: nothing to compare
    rtol = ELEMENT_WISE.get(losses.dtype, ELEMENT_WISE[torch.float32])[0]
    again = loss_fn(out, targets)  # from another random state than the batch's own: a random loss shows
    if not same_values(losses.detach(), again, rtol):
        warnings.warn(
            f"stage {stage}: loss_fn draws random numbers, so the self-check cannot verify that each sample's loss "
            "depends on its own sample only",
            stacklevel=3,
        )
        return
    for span in spans:
        try:
            alone = loss_fn(rows(out, span, size), targets[span])
        except Exception as exc:
            raise UnsupportedModelError(
                f"stage {stage}: loss_fn fails on one sample's outputs and targets alone ({type(exc).__name__}: "
                f"{str(exc)[:160]}): a per-sample loss must be computable from its own sample only"
            ) from exc
        want = losses[span].detach().double()
        if not isinstance(alone, torch.Tensor) or alone.shape != want.shape:
            continue  # a shape error of the loss is _checked_losses's to name
        if not bool(torch.isclose(alone.double(), want, rtol=rtol, atol=rtol, equal_nan=True).all()):
            raise UnsupportedModelError(
                f"stage {stage}: loss_fn reads other samples: the loss of rows {span.start}..{span.stop - 1} is "
                f"{want.tolist()} in the micro-batch and {alone.double().tolist()} computed alone (e.g. a "
                "contrastive loss such as InfoNCE against in-batch targets, a loss normalised over the batch, or "
                "divided by its size). "
                "One record would move every other sample's loss, so the clipped sum's sensitivity is not the clip "
                "norm: compute each sample's loss from its own outputs and targets only (negatives from a fixed, "
                "public set, or from inside the sample)"
            )


def _leaves(value) -> List[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _leaves(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _leaves(v)]
    return []


def same_values(a, b, rtol: float) -> bool:
    """The tensors of ``a`` and ``b`` (a tensor, or a tuple, list or dict of them) equal to ``rtol``."""
    left, right = _leaves(a), _leaves(b)
    return len(left) == len(right) and all(_close(x, y, rtol) for x, y in zip(left, right))


def _close(x: torch.Tensor, y: torch.Tensor, rtol: float) -> bool:
    if x.shape != y.shape or x.dtype != y.dtype:
        return False
    if not x.is_floating_point():
        return bool(torch.equal(x, y))
    x, y = x.detach().double(), y.detach().double()
    scale = float(torch.where(torch.isfinite(y), y.abs(), 0.0).max()) if y.numel() else 0.0  # (no boolean index:
    # the planner runs this on fake tensors, which cannot give a data-dependent shape)
    return bool(torch.isclose(x, y, rtol=rtol, atol=rtol * scale + 1e-300, equal_nan=True).all())


class Precisions(TorchFunctionMode):
    """The floating dtypes the operations of a forward return from tensors (a constant made from none, such as
    torch.tensor(1.0), computes nothing from the data): a float64 model may compute a part in float32 (a router's
    logits cast to float32: the float64 product before the cast rounds by the batch's shape, and the cast may then
    differ by a float32 ulp between a row alone and the row in its micro-batch)."""

    def __init__(self) -> None:
        super().__init__()
        self.dtypes: Set[torch.dtype] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if _leaves(args) or _leaves(kwargs or {}):
            self.dtypes.update(t.dtype for t in _leaves(out) if t.is_floating_point())
        return out


def alone_tolerance(alone, computed: Iterable[torch.dtype] = ()) -> float:
    """The relative tolerance between rows computed alone and in their micro-batch: the rounding of the output's
    dtype; a float64 output whose forward ``computed`` in float32 too, FLOAT32_INSIDE (a few hundred float32 ulps:
    not float32's own tolerance, which is sized for gradients)."""
    dtypes = {t.dtype for t in _leaves(alone) if t.is_floating_point()}
    rtol = max(
        (ELEMENT_WISE.get(d, ELEMENT_WISE[torch.float32])[0] for d in dtypes), default=ELEMENT_WISE[torch.float64][0]
    )
    return FLOAT32_INSIDE if dtypes == {torch.float64} and torch.float32 in set(computed) else rtol


def refuse_mixed(stage: int, batch_rows, alone, span: slice, computed: Iterable[torch.dtype] = ()) -> None:
    """Refuse a stage whose output for rows ``span`` differs between the micro-batch and those rows alone, beyond
    alone_tolerance."""
    if same_values(batch_rows, alone, alone_tolerance(alone, computed)):
        return
    raise UnsupportedModelError(
        f"stage {stage}: its forward mixes samples: the output of rows {span.start}..{span.stop - 1} computed from "
        "those rows alone differs from theirs in the micro-batch (e.g. x - x.mean(0), a hand-written batch norm, "
        "attention or pooling across the batch dimension). One record would move every other sample's output and "
        "gradient, so the clipped sum's sensitivity is not the clip norm: keep every operation within a sample "
        "(nn.BatchNorm: use GroupNorm or LayerNorm)"
    )


def rows(value, span: slice, size: int):
    """``value`` (a model's output: a tensor, a tuple or list, a dict such as a Hugging Face ModelOutput) with
    only the rows ``span`` of its batch-first tensors of ``size`` rows; everything else as it is."""
    if isinstance(value, torch.Tensor):
        return value[span] if value.dim() and value.shape[0] == size else value
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
        return type(value)(*(rows(v, span, size) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(rows(v, span, size) for v in value)
    if isinstance(value, dict):
        out = copy.copy(value)
        for k, v in value.items():
            out[k] = rows(v, span, size)
        return out
    return value


def compute_dtype(precision: str, parameters: Sequence[nn.Parameter], inputs: Sequence[torch.Tensor]) -> torch.dtype:
    """The least precise floating dtype the stage computes in (bf16 under bf16 precisions)."""
    if precision != "32":
        return torch.bfloat16
    dtypes = {p.dtype for p in parameters} | {t.dtype for t in inputs if t.is_floating_point()}
    order = [torch.bfloat16, torch.float16, torch.float32, torch.float64]
    return next((d for d in order if d in dtypes), torch.float32)


@dataclass
class Finding:
    name: str  # the parameter
    unit: str  # the layer owning it ("" when no layer call owns it)
    layer_type: str
    error: float  # the largest mismatch, relative to the norm of the sample's whole gradient on the stage
    per_sample_only: bool  # the micro-batch sum agrees: only the attribution to samples is wrong
    norm_only: bool  # the W-side per-sample gradient agrees, the I-side norm does not
    called: bool  # the owning layer ran in this micro-batch


class Comparison:
    """The comparison of one stage's checked rows, parameter by parameter (so that no more than one
    row's reference gradients and one layer's per-sample gradients are held at a time)."""

    def __init__(self, stage: int, dtype: torch.dtype):
        self.stage = stage
        self.rtol, self.floor = ELEMENT_WISE.get(dtype, ELEMENT_WISE[torch.float32])
        self.findings: Dict[nn.Parameter, Finding] = {}
        self.non_finite_units = False  # the micro-batch holds a sample whose squared norm is not finite
        self.unverified: List[str] = []  # parameters that sample's non-finite values made uncheckable

    @staticmethod
    def scale(reference: Dict[nn.Parameter, torch.Tensor]) -> float:
        """The norm of the row's whole gradient on the stage (the absolute floor's unit), over its finite
        tensors: a non-finite one is judged by itself in add(), and must not make every floor NaN."""
        squares = (_norms(g, None)[0] ** 2 for g in reference.values())
        return sum(s for s in squares if math.isfinite(s)) ** 0.5

    def add(
        self,
        p: nn.Parameter,
        name: str,
        owner: Tuple[str, str],
        called: bool,
        want: Optional[torch.Tensor],
        have: Optional[torch.Tensor],
        squared_norm: float,
        scale: float,
        computed_in: Optional[Iterable[torch.dtype]] = None,
        float32_inside: bool = False,
    ) -> None:
        """One parameter of one row: pipedp's per-sample gradient ``have`` and squared norm against the
        row's own gradient ``want``; ``computed_in``: the dtypes its layer's outputs had, where the tightest of
        their tolerances is looser than the stage's (a router computing in float32 inside a float64 model);
        ``float32_inside``: a float64 layer whose rule computed in float32 too, compared at FLOAT32_INSIDE."""
        if self.non_finite_units and want is not None and not bool(torch.isfinite(want).all()):
            if name not in self.unverified:
                self.unverified.append(name)
            return
        size, _, grad_error = _norms(want, have)
        rtol, floor = self.rtol, self.floor
        known = [ELEMENT_WISE[d] for d in computed_in or () if d in ELEMENT_WISE]
        if known and len(known) == len(list(computed_in or ())):  # (an unknown dtype: the stage's tolerance)
            tightest = min(known)
            rtol, floor = max(rtol, tightest[0]), max(floor, tightest[1])
        if float32_inside:  # (relative to the parameter's own gradient: the floor stays the stage's)
            rtol = max(rtol, FLOAT32_INSIDE)
        allowed = rtol * size + floor * scale + 1e-300
        norm_error = abs(max(squared_norm, 0.0) ** 0.5 - size)
        worst = max(grad_error, norm_error)
        if worst <= allowed:
            return
        relative = worst / max(scale, 1e-300)
        previous = self.findings.get(p)
        if previous is None or relative > previous.error:
            self.findings[p] = Finding(name, owner[0], owner[1], relative, False, grad_error <= allowed, called)

    def refuse_if_any(
        self, sums: Callable[[], Tuple[Dict[nn.Parameter, torch.Tensor], Dict[nn.Parameter, torch.Tensor]]]
    ) -> None:
        """Refuse the model, naming the parameters and the likely cause; ``sums()`` (computed only then):
        pipedp's W with every clip factor 1, and autograd's gradient of the micro-batch."""
        if self.unverified:
            warnings.warn(
                f"stage {self.stage}: the self-check could not verify {', '.join(self.unverified[:6])}"
                f"{' ...' if len(self.unverified) > 6 else ''} for this input shape: the checked micro-batch holds a "
                "sample whose gradient is not finite (left out of the update), which makes every row's own gradient "
                "of those parameters non-finite",
                stacklevel=2,
            )
        if not self.findings:
            return
        got_sum, want_sum = sums()
        for p, finding in self.findings.items():
            want, have = want_sum.get(p), got_sum.get(p)
            if want is None or have is None:
                continue
            want_size, have_size, difference = _norms(want, have)
            finding.per_sample_only = difference <= 10 * self.rtol * max(want_size, have_size) + 1e-300
        raise UnsupportedModelError(_message(self.stage, list(self.findings.values())))


PIECE = 1 << 20  # elements compared at a time


def _norms(want: Optional[torch.Tensor], have: Optional[torch.Tensor]) -> Tuple[float, float, float]:
    """||want||, ||have|| and ||have - want|| in float64 (None: zeros), a piece at a time: float64 copies of a
    whole 32000 x 4096 head and of the difference would cost 3 GB for one comparison."""
    flats = [t.detach().reshape(-1) if t is not None else None for t in (want, have)]
    total = max((f.numel() for f in flats if f is not None), default=0)
    squares = [0.0, 0.0, 0.0]
    for start in range(0, total, PIECE):
        a, b = (f[start : start + PIECE].double() if f is not None else None for f in flats)
        difference = b - a if a is not None and b is not None else (b if a is None else a)
        for k, t in enumerate((a, b, difference)):
            if t is not None:
                squares[k] += float(t.pow(2).sum())
    return squares[0] ** 0.5, squares[1] ** 0.5, squares[2] ** 0.5


def _message(stage: int, findings: List[Finding]) -> str:
    worst = sorted(findings, key=lambda f: -f.error)
    names = ", ".join(f.name for f in worst[:6]) + (" ..." if len(worst) > 6 else "")
    first = worst[0]
    layer = f"layer {first.unit!r} ({first.layer_type})" if first.unit else "the layer using it"
    size = (
        f"(each sample's gradient computed alone differs from pipedp's by up to {first.error:.2g} of the sample's "
        "whole gradient on the stage)"
        if first.error < 1e6
        else "(each sample's gradient computed alone is zero on the stage, and pipedp's is not)"
    )
    if first.norm_only:
        lead = f"the per-sample norms of {names} disagree with their per-sample gradients {size}"
        cause = (
            f"the norm rule of {layer} is wrong (a bug in a registered layer rule); use grad_mode='materialize' "
            "and report it"
        )
    elif first.per_sample_only:
        lead = f"the per-sample gradients of {names} are wrong though their sum over the micro-batch is right {size}"
        cause = (
            f"{layer} does not see the micro-batch as the first dimension of its input (e.g. nn.MultiheadAttention "
            "or Opacus's DPMultiheadAttention with batch_first=False, a layer applied to a transposed [T, batch, ...] "
            "view, a tensor shared by the batch passed by keyword whose first dimension equals the micro-batch's "
            "size by chance, so replayed as one row per sample) or mixes samples; construct it with batch_first=True, "
            "keep the batch dimension first, pass a shared tensor with a leading dimension of 1"
        )
    else:
        lead = f"the gradient of {names} is not all seen by per-sample clipping {size}"
        cause = (
            f"the parameter is used outside the call of the module that owns it ({layer}: a weight read "
            "functionally by another module, an adapter such as LoRA on an embedding), or a layer's output was "
            "changed in place after it ran; call the owning module instead, or freeze the parameter"
        )
    return (
        f"stage {stage}: {lead}: {cause}. (pipedp compares them at the first step of each input shape: "
        "PipelineConfig.self_check)"
    )
