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
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from ..config import GRAD_MODES
from ..errors import BatchError, ConfigMismatchError, TransportError, UnsupportedModelError
from ..privacy.clipping import ClipRule, StageClip, sum_dtype
from ..privacy.noise import SumNoise
from ..privacy.per_sample import (
    KEEP_MEMORY_RATIO,
    GramCache,
    add_clipped_grad_sum,
    ghost_squared_norms,
    per_sample_grads,
    pools_positions,
    shared_storages,
    squared_norms,
)
from ..privacy.rules import layer_parameters
from ..privacy.rules.expert_lora import folds, parametrized_per_call
from ..privacy.units import Units
from ..shards import Shard, TensorParallelPart
from ..split.blocks import Block
from ..split.hf_runs import rng_kept
from ..split.safetensors_read import stored_of
from . import grad_modes, self_check, state_watch
from .capture import ActivationCapture, LayerCall, block_layers
from .layer_errors import named_layer_errors
from .microbatch import Activation, gradient_message, tensors_of
from .self_check import Probe
from .stage_check import StageCheck
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


class ClipFactors:
    """One micro-batch's clip factors as each layer reads them: its own ([layers, n] under per_layer), per row
    (for captured inputs) or per unit (for kept per-sample gradients), in the layer's dtype, converted once."""

    def __init__(self, values: torch.Tensor, clip: StageClip, units: Units):
        self.values, self.clip, self.units = values, clip, units
        # rows with factor 0 (padding, or a sample whose norm was not finite) must add exactly nothing, and
        # 0 * NaN is NaN: their inputs and output-grads are zeroed, not just scaled
        self.any_dropped = bool((values == 0).any())
        self._shaped: Dict[tuple, torch.Tensor] = {}

    def of(self, name: str, dtype: torch.dtype, rows: bool = True) -> torch.Tensor:
        key = (dtype, name if self.clip.per_layer else "", rows)
        if key not in self._shaped:
            unit = self.clip.of_layer(self.values, name)
            self._shaped[key] = (self.units.expand(unit) if rows else unit).to(dtype)
        return self._shaped[key]

    def dropped(self, name: str, rows: bool) -> Optional[torch.Tensor]:
        """The rows (or units) of ``name`` to zero, or None where no factor is 0."""
        if not self.any_dropped:
            return None
        zero = self.clip.of_layer(self.values, name) == 0
        return self.units.expand(zero) if rows else zero


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
        _refuse_unread(self.blocks, self.tensor_parallel.size)
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
        self._self_sets = state_watch.SelfSets([p for b in self.blocks for p in parametrized_per_call(b.module)], folds)
        self._side_blocks = {
            id(b) for b in self.blocks if "side_inputs" in inspect.signature(b.module.forward).parameters
        }
        self._ways: Dict[tuple, str] = {}  # (layer, input and output-grad shapes) -> keep / ghost / materialize
        self.check = StageCheck(self)  # the self-check's half (stage_check.py)
        self.device = next(
            (t.device for b in self.blocks for t in _tensors(b.module) if not t.is_meta), torch.device("cpu")
        )
        self.capture = ActivationCapture(self.layers, lambda: (t for b in self.blocks for t in _tensors(b.module)))
        self.pending: Dict[int, MicroBatchState] = {}
        self.clipped_sum: Dict[nn.Parameter, torch.Tensor] = {}
        # this step's noise for the sums of these parameters, not drawn yet (the trainer sets it: draw_noise)
        self.noise: Optional[SumNoise] = None

    def reset(self) -> None:
        """Forget every micro-batch in flight and the partial clipped sum (a failed step)."""
        self.pending.clear()
        self.capture.reset()
        self.clipped_sum = {}
        self.noise = None
        self.check.reset()

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

    def slices(self) -> Dict[str, Shard]:
        """{each name of every parameter this rank holds a slice of (both names of a tied weight): its slice}."""
        out: Dict[str, Shard] = {}
        for b in self.blocks:
            for n, p in b.module.named_parameters(remove_duplicate=False):
                shard = self.tensor_parallel.of(p)
                if shard is not None:
                    out[b.qualified(n)] = shard
        return out

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
        probe_units: Sequence[int] = (),
    ):
        """``x``: the micro-batch's inputs (first stage: a tensor or a dict of tensors) or the previous
        stage's output (a tensor or a tuple of tensors); ``side_inputs``: the micro-batch's input dict,
        handed to every block whose forward takes ``side_inputs`` (e.g. Hugging Face layers reading the
        attention mask); ``size``: the micro-batch's rows (default: read from ``x``); ``check_state``:
        refuse a forward that changes a parameter or a buffer in place (a function of the private batch,
        un-noised); ``probe_units``: the self-checked units, whose losses alone must equal theirs in the batch (their
        forward alone is the executor's to compare: refuse_mixed_samples)."""
        if not self.is_first:  # the received tensors become leaves whose gradients go back
            x = tuple(_leaf(t) for t in x) if isinstance(x, tuple) else _leaf(x)
        first = tensors_of(x)[0]
        size = size if size is not None else int(first.shape[0])
        state = MicroBatchState(size=size, units=self.units.count(size))
        if not self.is_first:
            state.inputs = tuple(t for t in tensors_of(x) if t.is_floating_point())
            state.tuple_input = isinstance(x, tuple)
        before = state_watch.versions(self._named_state(), self._self_sets.counts) if check_state else None
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
                self.index,
                before,
                state_watch.versions(self._named_state(), self._self_sets.counts),
                "the training forward",
            )
        state.output = self._checked_losses(losses, size) if self.is_last else self._checked_output(out)
        if self.is_last and probe_units and self.loss_fn is not None:
            spans = [self.units.rows_of(r) for r in probe_units]
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
        versions = state_watch.versions(named, self._self_sets.counts)
        views: Dict[str, tuple] = {name + state_watch.VERSION: v for name, v in versions.items()}
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
        guards = [(name, call, guard) for name, call in pairs for guard in call.guards]
        targets.extend(guard.view for _, _, guard in guards)
        outputs, output_grads = self._differentiable(state.output, grad_output)
        checking = probe is not None and bool(probe.units)  # every stage of the pass takes part (it relays probes)
        grads: List[Optional[torch.Tensor]] = []
        if targets and outputs:  # a checked micro-batch keeps its graph for each row's own backward after
            grads = list(torch.autograd.grad(outputs, targets, output_grads, retain_graph=checking, allow_unused=True))
        grads = grads + [None] * (len(targets) - len(grads))
        more: Dict[int, List[torch.Tensor]] = {}  # the gradients of each call's outputs joined to its first
        for (name, call, guard), g in zip(guards, grads[len(grads) - len(guards) :]):
            used = g is not None and bool(g.ne(0).any())  # a call's other output the model used: joined (keywords.py)
            refusal = guard.refusal(f"layer {name!r}", int(call.inputs[0].shape[0]), used)
            if refusal is not None:
                raise refusal
            if g is not None and used:
                call.joined += (guard.path,)
                more.setdefault(id(call), []).append(_widened(g.detach()))
        grads = grads[: len(grads) - len(guards)]
        input_grads = grads[len(pairs) :]
        message = None
        if not self.is_first:  # one gradient per floating-point input, zeros for an unused one
            message = self._message(state, input_grads)
        widened: Dict[int, torch.Tensor] = {}  # one float32 copy of a gradient autograd hands several layers
        for (name, call), g in zip(pairs, grads[: len(pairs)]):
            if g is None:
                first = _widened(torch.zeros_like(call.output))
            else:
                if id(g) not in widened:
                    widened[id(g)] = _widened(g.detach())
                first = widened[id(g)]
            state.backprops.setdefault(name, []).append(call.backprop(first, more.get(id(call), ())))
            call.output, call.guards = None, ()  # frees the graph once state.output goes too
        # which floating tensors sent on carry gradients (a probe message holds one per floating tensor)
        selected = [] if self.is_last else [t.requires_grad for t in tensors_of(state.output) if t.is_floating_point()]
        leaves, state.output, state.inputs = state.inputs, None, ()
        with torch.no_grad():  # per-sample arithmetic needs no graph (torch.func's own transforms still run)
            per_param = self._per_parameter_norms(state)
        probe_messages: List[Activation] = []
        if checking:
            assert probe is not None
            probe_messages = self.check.compare(state, outputs, output_grads, leaves, selected, probe, per_param)
        norms = self.clip.reduce(self._per_layer(per_param), state.units, self.device)
        return BackwardResult(message, norms, tuple(probe_messages))

    def _message(self, state: MicroBatchState, input_grads: Sequence[Optional[torch.Tensor]]) -> Activation:
        return gradient_message(state.inputs, state.tuple_input, input_grads)

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
        # layers reading one tensor (an input; an output-gradient, under a parallel residual) share its Gram matrix
        reads = [t for name, calls in state.calls.items() for t in (*calls[0].inputs[:1], *state.backprops[name][:1])]
        grams = GramCache(shared_storages(reads))
        for name, calls in state.calls.items():
            layer, backprops = self.layers[name], state.backprops[name]
            alone = len(calls) == 1 and name not in self._shares_params
            folds = self.units.single or pools_positions(layer)  # else per-row gradients summed per unit
            with named_layer_errors(name, layer):
                way = "materialize"
                if alone and folds:
                    inputs, grads_out = self._folded(calls[0].inputs), self.units.fold(backprops[0])
                    way = self._way(name, inputs, grads_out)
                if way == "keep":
                    with calls[0].replayed(layer):
                        state.kept[name] = per_sample_grads(layer, inputs, grads_out)
                    per_param.update({p: squared_norms(g) for p, g in state.kept[name].items()})
                    continue
                norms = None
                if way == "ghost":
                    with calls[0].replayed(layer):
                        norms = ghost_squared_norms(layer, inputs, grads_out, grams)
                if norms is not None:
                    per_param.update({p: v.reshape(state.units) for p, v in norms.items()})
                    continue
                for call, bp in zip(calls, backprops):
                    with call.replayed(layer):
                        if folds:
                            one = per_sample_grads(layer, self._folded(call.inputs), self.units.fold(bp))
                        else:
                            grads = per_sample_grads(layer, call.inputs, bp)
                            one = {p: self.units.group_sum(g) for p, g in grads.items()}
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

    # ---- W -------------------------------------------------------------------------------
    def weight(self, mb: int, factors: torch.Tensor) -> None:
        """``factors``: the clip factors, [n], or [layers, n] under per_layer (the clip rule's shape)."""
        state = self.pending.pop(mb)
        clip = ClipFactors(factors, self.clip, self.units)
        for name, calls in state.calls.items():
            layer = self.layers[name]
            dropped = clip.dropped(name, rows=True)
            with named_layer_errors(name, layer):
                for call, bp in zip(calls, state.backprops[name]):
                    inputs = call.inputs
                    if dropped is not None:
                        bp = _zero_rows(bp, dropped)
                        # (keyword arguments keep their values, an attention mask's -inf included: finite ones)
                        positional = call.keywords.positional if call.keywords is not None else len(inputs)
                        inputs = tuple(
                            (_zero_rows(a, dropped) if k < positional else _finite_rows(a, dropped))
                            if a.is_floating_point()
                            else a
                            for k, a in enumerate(inputs)
                        )
                    with call.replayed(layer):
                        add_clipped_grad_sum(layer, inputs, bp, clip.of(name, bp.dtype), self.clipped_sum)
        for name, grads in state.kept.items():  # sum_i c_i g_i of the kept per-sample gradients
            dropped = clip.dropped(name, rows=False)
            for p, g in grads.items():
                if dropped is not None:
                    g = _zero_rows(g, dropped)
                total = self.clipped_sum.get(p)
                if total is None:
                    total = self.clipped_sum[p] = torch.zeros(p.shape, dtype=g.dtype, device=g.device)
                # one in-place matrix-vector product: [P, n] @ [n] added to the running sum (a tensordot
                # and an add cost three times as much at these sizes)
                flat = g.reshape(g.shape[0], -1).t().to(total.dtype)  # (a sum started as the noise: sum_dtype)
                total.view(-1).addmv_(flat, clip.of(name, total.dtype, rows=False))

    def take_tied_part(self) -> torch.Tensor:
        """Partner in one process: its clipped part of the tied weight, for the owner to add."""
        assert self.tie is not None and self.tie.weight is not None
        return self._sum_of(self.tie.weight, self.clipped_sum.pop(self.tie.weight, None))

    @property
    def noises_sums_first(self) -> bool:
        """Whether the sums start as the step's noise (draw_noise). Not under tensor parallelism: its ranks compare
        their sums of whole tensors before the noise (secure mode draws each rank's own), and noise slices."""
        return self.tensor_parallel.size == 1

    def noised_here(self, replica: int = 0, owner: Optional[List[int]] = None) -> List[int]:
        """The indices of the parameters whose noise this rank adds: once, before the sum over replicas (replica 0
        adds it, or each parameter's owner when the optimizer is sharded), except where another stage adds it (a
        tied head's copy)."""
        return [
            k
            for k in range(len(self.parameters))
            if replica == (0 if owner is None else owner[k]) and k not in self.noised_elsewhere
        ]

    def set_noise(
        self,
        std: float,
        seed: int,
        step: int,
        secure_mode: bool = False,
        replica: int = 0,
        owner: Optional[List[int]] = None,
    ) -> None:
        """This step's noise for the sums this rank noises (noised_here), drawn by draw_noise; nothing where the sums
        get it after the pass (noises_sums_first)."""
        if not self.noises_sums_first:
            return
        keep, names = self.noised_here(replica, owner), self.parameter_names()
        parameters = [self.parameters[k] for k in keep]
        self.noise = SumNoise(parameters, [names[k] for k in keep], std, seed, step, secure_mode)

    def draw_noise(self) -> None:
        """Start the clipped sums of this step's noised parameters as their noise (once; nothing when none is set),
        in the dtype W accumulates them in (float32 for bf16 / fp16 parameters)."""
        if self.noise is None:
            return
        noise, self.noise = self.noise, None
        for p in noise.parameters:
            self.clipped_sum[p] = self._sum_of(p, self.clipped_sum.get(p))
        noise.add_to([self.clipped_sum[p] for p in noise.parameters])

    def take_clipped_sum(self) -> List[torch.Tensor]:
        """The clipped sums of this stage's parameters (zeros where no sample touched them), each in sum_dtype."""
        out = [self._sum_of(p, self.clipped_sum.get(p, None)) for p in self.parameters]
        self.clipped_sum = {}
        return out

    @staticmethod
    def _sum_of(p: nn.Parameter, total: Optional[torch.Tensor]) -> torch.Tensor:
        """``total`` (None: no sample touched ``p``: zeros) in sum_dtype(p), whoever drew its noise: every rank then
        hands the sum over replicas or a tie the same dtype for it (gloo aborts on float32 against bf16)."""
        if total is None:
            return torch.zeros(p.shape, dtype=sum_dtype(p), device=p.device)
        return total.to(sum_dtype(p))


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


def _finite_rows(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``t`` with the non-finite values of the samples in ``rows`` (bool [n]) set to 0."""
    drop = rows.reshape((-1,) + (1,) * (t.dim() - 1)).to(t.device) & ~torch.isfinite(t)
    return torch.where(drop, torch.zeros((), dtype=t.dtype, device=t.device), t)


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


def _refuse_unread(blocks: Sequence[Block], tensor_parallel: int) -> None:
    """A parameter the loader left on the meta device for the tensor-parallel split to read slice by slice
    (load_pipeline_stage(..., tensor_parallel=T)) that this stage did not split: it has no values."""
    for b in blocks:
        for name, p in b.module.named_parameters():
            if stored_of(p) is not None:
                raise ConfigMismatchError(
                    f"parameter {b.qualified(name)!r} was left unread by load_pipeline_stage(..., tensor_parallel=T), "
                    f"for the tensor-parallel split to read its slice, but this run (tensor_parallel={tensor_parallel}) "
                    "does not cut it: pass the loader's tensor_parallel to the trainer"
                )
