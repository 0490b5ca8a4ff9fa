"""One pipeline stage: its blocks, and the three DP passes over a micro-batch.

- forward(j):          run the blocks, capturing every layer's inputs and output under key j.
- backward_input(j):   the schedule's I: gradients w.r.t. the captured layer outputs and the stage
                       input only (no weight gradients), then this stage's per-sample squared norms,
                       reduced as the clip rule says (BackwardResult). Layers whose per-sample
                       gradients are cheap to hold keep them for W (their captures are freed).
                       With a ``Probe``, also the self-check (see self_check.py).
- weight(j, c):        W: the clipped weight gradient sum_i c_i grad_i — for most layers from the
                       stored (inputs, c * output-grads), for the kept ones a weighted sum — added to
                       the stage's running clipped sum.

A *layer* here is a module that directly owns trainable parameters (capture.py).
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from ..config import GRAD_MODES
from ..errors import BatchError, TransportError, UnsupportedModelError
from ..privacy.clipping import ClipRule, StageClip
from ..privacy.per_sample import (
    KEEP_MEMORY_RATIO,
    GramCache,
    add_clipped_grad_sum,
    clipped_grad_sum,
    full_precision,
    ghost_squared_norms,
    per_sample_grads,
    pools_positions,
    squared_norms,
)
from ..privacy.rules import layer_parameters
from ..privacy.units import Units
from ..shards import TensorParallelPart
from ..split.blocks import Block
from ..split.hf_drive import rng_kept
from . import grad_modes, self_check, state_watch
from .capture import ActivationCapture, LayerCall, block_layers
from .microbatch import Activation, tensors_of
from .self_check import Probe
from .tie import StageTie, TieRole

Grads = Dict[nn.Parameter, torch.Tensor]


@dataclass(frozen=True)
class StageOptions:
    """How a stage computes: the one options value every runtime builds its stages from."""

    grad_mode: str = "auto"
    precision: str = "32"
    clip: ClipRule = field(default_factory=lambda: ClipRule("flat", (1.0,)))
    self_check: bool = True
    # per-sample gradients kept from I to W while they take at most this times the captures they free;
    # None: grad_mode decides (keep: always; otherwise KEEP_MEMORY_RATIO); 0: never
    keep_ratio: Optional[float] = None
    units: Units = Units()  # rows per privacy unit (a "sample" below is a unit)
    checkpointing: bool = False  # recompute each block's intermediate activations in the backward

    def __post_init__(self) -> None:
        if self.grad_mode not in GRAD_MODES:
            raise ValueError(f"unknown grad_mode {self.grad_mode!r}: choose one of {GRAD_MODES}")
        if self.grad_mode == "keep" and self.keep_ratio == 0:
            raise ValueError("grad_mode='keep' keeps per-sample gradients: keep_ratio=0 contradicts it")

    @property
    def memory_ratio(self) -> float:
        if self.keep_ratio is not None:
            return self.keep_ratio
        return float("inf") if self.grad_mode == "keep" else KEEP_MEMORY_RATIO


@dataclass
class MicroBatchState:
    size: int  # rows
    units: int  # privacy units (rows / rows per unit)
    inputs: Tuple[torch.Tensor, ...] = ()  # the received floating-point tensors (gradients go back)
    tuple_input: bool = False  # received a tuple: the gradient message is a tuple too
    output: Any = None  # the stage's output (per-sample losses on the last stage)
    calls: Dict[str, List[LayerCall]] = field(default_factory=dict)
    backprops: Dict[str, List[torch.Tensor]] = field(default_factory=dict)
    # layers whose per-sample gradients I computed and kept for W (their captures are freed)
    kept: Dict[str, Grads] = field(default_factory=dict)


class BackwardResult(NamedTuple):
    input_grad: Optional[Activation]  # the gradient message to the previous stage; None on the first
    squared_norms: torch.Tensor  # float64 [n] (per_layer: [layers, n]): this stage's part of the norms
    probe_messages: Tuple[Activation, ...] = ()  # self-check: each checked row's own gradient message


class Stage:
    def __init__(
        self,
        index: int,
        num_stages: int,
        blocks: Sequence[Block],
        loss_fn: Optional[Callable] = None,
        options: Optional[StageOptions] = None,
        tie: Optional[TieRole] = None,
        tensor_parallel: Optional[TensorParallelPart] = None,
    ):
        options = options or StageOptions()
        # this rank's slices of the stage's split layers (parallel/): which parameters' norms it adds
        self.tensor_parallel = tensor_parallel or TensorParallelPart()
        self.index, self.options = index, options
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.blocks = list(blocks)
        self.loss_fn = loss_fn
        self.grad_mode, self.precision, self.units = options.grad_mode, options.precision, options.units
        self.layers = block_layers(self.blocks)
        # every trainable parameter of the blocks (the self-check's reference), and those this stage steps
        self.trainable: List[nn.Parameter] = _unique(
            p for b in self.blocks for p in b.module.parameters() if p.requires_grad
        )
        self.tie = StageTie(tie, index, self.layers) if tie is not None else None
        self.parameters = self.tie.stepped(self.trainable) if self.tie else list(self.trainable)
        self.noised_elsewhere = self.tie.noised_elsewhere(self.parameters) if self.tie else set()
        shared = self._shared = _params_in_several_layers(self.layers)
        # layers one of whose parameters another layer also uses: their norms need the summed gradient
        self._shares_params = {
            name for name, m in self.layers.items() if any(id(p) in shared for _, p in layer_parameters(m))
        }
        self.clip: StageClip = options.clip.for_stage(index, list(self.layers))
        if self.clip.per_layer and self._shares_params:
            raise UnsupportedModelError(
                f"per_layer clipping: layers {sorted(self._shares_params)} share a parameter, so no layer owns "
                "its gradient alone; use clipping='flat' or 'per_stage'"
            )
        self._owner = {p: name for name, m in self.layers.items() for _, p in layer_parameters(m)}
        self._side_blocks = {
            id(b) for b in self.blocks if "side_inputs" in inspect.signature(b.module.forward).parameters
        }
        self._ways: Dict[tuple, str] = {}  # (layer, input and output-grad shapes) -> keep / ghost / materialize
        self.checked: set = set()  # input signatures the self-check has passed
        self.checking: set = set()  # signatures checked in this step: passed once every stage concludes so
        self.check_conclusive = False  # this pass's check compared every unit of its micro-batch, all real and finite
        self.device = next(
            (t.device for b in self.blocks for t in _tensors(b.module) if not t.is_meta), torch.device("cpu")
        )
        self.capture = ActivationCapture(self.layers)
        self.pending: Dict[int, MicroBatchState] = {}
        self.clipped_sum: Dict[nn.Parameter, torch.Tensor] = {}

    def reset(self) -> None:
        """Forget every micro-batch in flight and the partial clipped sum (a failed step)."""
        self.pending.clear()
        self.capture.reset()
        self.clipped_sum = {}
        self.checking.clear()

    def close(self) -> None:
        """Remove the capture hooks from the user's modules (the stage cannot run afterwards)."""
        self.capture.close()

    def _compute_precision(self, device: torch.device):
        """bf16-mixed: the forward under bf16 autocast (parameters, optimizer and the per-sample
        arithmetic stay float32); otherwise nothing changes."""
        if self.precision == "bf16-mixed":
            return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def names(self) -> Dict[int, str]:
        """id(tensor) -> the model's own name, for every parameter of the blocks."""
        names: Dict[int, str] = {}
        for b in self.blocks:
            for n, p in b.module.named_parameters():
                names.setdefault(id(p), b.qualified(n))
        return names

    def parameter_names(self) -> List[str]:
        """The model's own names of ``self.parameters``, in that order."""
        names = self.names()
        return [names[id(p)] for p in self.parameters]

    def named_state(self) -> Dict[str, torch.Tensor]:
        out = {}
        for b in self.blocks:
            for k, v in b.module.state_dict().items():
                out[b.qualified(k)] = v
        return out

    # ---- F -------------------------------------------------------------------------------
    def forward(
        self,
        mb: int,
        x,
        targets=None,
        side_inputs: Optional[Dict[str, torch.Tensor]] = None,
        size: Optional[int] = None,
        check_state: bool = False,
        probe_rows: Sequence[int] = (),
    ):
        """``x``: the micro-batch's inputs (first stage: a tensor or a dict of tensors) or the previous
        stage's output (a tensor or a tuple of tensors); ``side_inputs``: the micro-batch's input dict,
        handed to every block whose forward takes ``side_inputs`` (e.g. Hugging Face layers reading the
        attention mask); ``size``: the micro-batch's rows (default: read from ``x``); ``check_state``:
        refuse a forward that changes a parameter or a buffer in place (a function of the private batch,
        un-noised); ``probe_rows``: the self-checked units, whose losses alone must equal theirs in the batch (their
        forward alone is the executor's to compare: refuse_mixed_samples)."""
        if not self.is_first:  # the received tensors become leaves whose gradients go back
            x = tuple(_leaf(t) for t in x) if isinstance(x, tuple) else _leaf(x)
        first = tensors_of(x)[0]
        size = size if size is not None else int(first.shape[0])
        state = MicroBatchState(size=size, units=self.units.count(size))
        if not self.is_first:
            state.inputs = tuple(t for t in tensors_of(x) if t.is_floating_point())
            state.tuple_input = isinstance(x, tuple)
        before = state_watch.versions(self._named_state()) if check_state else None
        with self.capture.recording(mb, size), self._compute_precision(first.device):
            out = x
            for b in self.blocks:
                out = self._call(b, out, side_inputs)
                if isinstance(out, tuple) and len(out) == 1:  # captured graphs return 1-tuples
                    out = out[0]
            state.calls = self.capture.pop(mb)
            if self.is_last:
                losses = self.loss_fn(out, targets) if self.loss_fn is not None else out
        if before is not None:
            state_watch.refuse_changes(
                self.index, before, state_watch.versions(self._named_state()), "the training forward"
            )
        state.output = self._checked_losses(losses, size) if self.is_last else self._checked_output(out)
        if self.is_last and probe_rows and self.loss_fn is not None:
            spans = [self.units.rows_of(r) for r in probe_rows]
            with torch.no_grad(), self._compute_precision(first.device), rng_kept(first.device):
                self_check.refuse_coupled_loss(self.index, self.loss_fn, out, targets, state.output, size, spans)
        self.pending[mb] = state
        return state.output

    def _checked_losses(self, losses, size: int) -> torch.Tensor:
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
        return losses

    def _checked_output(self, out):
        sent = out if isinstance(out, tuple) else (out,)
        if not sent or not all(isinstance(t, torch.Tensor) for t in sent):
            what = ", ".join(type(t).__name__ for t in sent) or "nothing"
            raise UnsupportedModelError(
                f"stage {self.index} passes ({what}) to the next stage: only a tensor or a tuple of tensors "
                "can cross a stage boundary; compute non-tensor values (shapes, flags) inside the stage "
                "that uses them, or choose another split"
            )
        return out

    def _named_state(self):
        """(qualified name, is a parameter, tensor) of the stage's parameters and buffers."""
        for b in self.blocks:
            for is_parameter, named in ((True, b.module.named_parameters()), (False, b.module.named_buffers())):
                for name, t in named:
                    yield b.qualified(name), is_parameter, t

    def watch_values(self, parameters: bool = True) -> Dict[str, tuple]:
        """The versions of every parameter and buffer, and the digests of every buffer and (``parameters``)
        every parameter (state_watch.py), for ``refuse_changed_values`` after a pass."""
        named = list(self._named_state())
        views: Dict[str, tuple] = {name + state_watch.VERSION: v for name, v in state_watch.versions(named).items()}
        views.update(state_watch.digests([t for t in named if parameters or not t[1]]))
        return views

    def refuse_changed_values(self, before: Dict[str, tuple], parameters: bool = True) -> None:
        """Refuse a pass that changed a parameter or buffer: in place, through ``.data``, in a backward hook."""
        state_watch.refuse_changes(self.index, before, self.watch_values(parameters), "the training pass")

    def evaluate(
        self, x, targets=None, side_inputs: Optional[Dict[str, torch.Tensor]] = None, size: int = 0, loss: bool = True
    ):
        """The forward of a micro-batch with no capture, no gradient and no state kept (evaluation):
        the stage's output, or on the last stage (with ``loss``) the per-sample losses."""
        with torch.no_grad(), self._compute_precision(tensors_of(x)[0].device):
            out = x
            for b in self.blocks:
                out = self._call(b, out, side_inputs)
                if isinstance(out, tuple) and len(out) == 1:
                    out = out[0]
            if not self.is_last or not loss:
                return out
            assert self.loss_fn is not None  # the last stage's
            return self.loss_fn(out, targets).detach()

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
            args = tuple(value[n] for n in block.input_names)
        else:
            args = value if isinstance(value, tuple) else (value,)
        if self.options.checkpointing and torch.is_grad_enabled():
            # non-reentrant: the graph is recorded as usual (the captures' outputs stay in it), only the
            # tensors autograd saves are dropped and recomputed when the backward needs them
            return torch.utils.checkpoint.checkpoint(block.module, *args, use_reentrant=False, **kwargs)
        return block.module(*args, **kwargs)

    # ---- I -------------------------------------------------------------------------------
    def backward_input(self, mb: int, grad_output, probe: Optional[Probe] = None) -> BackwardResult:
        """grad_output: on the last stage the row mask (1 real, 0 padded); else the next stage's
        gradient message for this stage's output (one gradient per floating-point tensor of it).
        ``probe``: check these rows against each one's own gradient (self_check.py)."""
        state = self.pending[mb]
        pairs = [(name, call) for name, calls in state.calls.items() for call in calls]
        targets = []
        for name, call in pairs:
            assert call.output is not None  # (dropped only after this backward)
            if call.output._version != call.version:
                raise UnsupportedModelError(
                    f"the output of layer {name!r} was modified in place after it was computed "
                    "(e.g. nn.ReLU(inplace=True) or x += ...): its gradient would be wrong; "
                    "use the out-of-place operation"
                )
            targets.append(call.output)
        targets.extend(state.inputs)
        outputs, output_grads = self._differentiable(state.output, grad_output)
        checking = probe is not None and bool(probe.rows)  # every stage of the pass takes part (it relays probes)
        grads: List[Optional[torch.Tensor]] = []
        if targets and outputs:  # a checked micro-batch keeps its graph for each row's own backward after
            grads = list(torch.autograd.grad(outputs, targets, output_grads, retain_graph=checking, allow_unused=True))
        grads = grads + [None] * (len(targets) - len(grads))
        input_grads = grads[len(targets) - len(state.inputs) :]
        message = None
        if not self.is_first:  # one gradient per floating-point input, zeros for an unused one
            message = self._message(state, input_grads)
        for (name, call), g in zip(pairs, grads[: len(targets) - len(state.inputs)]):
            state.backprops.setdefault(name, []).append(
                call.backprop(_widened(g.detach()) if g is not None else _widened(torch.zeros_like(call.output)))
            )
            call.output = None  # frees the graph once state.output goes too
        # which floating tensors sent on carry gradients (a probe message holds one per floating tensor)
        selected = [] if self.is_last else [t.requires_grad for t in tensors_of(state.output) if t.is_floating_point()]
        leaves, state.output, state.inputs = state.inputs, None, ()
        with torch.no_grad():  # per-sample arithmetic needs no graph (torch.func's own transforms still run)
            per_param = self._per_parameter_norms(state)
        probe_messages: List[Activation] = []
        if checking:
            assert probe is not None
            probe_messages = self._check(state, outputs, output_grads, leaves, selected, probe, per_param)
        norms = self.clip.reduce(self._per_layer(per_param), state.units, self.device)
        return BackwardResult(message, norms, tuple(probe_messages))

    def _message(self, state: MicroBatchState, input_grads: Sequence[Optional[torch.Tensor]]) -> Activation:
        return self._message_of(state.inputs, state.tuple_input, input_grads)

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

    def _per_parameter_norms(self, state: MicroBatchState) -> Dict[nn.Parameter, torch.Tensor]:
        """{parameter: [units] float64}: each privacy unit's squared gradient norm of each trainable
        parameter the micro-batch's layer calls reach (kept, ghost or materialized, as the grad mode and
        the memory rule choose)."""
        per_param: Dict[nn.Parameter, torch.Tensor] = {}
        materialized: Grads = {}
        grams = GramCache()  # layers reading one input share its Gram matrix
        for name, calls in state.calls.items():
            layer, backprops = self.layers[name], state.backprops[name]
            alone = len(calls) == 1 and name not in self._shares_params
            folds = self.units.single or pools_positions(layer)  # else per-row gradients summed per unit
            with _naming(name, layer):
                way = "materialize"
                if alone and folds:
                    inputs, grads_out = self._folded(calls[0].inputs), self.units.fold(backprops[0])
                    way = self._way(name, inputs, grads_out)
                if way == "keep":
                    state.kept[name] = per_sample_grads(layer, inputs, grads_out)
                    per_param.update({p: squared_norms(g) for p, g in state.kept[name].items()})
                    continue
                norms = ghost_squared_norms(layer, inputs, grads_out, grams) if way == "ghost" else None
                if norms is not None:
                    per_param.update({p: v.reshape(state.units) for p, v in norms.items()})
                    continue
                for call, bp in zip(calls, backprops):
                    if folds:
                        one = per_sample_grads(layer, self._folded(call.inputs), self.units.fold(bp))
                    else:
                        one = {p: self.units.group_sum(g) for p, g in per_sample_grads(layer, call.inputs, bp).items()}
                    for p, g in one.items():
                        materialized[p] = materialized[p] + g if p in materialized else g
        per_param.update({p: squared_norms(g) for p, g in materialized.items()})
        for name in state.kept:  # W needs only the kept gradients: free the captures
            del state.calls[name], state.backprops[name]
        return {p: v.to(torch.float64) for p, v in per_param.items()}

    def _folded(self, inputs: Sequence[torch.Tensor]) -> Tuple[torch.Tensor, ...]:
        return tuple(inputs) if self.units.single else tuple(self.units.fold(a) for a in inputs)

    def _per_layer(self, per_param: Dict[nn.Parameter, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """{layer: [n]}: the per-parameter norms summed per owning layer; under tensor parallelism this rank's
        part (the slices it holds, and the whole tensors every rank holds on rank 0 only)."""
        out: Dict[str, torch.Tensor] = {}
        for p, v in per_param.items():
            if not self.tensor_parallel.counts(p):
                continue
            name = self._owner[p]
            out[name] = out[name] + v if name in out else v
        return out

    def _way(self, name: str, inputs, backprops: torch.Tensor) -> str:
        """keep, ghost or materialize for this call (grad_modes.py), decided once per layer and shape."""
        key = (name, backprops.shape, tuple(a.shape for a in inputs))
        if key not in self._ways:
            layer = self.layers[name]
            ratio = self.options.memory_ratio
            if self.tie is not None and name == self.tie.layer:  # the tie reads its captures after I
                ratio = 0.0
            ways = grad_modes.allowed(self.grad_mode, layer, inputs, backprops, ratio)
            if self.grad_mode == "auto":
                self._ways[key] = grad_modes.cheapest(layer, inputs, backprops, ways)
            else:
                self._ways[key] = ways[0]
        return self._ways[key]

    @property
    def ways(self) -> Dict[str, str]:
        """{layer: the way its per-sample norms and clipped sum are computed} (the latest shape's)."""
        return {key[0]: way for key, way in self._ways.items()}

    # ---- the self-check (see self_check.py) -------------------------------------------------
    def check_plan(self, inputs, mask: torch.Tensor) -> Optional[Probe]:
        """Every real privacy unit of a pass's first micro-batch, at the first pass of a new input signature
        (its rows included) until a check of it concludes (``conclude_check``)."""
        if not self.options.self_check:  # (the same decision on every stage: the probes travel through all)
            return None
        key = self_check.signature(inputs)
        if key in self.checked or key in self.checking:
            return None
        units = self_check.rows_to_check(self.units.mask(mask))
        if not units:
            return None
        self.checking.add(key)
        self.check_conclusive = False
        return Probe(units)

    def refuse_mixed_samples(self, x, targets, side_inputs, size: int, units: Sequence[int]) -> None:
        """Each checked unit's stage output computed from its own rows alone must equal its rows of the
        micro-batch's output. This sees what the gradient comparison cannot: a parameter-free operation across
        the batch before every trainable parameter (``x - x.mean(0)`` after a frozen embedding), which leaves each
        sample's gradient right for its loss while one record moves every other sample's. In eval mode (the same
        function both times: no dropout), from one random state; skipped, with a warning, for a random forward."""
        if not self.blocks:
            return
        device = tensors_of(x)[0].device
        modes = [(m, m.training) for b in self.blocks for m in b.module.modules()]
        try:
            for m, _ in modes:
                m.training = False
            with rng_kept(device):
                whole = self.evaluate(x, targets, side_inputs, size, loss=False)
            with rng_kept(device):
                _reseeded(device)
                again = self.evaluate(x, targets, side_inputs, size, loss=False)
            if not self_check.same_values(whole, again, self_check.TOLERANCE[torch.float64][0]):
                warnings.warn(
                    f"stage {self.index}: its forward draws random numbers in eval mode, so the self-check cannot "
                    "verify that it keeps every sample apart",
                    stacklevel=2,
                )
                return
            for r in units:
                span = self.units.rows_of(r)
                one = self_check.rows(x, span, size)
                part = self_check.rows(targets, span, size) if targets is not None else None
                side = self_check.rows(side_inputs, span, size) if side_inputs is not None else None
                with rng_kept(device):
                    alone = self.evaluate(one, part, side, span.stop - span.start, loss=False)
                self_check.refuse_mixed(self.index, self_check.rows(whole, span, size), alone, span)
        finally:
            for m, training in modes:
                m.training = training

    def conclude_check(self, conclusive: bool) -> None:
        """The step ended; ``conclusive``: every stage's check of it compared every unit of its micro-batch, each
        a real sample with finite gradients. Otherwise a padding row, or a sample left out as non-finite, could
        hide a cross-sample effect: the shape is checked again."""
        if conclusive:
            self.checked |= self.checking
        self.checking.clear()

    def _check(
        self,
        state: MicroBatchState,
        outputs: List[torch.Tensor],
        output_grads: List[torch.Tensor],
        leaves: Tuple[torch.Tensor, ...],
        selected: List[bool],
        probe: Probe,
        per_param: Dict[nn.Parameter, torch.Tensor],
    ) -> List[Activation]:
        """Each checked row's own gradient by a separate backward through the retained graph (seeded on
        the last stage by the row's loss, elsewhere by the row's probe message), compared parameter by
        parameter with what pipedp computed for the row; returns each row's gradient message to the
        previous stage. Refuses the model on a mismatch (self_check.py)."""
        names = self.names()
        owners = {p: (self._owner[p], type(self.layers[self._owner[p]]).__name__) for p in self.trainable}
        called = set(state.calls) | set(state.kept)
        comparison = self_check.Comparison(self.index, self_check.compute_dtype(self.precision, self.trainable, []))
        # a sample with a non-finite norm is left out of the update (clip factor 0), but its NaN or inf
        # reaches every row's own gradient of the parameters it flows into (0 * NaN is NaN)
        comparison.non_finite_rows = any(not bool(torch.isfinite(v).all()) for v in per_param.values())
        messages: List[Activation] = []
        for k, row in enumerate(probe.rows):
            grads: Sequence[Optional[torch.Tensor]] = [None] * (len(self.trainable) + len(leaves))
            if outputs:
                seeds = self._seeds(outputs, selected, probe, k, row)
                wrt = list(self.trainable) + list(leaves)
                with full_precision():  # the reference in the norms' own precision (no TF32)
                    grads = torch.autograd.grad(outputs, wrt, seeds, retain_graph=True, allow_unused=True)
            if not self.is_first:
                messages.append(self._message_of(leaves, state.tuple_input, grads[len(self.trainable) :]))
            reference = {p: g for p, g in zip(self.trainable, grads) if g is not None}
            scale = comparison.scale(reference)
            summed: Dict[nn.Parameter, torch.Tensor] = {}  # parameters several layers use: compared once, summed
            for name, got in self._row_gradients(state, row):  # one layer at a time
                for p, have in got.items():
                    if id(p) in self._shared:
                        summed[p] = summed[p] + have if p in summed else have
                        continue
                    squared = float(per_param[p][row]) if p in per_param else 0.0
                    comparison.add(
                        p, names[id(p)], owners[p], name in called, reference.pop(p, None), have, squared, scale
                    )
            for p, have in summed.items():
                squared = float(per_param[p][row]) if p in per_param else 0.0
                comparison.add(p, names[id(p)], owners[p], True, reference.pop(p, None), have, squared, scale)
            for p, want in reference.items():  # reached by autograd, by no layer call pipedp captured
                comparison.add(p, names[id(p)], owners[p], owners[p][0] in called, want, None, 0.0, scale)
        comparison.refuse_if_any(lambda: self._sums(state, outputs, output_grads))
        # every unit real and finite: a padding row (or a sample left out) could hide a flow between samples
        finite = [r for r in probe.rows if all(bool(torch.isfinite(v[r])) for v in per_param.values())]
        self.check_conclusive = len(finite) == state.units and not comparison.unverified
        return messages

    def _seeds(self, outputs, selected: List[bool], probe: Probe, k: int, row: int) -> List[torch.Tensor]:
        if self.is_last:  # the loss of unit ``row`` alone: the sum of its rows' losses
            seed = torch.zeros_like(outputs[0])
            seed[self.units.rows_of(row)] = 1
            return [seed]
        incoming = [g for g, carries in zip(tensors_of(probe.messages[k]), selected) if carries]
        return [g.to(t.dtype) for t, g in zip(outputs, incoming)]

    def _message_of(self, leaves, tuple_input: bool, grads: Sequence[Optional[torch.Tensor]]) -> Activation:
        message = tuple(g if g is not None else torch.zeros_like(t) for g, t in zip(grads, leaves))
        return message[0] if not tuple_input and len(message) == 1 else message

    def _row_gradients(self, state: MicroBatchState, row: int):
        """(layer, {param: the per-sample gradient of unit ``row``}) as pipedp's W would use it: the kept
        tensor's row, or the layer's rule on the unit's rows alone (one-hot clip factors)."""
        span = self.units.rows_of(row)
        for name, grads in state.kept.items():
            yield name, {p: g[row] for p, g in grads.items()}
        for name, calls in state.calls.items():
            layer = self.layers[name]
            got: Grads = {}
            with _naming(name, layer):
                for call, bp in zip(calls, state.backprops[name]):
                    for p, g in clipped_grad_sum(layer, tuple(a[span] for a in call.inputs), bp[span]).items():
                        got[p] = got[p] + g if p in got else g
            yield name, got

    def _sums(self, state: MicroBatchState, outputs, output_grads) -> Tuple[Grads, Grads]:
        """For a refusal's diagnosis: pipedp's W with every clip factor 1, and autograd's micro-batch gradient."""
        total: Grads = {}
        for grads in state.kept.values():
            for p, g in grads.items():
                total[p] = total[p] + g.sum(0) if p in total else g.sum(0)
        for name, calls in state.calls.items():
            for call, bp in zip(calls, state.backprops[name]):
                for p, g in clipped_grad_sum(self.layers[name], call.inputs, bp).items():
                    total[p] = total[p] + g if p in total else g
        summed = torch.autograd.grad(outputs, list(self.trainable), output_grads, retain_graph=True, allow_unused=True)
        return total, {p: g for p, g in zip(self.trainable, summed) if g is not None}

    # ---- W -------------------------------------------------------------------------------
    def weight(self, mb: int, factors: torch.Tensor) -> None:
        """``factors``: the clip factors, [n], or [layers, n] under per_layer (the clip rule's shape)."""
        state = self.pending.pop(mb)
        # rows with clip factor 0 (padding, or a sample whose norm was not finite) must add exactly
        # nothing, and 0 * NaN is NaN: their inputs and output-grads are zeroed, not just scaled
        any_dropped = bool((factors == 0).any())
        shaped: Dict[tuple, torch.Tensor] = {}

        def factors_for(name: str, dtype: torch.dtype, rows: bool = True) -> torch.Tensor:
            """The layer's clip factors in ``dtype``, [n]: per row (captures) or per unit (kept gradients);
            converted once per call of weight."""
            key = (dtype, name if self.clip.per_layer else "", rows)
            if key not in shaped:
                row = self.clip.of_layer(factors, name)
                shaped[key] = (self.units.expand(row) if rows else row).to(dtype)
            return shaped[key]

        for name, calls in state.calls.items():
            layer = self.layers[name]
            dropped = self.units.expand(self.clip.of_layer(factors, name) == 0) if any_dropped else None
            with _naming(name, layer):
                for call, bp in zip(calls, state.backprops[name]):
                    inputs = call.inputs
                    if dropped is not None:
                        bp = _zero_rows(bp, dropped)
                        inputs = tuple(_zero_rows(a, dropped) if a.is_floating_point() else a for a in inputs)
                    add_clipped_grad_sum(layer, inputs, bp, factors_for(name, bp.dtype), self.clipped_sum)
        for name, grads in state.kept.items():  # sum_i c_i g_i of the kept per-sample gradients
            for p, g in grads.items():
                if any_dropped:
                    g = _zero_rows(g, self.clip.of_layer(factors, name) == 0)
                total = self.clipped_sum.get(p)
                if total is None:
                    total = self.clipped_sum[p] = torch.zeros(p.shape, dtype=g.dtype, device=g.device)
                # one in-place matrix-vector product: [P, n] @ [n] added to the running sum (a tensordot
                # and an add cost three times as much at these sizes)
                total.view(-1).addmv_(g.reshape(g.shape[0], -1).t(), factors_for(name, g.dtype, rows=False))

    def take_tied_part(self) -> torch.Tensor:
        """Partner in one process: its clipped part of the tied weight, for the owner to add."""
        assert self.tie is not None and self.tie.weight is not None
        part = self.clipped_sum.pop(self.tie.weight, None)
        return part if part is not None else torch.zeros_like(self.tie.weight)

    def take_clipped_sum(self) -> List[torch.Tensor]:
        """The clipped sums of this stage's parameters (zeros where no sample touched them)."""
        out = [self.clipped_sum.get(p, None) for p in self.parameters]
        out = [g if g is not None else torch.zeros_like(p) for g, p in zip(out, self.parameters)]
        self.clipped_sum = {}
        return out


@contextlib.contextmanager
def _naming(name: str, layer: nn.Module):
    """A layer whose per-sample arithmetic fails is named, with the way out."""
    try:
        yield
    except (UnsupportedModelError, BatchError, TransportError):
        raise
    except Exception as exc:
        text = str(exc).splitlines()[0][:200] if str(exc) else ""
        if "autograd.Function" in text:
            text = "it runs a custom torch.autograd.Function, which torch.func can only transform with setup_context "
            text += "and vmap support"
        elif "random operation" in text:  # vmap refuses randomness: dropout inside a layer with parameters
            text = "its forward draws random numbers (dropout inside a layer with parameters, e.g. PEFT LoKr in "
            text += (
                "training mode), which a per-sample replay cannot draw again as the forward did; put it in eval mode"
            )
        raise UnsupportedModelError(
            f"layer {name!r} ({type(layer).__name__}): its per-sample gradients cannot be computed "
            f"({type(exc).__name__}: {text}). pipedp takes layers "
            "with a registered rule (Linear, Embedding, LayerNorm, Conv, GroupNorm, RMSNorm, ...) and others that "
            "torch.func can differentiate one sample at a time (no custom autograd.Function without vmap support, "
            "no input layout other than batch-first tensors); register a rule with pipedp.privacy.rules.register, "
            "replace the layer, or freeze its parameters"
        ) from exc


def _reseeded(device: torch.device) -> None:
    """Another state for the random generators a forward on ``device`` draws from (restored by rng_kept)."""
    torch.default_generator.manual_seed(torch.default_generator.initial_seed() + 1)
    if device.type == "cuda":
        generator = torch.cuda.default_generators[device.index if device.index is not None else 0]
        generator.manual_seed(generator.initial_seed() + 1)


def _tensors(module: nn.Module):
    yield from module.parameters()
    yield from module.buffers()


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().requires_grad_(True) if t.is_floating_point() else t


def _widened(t: torch.Tensor) -> torch.Tensor:
    """bf16 / fp16 tensors as float32: per-sample norms and clipped sums accumulate in float32."""
    return t.float() if t.dtype in (torch.bfloat16, torch.float16) else t


def _zero_rows(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``t`` with the samples in ``rows`` (bool [n]) set to 0, NaN and inf included."""
    zero = torch.zeros((), dtype=t.dtype, device=t.device)
    return torch.where(rows.reshape((-1,) + (1,) * (t.dim() - 1)).to(t.device), zero, t)


def _unique(params) -> List[nn.Parameter]:
    seen, out = set(), []
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def _params_in_several_layers(layers: Dict[str, nn.Module]) -> set:
    count: Dict[int, int] = {}
    for m in layers.values():
        for _, p in layer_parameters(m):
            count[id(p)] = count.get(id(p), 0) + 1
    return {k for k, v in count.items() if v > 1}
