"""One pipeline stage: its blocks, and the three DP passes over a micro-batch.

- forward(j):   run the blocks, capturing every unit's inputs and output under key j.
- backward(j):  the schedule's I: gradients w.r.t. the captured unit outputs and the stage
                input only (no weight gradients), then this stage's per-sample squared
                norms s_k[j], both returned (BackwardResult). Units whose per-sample
                gradients are cheap to hold keep them for W (their captures are freed).
- weight(j, c): the clipped weight gradient sum_i c_i grad_i — for most units from the stored
                (inputs, c * output-grads), for the kept ones a weighted sum — added to the
                stage's running clipped sum.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from ..config import GRAD_MODES
from ..errors import BatchError, TransportError, UnsupportedModelError
from ..privacy.per_sample import (
    KEEP_MEMORY_RATIO,
    GramCache,
    clipped_grad_sum,
    ghost_squared_norms,
    keeps_per_sample_grads,
    per_sample_grads,
    squared_norms,
)
from ..split.blocks import Block
from ..split.partition import Tie
from .capture import ActivationCapture, LayerCall, block_units
from .microbatch import Activation, tensors_of


@dataclass
class MicroBatchState:
    size: int
    inputs: Tuple[torch.Tensor, ...] = ()  # the received floating-point tensors (gradients go back)
    tuple_input: bool = False  # received a tuple: the gradient message is a tuple too
    output: Any = None  # the stage's output (per-sample losses on the last stage)
    calls: Dict[str, List[LayerCall]] = field(default_factory=dict)
    backprops: Dict[str, List[torch.Tensor]] = field(default_factory=dict)
    # units whose per-sample gradients I computed and kept for W (their captures are freed)
    kept: Dict[str, Dict[nn.Parameter, torch.Tensor]] = field(default_factory=dict)


@dataclass(frozen=True)
class TieRole:
    """This stage's side of an embedding / head tie (see pipedp.split.partition.Tie)."""

    role: str  # "owner": the first stage's embedding; "partner": the last stage's head
    name: str  # the tied parameter's name on this stage
    keep: bool  # partner only: holds its own copy (another process) rather than the owner's tensor

    @staticmethod
    def for_stage(stage: int, stages: int, tie: Optional[Tie], keep: bool) -> Optional["TieRole"]:
        if tie is None:
            return None
        if stage == 0:
            return TieRole("owner", tie.owner, keep)
        if stage == stages - 1:
            return TieRole("partner", tie.partner, keep)
        return None


class BackwardResult(NamedTuple):
    input_grad: Optional[Activation]  # the gradient message to the previous stage; None on the first
    squared_norms: torch.Tensor  # float64 [size] (per_layer: [units, size]): per-sample squared norms


class Stage:
    def __init__(
        self,
        index: int,
        num_stages: int,
        blocks: Sequence[Block],
        loss_fn: Optional[Callable] = None,
        grad_mode: str = "ghost",
        per_layer: bool = False,
        precision: str = "32",
        tie: Optional["TieRole"] = None,
        keep_per_sample: bool = True,
    ):
        if grad_mode not in GRAD_MODES:
            raise ValueError(f"unknown grad_mode {grad_mode!r}: choose one of {GRAD_MODES}")
        self.index = index
        self.is_first = index == 0
        self.is_last = index == num_stages - 1
        self.blocks = list(blocks)
        self.loss_fn = loss_fn
        self.grad_mode = grad_mode
        self.units = block_units(self.blocks)
        self.parameters: List[nn.Parameter] = _unique(
            p for b in self.blocks for p in b.module.parameters() if p.requires_grad
        )
        containers = [
            name for name, unit in self.units.items() if isinstance(unit, (nn.ParameterDict, nn.ParameterList))
        ]
        if containers:  # never called: the parent reads these tensors functionally, outside any capture
            raise UnsupportedModelError(
                f"stage {index}: trainable parameters held in {containers} (ParameterDict / ParameterList, e.g. PEFT's "
                "LoRA on an embedding) are read by their parent module outside any module call, so their per-sample "
                "gradients cannot be captured; freeze them, or adapt linear layers instead"
            )
        self.tie = tie
        self.tie_unit = ""  # the unit holding the tied weight (an Embedding, or the head Linear)
        self.noise_free: set = set()  # indices into self.parameters whose noise another stage adds
        if tie is not None:
            self.tie_unit = next((u for u in self.units if f"{u}.weight" == tie.name), "")
            if not self.tie_unit:
                raise UnsupportedModelError(f"stage {index}: tied parameter {tie.name} belongs to no layer here")
            weight = self.units[self.tie_unit].weight
            if tie.role == "partner" and not tie.keep:  # in one process the owner steps the shared tensor
                self.parameters = [p for p in self.parameters if p is not weight]
            elif tie.role == "partner":  # its own copy (another process): stepped here, noised by the owner
                self.noise_free = {k for k, p in enumerate(self.parameters) if p is weight}
        shared = _params_in_several_units(self.units)
        # units one of whose parameters another unit also uses: their norms need the summed gradient
        self._shares_params = {
            name for name, m in self.units.items() if any(id(p) in shared for p in m.parameters(recurse=False))
        }
        if per_layer and self._shares_params:
            raise UnsupportedModelError(
                f"per_layer clipping: layers {sorted(self._shares_params)} share a parameter, so no layer owns "
                "its gradient alone; use clipping='flat' or 'per_stage'"
            )
        self.per_layer = per_layer
        self.precision = precision
        self._side_blocks = {
            id(b) for b in self.blocks if "side_inputs" in inspect.signature(b.module.forward).parameters
        }
        if grad_mode == "keep" and not keep_per_sample:
            raise ValueError("grad_mode='keep' keeps per-sample gradients: keep_per_sample=False contradicts it")
        # per-sample gradients computed in I and kept for W where cheaper (see keeps_per_sample_grads);
        # False: ghost norms / materialised norms in I and the clipped product in W for every unit
        self.keep_per_sample = keep_per_sample
        # grad_mode="keep": every unit with closed-form per-sample gradients keeps them, whatever their size
        self._keep_ratio = float("inf") if grad_mode == "keep" else KEEP_MEMORY_RATIO
        self._keeps: Dict[tuple, bool] = {}  # (unit, input and output-grad shapes) -> the choice
        self.verified = False  # the first backward checks that the captures see every parameter use
        self.capture = ActivationCapture(self.units)
        self.pending: Dict[int, MicroBatchState] = {}
        self.clipped_sum: Dict[nn.Parameter, torch.Tensor] = {}

    def close(self) -> None:
        """Remove the capture hooks from the user's modules (the stage cannot run afterwards)."""
        self.capture.close()

    def _compute_precision(self, device: torch.device):
        """bf16-mixed: the forward under bf16 autocast (parameters, optimizer and the per-sample
        arithmetic stay float32); otherwise nothing changes."""
        if self.precision == "bf16-mixed":
            return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def parameter_names(self) -> List[str]:
        """The model's own names of ``self.parameters``, in that order."""
        names = {}
        for b in self.blocks:
            for n, p in b.module.named_parameters():
                names.setdefault(id(p), b.qualified(n))
        return [names[id(p)] for p in self.parameters]

    def named_state(self) -> Dict[str, torch.Tensor]:
        out = {}
        for b in self.blocks:
            for k, v in b.module.state_dict().items():
                out[b.qualified(k)] = v
        return out

    def load_named_state(self, state: Dict[str, torch.Tensor]) -> None:
        for b in self.blocks:
            own = {k: b.qualified(k) for k in b.module.state_dict().keys()}
            b.module.load_state_dict({k: state[q] for k, q in own.items()})

    # ---- F -------------------------------------------------------------------------------
    def forward(
        self,
        mb: int,
        x,
        targets=None,
        side_inputs: Optional[Dict[str, torch.Tensor]] = None,
        size: Optional[int] = None,
    ):
        """``x``: the micro-batch's inputs (first stage: a tensor or a dict of tensors) or the previous
        stage's output (a tensor or a tuple of tensors); ``side_inputs``: the micro-batch's input dict,
        handed to every block whose forward takes ``side_inputs`` (e.g. Hugging Face layers reading the
        attention mask); ``size``: the micro-batch's rows (default: read from ``x``)."""
        if not self.is_first:  # the received tensors become leaves whose gradients go back
            x = tuple(_leaf(t) for t in x) if isinstance(x, tuple) else _leaf(x)
        first = tensors_of(x)[0]
        size = size if size is not None else int(first.shape[0])
        state = MicroBatchState(size=size)
        if not self.is_first:
            state.inputs = tuple(t for t in tensors_of(x) if t.is_floating_point())
            state.tuple_input = isinstance(x, tuple)
        device = first.device
        with self.capture.recording(mb, size), self._compute_precision(device):
            out = x
            for b in self.blocks:
                out = self._call(b, out, side_inputs)
                if isinstance(out, tuple) and len(out) == 1:  # captured graphs return 1-tuples
                    out = out[0]
            state.calls = self.capture.pop(mb)
            if self.is_last:
                losses = self.loss_fn(out, targets)
        for calls in state.calls.values():  # per-sample arithmetic in float32 at least (bf16 captures)
            for call in calls:
                call.inputs = tuple(_widened(a) for a in call.inputs)
        if self.is_last:
            if not isinstance(losses, torch.Tensor) or losses.shape != (size,):
                shape = tuple(losses.shape) if isinstance(losses, torch.Tensor) else type(losses).__name__
                raise BatchError(
                    f"loss_fn must return per-sample losses of shape [{size}], got {shape}: use "
                    "reduction='none' and average each sample's own terms (e.g. over its tokens)"
                )
            if not losses.is_floating_point() or (self.parameters and not losses.requires_grad):
                what = "is not floating point" if not losses.is_floating_point() else "does not depend on the model"
                raise BatchError(
                    f"loss_fn returned a {losses.dtype} tensor that {what} (detached or cast?): the update "
                    "would be noise only; return the per-sample losses computed from the outputs"
                )
            out = losses
        else:
            sent = out if isinstance(out, tuple) else (out,)
            if not sent or not all(isinstance(t, torch.Tensor) for t in sent):
                what = ", ".join(type(t).__name__ for t in sent) or "nothing"
                raise UnsupportedModelError(
                    f"stage {self.index} passes ({what}) to the next stage: only a tensor or a tuple of tensors "
                    "can cross a stage boundary; compute non-tensor values (shapes, flags) inside the stage "
                    "that uses them, or choose another split"
                )
        state.output = out
        self.pending[mb] = state
        return out

    def _call(self, block: Block, value, side_inputs: Optional[Dict[str, torch.Tensor]]):
        """One block on the value before it: a tuple is spread over its positional arguments."""
        kwargs = {"side_inputs": side_inputs} if id(block) in self._side_blocks else {}
        if block.input_names and (isinstance(value, dict) or len(block.input_names) > 1):
            if not isinstance(value, dict) or set(value) != set(block.input_names):
                given = sorted(value) if isinstance(value, dict) else type(value).__name__
                raise BatchError(
                    f"the model's forward takes {list(block.input_names)} (arguments with a default keep it): "
                    f"pass the inputs as a dict with exactly those keys, got {given}"
                )
            return block.module(*(value[n] for n in block.input_names), **kwargs)
        return block.module(*value, **kwargs) if isinstance(value, tuple) else block.module(value, **kwargs)

    # ---- B -------------------------------------------------------------------------------
    def backward(self, mb: int, grad_output) -> BackwardResult:
        """grad_output: on the last stage the row mask (1 real, 0 padded); else the next stage's
        gradient message for this stage's output (one gradient per floating-point tensor of it)."""
        state = self.pending[mb]
        pairs = [(name, call) for name, calls in state.calls.items() for call in calls]
        targets = []
        for name, call in pairs:
            if call.output._version != call.version:
                raise UnsupportedModelError(
                    f"the output of layer {name!r} was modified in place after it was computed "
                    "(e.g. nn.ReLU(inplace=True) or x += ...): its gradient would be wrong; "
                    "use the out-of-place operation"
                )
            targets.append(call.output)
        targets.extend(state.inputs)
        outputs, output_grads = self._differentiable(state.output, grad_output)
        # the first backward also asks autograd for the parameters' gradients (same pass, no extra
        # backward), to check that the captures see every use of every parameter (see _verify)
        verify = not self.verified and bool(self.parameters) and bool(outputs)
        extra = list(self.parameters) if verify else []
        grads: List[Optional[torch.Tensor]] = []
        if (targets or extra) and outputs:
            grads = list(torch.autograd.grad(outputs, targets + extra, output_grads, allow_unused=True))
        grads = grads + [None] * (len(targets) + len(extra) - len(grads))
        param_grads = grads[len(targets) :]
        input_grads = grads[len(targets) - len(state.inputs) : len(targets)]
        grads = grads[: len(targets) - len(state.inputs)]
        message = None
        if not self.is_first:  # one gradient per floating-point input, zeros for an unused one
            message = tuple(g if g is not None else torch.zeros_like(t) for g, t in zip(input_grads, state.inputs))
            if not state.tuple_input and len(message) == 1:
                message = message[0]
        for (name, call), g in zip(pairs, grads):
            state.backprops.setdefault(name, []).append(
                _widened(g.detach()) if g is not None else _widened(torch.zeros_like(call.output))
            )
            call.output = None  # frees the graph once state.output goes too
        state.output = None
        state.inputs = ()
        if verify:
            self._verify(state, param_grads)
            self.verified = True
        return BackwardResult(message, self._squared_norms(state))

    def _differentiable(self, output, grad_output) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
        """The stage's outputs that carry a gradient back, with their incoming gradients."""
        if self.is_last:
            return ([output], [grad_output.to(output.dtype)]) if output.requires_grad else ([], [])
        floating = [t for t in tensors_of(output) if t.is_floating_point()]
        incoming = tensors_of(grad_output)
        if len(incoming) != len(floating):
            raise TransportError(
                f"stage {self.index} sent {len(floating)} floating-point tensors but got {len(incoming)} gradients "
                "back: the ranks split the model differently"
            )
        kept = [(t, g.to(t.dtype)) for t, g in zip(floating, incoming) if t.requires_grad]
        return [t for t, _ in kept], [g for _, g in kept]

    def _verify(self, state: MicroBatchState, autograd_grads: List[Optional[torch.Tensor]]) -> None:
        """Refuse a model whose parameters are used outside the calls of the modules that own them
        (e.g. a weight read functionally by another module, PEFT's LoRA on an embedding): their
        per-sample gradients would miss that use, silently. Check, once: the sum over the
        micro-batch of the per-sample gradients as the captures see them (the W pass with clip
        factor 1) must equal autograd's gradient of the same micro-batch."""
        seen: Dict[nn.Parameter, torch.Tensor] = {}
        for name, calls in state.calls.items():
            for call, bp in zip(calls, state.backprops[name]):
                for p, g in clipped_grad_sum(self.units[name], call.inputs, bp).items():
                    seen[p] = seen[p] + g if p in seen else g
        names = self.parameter_names()
        missed = []
        for name, p, want in zip(names, self.parameters, autograd_grads):
            want = torch.zeros_like(p) if want is None else want.detach()
            got = seen.get(p, torch.zeros_like(p)).to(want.dtype)
            scale = max(float(want.abs().max()), float(got.abs().max()), 1e-30)
            tolerance = 5e-2 if self.precision != "32" else 1e-3  # bf16 forward: autograd's own rounding
            if float((got - want).abs().max()) > tolerance * scale:
                missed.append(name)
        if missed:
            raise UnsupportedModelError(
                f"stage {self.index}: the gradient of {', '.join(missed[:6])} is not all seen by per-sample "
                "clipping: the parameter is used outside the call of the module that owns it (a weight read "
                "functionally by another module, or an adapter such as LoRA on an embedding), so its per-sample "
                "gradients would be wrong; call the owning module instead, or freeze the parameter"
            )

    def _squared_norms(self, state: MicroBatchState) -> torch.Tensor:
        """[n] float64: the stage's per-sample squared gradient norms; per_layer: [units, n], one row
        per unit in ``self.units`` order (zeros for a unit this micro-batch did not call)."""
        per_unit: Dict[str, List[torch.Tensor]] = {}  # unit -> per-parameter [n] squared norms
        materialized: Dict[nn.Parameter, torch.Tensor] = {}
        owner: Dict[nn.Parameter, str] = {}
        grams = GramCache()  # layers reading one input share its Gram matrix
        for name, calls in state.calls.items():
            unit = self.units[name]
            backprops = state.backprops[name]
            alone = len(calls) == 1 and name not in self._shares_params and name != self.tie_unit
            if alone and self._keep(name, calls[0].inputs, backprops[0]):
                state.kept[name] = per_sample_grads(unit, calls[0].inputs, backprops[0])
                per_unit.setdefault(name, []).extend(squared_norms(g) for g in state.kept[name].values())
                continue
            can_ghost = self.grad_mode != "materialize" and alone  # keep: ghost norms where it cannot keep
            norms = ghost_squared_norms(unit, calls[0].inputs, backprops[0], grams) if can_ghost else None
            if norms is not None:
                per_unit.setdefault(name, []).extend(n.reshape(state.size) for n in norms.values())
                continue
            for call, bp in zip(calls, backprops):
                for p, g in per_sample_grads(unit, call.inputs, bp).items():
                    materialized[p] = materialized[p] + g if p in materialized else g
                    owner.setdefault(p, name)
        for p, g in materialized.items():
            per_unit.setdefault(owner[p], []).append(squared_norms(g))
        for name in state.kept:  # W needs only the kept gradients: free the captures
            del state.calls[name], state.backprops[name]
        if self.per_layer:
            zero = torch.zeros(state.size, dtype=torch.float64)
            return torch.stack(
                [
                    torch.stack([v.to(torch.float64) for v in per_unit[name]]).sum(0) if name in per_unit else zero
                    for name in self.units
                ]
            )
        parts = [v for values in per_unit.values() for v in values]
        if not parts:
            return torch.zeros(state.size, dtype=torch.float64)
        if len({p.dtype for p in parts}) > 1:  # layers of several dtypes
            parts = [p.to(torch.float64) for p in parts]
        return torch.stack(parts).sum(0).to(torch.float64)

    def _keep(self, name: str, inputs, backprops: torch.Tensor) -> bool:
        if not self.keep_per_sample:
            return False
        key = (name, backprops.shape, tuple(a.shape for a in inputs))
        if key not in self._keeps:
            self._keeps[key] = keeps_per_sample_grads(self.units[name], inputs, backprops, self._keep_ratio)
        return self._keeps[key]

    # ---- W -------------------------------------------------------------------------------
    def weight(self, mb: int, clip_factors: torch.Tensor) -> None:
        """``clip_factors``: [n], or [units, n] (a row per unit, ``self.units`` order) for per_layer."""
        state = self.pending.pop(mb)
        unit_row = {name: u for u, name in enumerate(self.units)}
        # rows with clip factor 0 (padding, or a sample whose norm was not finite) must add exactly
        # nothing, and 0 * NaN is NaN: their inputs and output-grads are zeroed, not just scaled
        dropped = clip_factors == 0
        any_dropped = bool(dropped.any())

        def row_of(name: str) -> Optional[int]:  # per_layer: the unit's row of the clip factors
            return unit_row[name] if clip_factors.dim() == 2 else None

        def dropped_for(name: str) -> torch.Tensor:
            row = row_of(name)
            return dropped if row is None else dropped[row]

        shaped: Dict[tuple, torch.Tensor] = {}

        def factors_for(name: str, dtype: torch.dtype, dim: int) -> torch.Tensor:
            """The unit's clip factors in ``dtype``, broadcastable to a [n, ...] tensor of ``dim`` dimensions
            (converted once per call of weight, not once per tensor)."""
            row = row_of(name)
            key = (dtype, dim, row)
            if key not in shaped:
                factors = clip_factors if row is None else clip_factors[row]
                shaped[key] = factors.to(dtype).reshape((-1,) + (1,) * (dim - 1))
            return shaped[key]

        for name, calls in state.calls.items():
            unit, unit_dropped = self.units[name], dropped_for(name)
            for call, bp in zip(calls, state.backprops[name]):
                scaled, inputs = bp * factors_for(name, bp.dtype, bp.dim()), call.inputs
                if any_dropped:
                    scaled = _zero_rows(scaled, unit_dropped)
                    inputs = tuple(_zero_rows(a, unit_dropped) if a.is_floating_point() else a for a in inputs)
                for p, g in clipped_grad_sum(unit, inputs, scaled).items():
                    self._add_clipped(p, g)
        for name, grads in state.kept.items():  # sum_i c_i g_i of the kept per-sample gradients
            unit_dropped = dropped_for(name)
            for p, g in grads.items():
                if any_dropped:
                    g = _zero_rows(g, unit_dropped)
                total = self.clipped_sum.get(p)
                if total is None:
                    total = self.clipped_sum[p] = torch.zeros(p.shape, dtype=g.dtype, device=g.device)
                # one in-place matrix-vector product: [P, n] @ [n] added to the running sum (a tensordot
                # and an add cost three times as much at these sizes)
                total.view(-1).addmv_(g.reshape(g.shape[0], -1).t(), factors_for(name, g.dtype, 1))

    def _add_clipped(self, p: nn.Parameter, g: torch.Tensor) -> None:
        if p in self.clipped_sum:
            self.clipped_sum[p] += g
        else:  # contiguous: the kept path adds to it through a flat view
            self.clipped_sum[p] = g.clone(memory_format=torch.contiguous_format)

    # ---- an embedding tied to the head on the last stage ----------------------------------
    def tie_message(self, mb: int, ids: torch.Tensor) -> torch.Tensor:
        """Partner (last stage), after I(mb): M[i, t] = sum_s B_i[s, x_i[t]] H_i[s], [n, T, d], from the
        head's output-grads B and inputs H: the owner's cross term is <G_i, M_i> (see tie_cross)."""
        state = self.pending[mb]
        calls = state.calls.get(self.tie_unit, [])
        if len(calls) != 1:
            raise UnsupportedModelError(
                f"the tied head {self.tie_unit!r} must run once per micro-batch, ran {len(calls)}"
            )
        n = state.size
        head_in = calls[0].inputs[0].reshape(n, -1, calls[0].inputs[0].shape[-1])
        grads = state.backprops[self.tie_unit][0]
        grads = grads.reshape(n, -1, grads.shape[-1])
        ids = ids.reshape(n, -1).to(grads.device)
        if ids.shape[1] != grads.shape[1]:
            raise UnsupportedModelError(
                f"the tied head sees {grads.shape[1]} positions per sample but the inputs have {ids.shape[1]} ids: "
                "an embedding tied to the head needs the head applied to every input position"
            )
        picked = grads.gather(2, ids[:, None, :].expand(n, grads.shape[1], ids.shape[1]))  # [n, s, t] = B[s, x[t]]
        return torch.bmm(picked.transpose(1, 2), head_in.to(picked.dtype))

    def tie_cross(self, mb: int, message: torch.Tensor, message_ids: torch.Tensor) -> torch.Tensor:
        """Owner (first stage), after I(mb): <g_emb,i, g_head,i> per sample, [n] float64. ``message_ids``:
        the ids the partner built ``message`` from, which must be the ones the embedding read."""
        state = self.pending[mb]
        unit = self.units[self.tie_unit]
        calls = state.calls.get(self.tie_unit, [])
        ids = calls[0].inputs[0] if len(calls) == 1 else None
        if ids is None or ids.shape != message_ids.shape or not torch.equal(ids, message_ids.to(ids.device)):
            raise UnsupportedModelError(
                f"the tied embedding {self.tie_unit!r} must read the micro-batch's token ids, once and unchanged, for "
                "pipedp to compute the tie's cross term exactly; it read other values (or ran "
                f"{len(calls)} times): give the head its own weight"
            )
        grads = state.backprops[self.tie_unit][0]
        if unit.padding_idx is not None:  # autograd gives the padding row no gradient
            grads = grads * (ids != unit.padding_idx).unsqueeze(-1).to(grads.dtype)
        g3 = grads.reshape(state.size, -1, grads.shape[-1]).double()
        scale = float(getattr(unit, "embed_scale", 1.0))  # a scaled embedding (Gemma): d out / d weight row
        return scale * (g3 * message.reshape(g3.shape).double()).sum((1, 2))

    def tied_index(self) -> int:
        """The position of the tied weight in ``self.parameters`` (a stage that steps it)."""
        weight = self.units[self.tie_unit].weight
        return next(i for i, p in enumerate(self.parameters) if p is weight)

    def take_tied_part(self) -> torch.Tensor:
        """Partner in one process: its clipped part of the tied weight, for the owner to add."""
        weight = self.units[self.tie_unit].weight
        part = self.clipped_sum.pop(weight, None)
        return part if part is not None else torch.zeros_like(weight)

    def take_clipped_sum(self) -> List[torch.Tensor]:
        """The clipped sums of this stage's parameters (zeros where no sample touched them)."""
        out = [self.clipped_sum.get(p, None) for p in self.parameters]
        out = [g if g is not None else torch.zeros_like(p) for g, p in zip(out, self.parameters)]
        self.clipped_sum = {}
        return out


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().requires_grad_(True) if t.is_floating_point() else t


def _widened(t: torch.Tensor) -> torch.Tensor:
    """bf16 / fp16 tensors as float32: per-sample norms and clipped sums accumulate in float32."""
    return t.float() if t.dtype in (torch.bfloat16, torch.float16) else t


def _zero_rows(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``t`` with the samples in ``rows`` (bool [n]) set to 0, NaN and inf included."""
    return torch.where(rows.reshape((-1,) + (1,) * (t.dim() - 1)), torch.zeros((), dtype=t.dtype), t)


def _unique(params) -> List[nn.Parameter]:
    seen, out = set(), []
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def _params_in_several_units(units: Dict[str, nn.Module]) -> set:
    count: Dict[int, int] = {}
    for m in units.values():
        for p in m.parameters(recurse=False):
            count[id(p)] = count.get(id(p), 0) + 1
    return {k for k, v in count.items() if v > 1}
