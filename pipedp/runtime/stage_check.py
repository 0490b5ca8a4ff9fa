"""The self-check's half of a stage (self_check.py holds the comparisons it makes): which input signatures are
checked and which passed, each checked unit's output from its own rows alone, and each checked unit's own
gradient compared with what the stage computed for it. Owned by the stage (``Stage.check``), as the tie's
half is (``Stage.tie``)."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from ..privacy.per_sample import clipped_grad_sum, full_precision
from ..rounding import ELEMENT_WISE
from ..split.hf_runs import modes_kept, reseeded, rng_kept
from . import self_check
from .layer_errors import named_layer_errors
from .microbatch import Activation, gradient_message, tensors_of
from .self_check import Probe

if TYPE_CHECKING:
    from .stage import MicroBatchState, Stage

Grads = Dict[nn.Parameter, torch.Tensor]


class StageCheck:
    def __init__(self, stage: "Stage"):
        self.stage = stage
        self.checked: set = set()  # input signatures the self-check has passed
        self.checking: set = set()  # signatures checked in this step: passed once every stage concludes so
        self.conclusive = False  # this pass's check compared every unit of its micro-batch, all real and finite

    def reset(self) -> None:
        """A failed step: what it was checking is checked again."""
        self.checking.clear()

    def probe_for(self, inputs, mask: torch.Tensor) -> Optional[Probe]:
        """Every real privacy unit of a pass's first micro-batch, at the first pass of a new input signature
        (its rows included) until a check of it concludes (``conclude``)."""
        if not self.stage.options.self_check:  # (the same decision on every stage: the probes travel through all)
            return None
        key = self_check.signature(inputs)
        if key in self.checked or key in self.checking:
            return None
        units = self_check.units_to_check(self.stage.units.mask(mask))
        if not units:
            return None
        self.checking.add(key)
        self.conclusive = False
        return Probe(units)

    def refuse_mixed_samples(self, x, targets, side_inputs, size: int, units: Sequence[int]) -> None:
        """Each checked unit's stage output computed from its own rows alone must equal its rows of the
        micro-batch's output. This sees what the gradient comparison cannot: a parameter-free operation across
        the batch before every trainable parameter (``x - x.mean(0)`` after a frozen embedding), which leaves each
        sample's gradient right for its loss while one record moves every other sample's. In eval mode (the same
        function both times: no dropout), from one random state; skipped, with a warning, for a random forward."""
        if not self.stage.blocks:
            return
        device = tensors_of(x)[0].device
        with modes_kept(*(b.module for b in self.stage.blocks)):
            for b in self.stage.blocks:
                for m in b.module.modules():
                    m.training = False
            with rng_kept(device), self_check.Precisions() as computed:
                whole = self.stage.evaluate(x, targets, side_inputs, size, loss=False)
            with rng_kept(device):
                reseeded(device)
                again = self.stage.evaluate(x, targets, side_inputs, size, loss=False)
            if not self_check.same_values(whole, again, ELEMENT_WISE[torch.float64][0]):
                warnings.warn(
                    f"stage {self.stage.index}: its forward draws random numbers in eval mode, so the self-check cannot "
                    "verify that it keeps every sample apart",
                    stacklevel=2,
                )
                return
            for r in units:
                span = self.stage.units.rows_of(r)
                one = self_check.rows(x, span, size)
                part = self_check.rows(targets, span, size) if targets is not None else None
                side = self_check.rows(side_inputs, span, size) if side_inputs is not None else None
                with rng_kept(device):
                    alone = self.stage.evaluate(one, part, side, span.stop - span.start, loss=False)
                whole_rows = self_check.rows(whole, span, size)
                self_check.refuse_mixed(self.stage.index, whole_rows, alone, span, computed.dtypes)

    def conclude(self, conclusive: bool) -> None:
        """The step ended; ``conclusive``: every stage's check of it compared every unit of its micro-batch, each
        a real sample with finite gradients. Otherwise a padding row, or a sample left out as non-finite, could
        hide a cross-sample effect: the shape is checked again."""
        if conclusive:
            self.checked |= self.checking
        self.checking.clear()

    def compare(
        self,
        state: "MicroBatchState",
        outputs: List[torch.Tensor],
        output_grads: List[torch.Tensor],
        leaves: Tuple[torch.Tensor, ...],
        selected: List[bool],
        probe: Probe,
        per_param: Dict[nn.Parameter, torch.Tensor],
    ) -> List[Activation]:
        """Each checked unit's own gradient by a separate backward through the retained graph (seeded on
        the last stage by the unit's loss, elsewhere by the unit's probe message), compared parameter by
        parameter with what pipedp computed for the unit; returns each unit's gradient message to the
        previous stage. Refuses the model on a mismatch (self_check.py)."""
        names = self.stage.names()
        owners = {
            p: (self.stage._owner[p], type(self.stage.layers[self.stage._owner[p]]).__name__)
            for p in self.stage.trainable
        }
        called = set(state.calls) | set(state.kept)
        comparison = self_check.Comparison(
            self.stage.index, self_check.compute_dtype(self.stage.precision, self.stage.trainable, [])
        )
        # a sample with a non-finite norm is left out of the update (clip factor 0), but its NaN or inf
        # reaches every unit's own gradient of the parameters it flows into (0 * NaN is NaN)
        comparison.non_finite_units = any(not bool(torch.isfinite(v).all()) for v in per_param.values())
        messages: List[Activation] = []
        for k, unit in enumerate(probe.units):
            grads: Sequence[Optional[torch.Tensor]] = [None] * (len(self.stage.trainable) + len(leaves))
            if outputs:
                seeds = self._seeds(outputs, selected, probe, k, unit)
                wrt = list(self.stage.trainable) + list(leaves)
                with full_precision():  # the reference in the norms' own precision (no TF32)
                    grads = torch.autograd.grad(outputs, wrt, seeds, retain_graph=True, allow_unused=True)
            if not self.stage.is_first:
                messages.append(gradient_message(leaves, state.tuple_input, grads[len(self.stage.trainable) :]))
            reference = {p: g for p, g in zip(self.stage.trainable, grads) if g is not None}
            scale = comparison.scale(reference)
            summed: Dict[nn.Parameter, torch.Tensor] = {}  # parameters several layers use: compared once, summed
            for name, got, replayed_in in self._unit_gradients(state, unit):  # one layer at a time
                computed_in = self.stage.capture.output_dtypes.get(name)
                # a float64 layer whose replay computed in float32 too (a sink's scale): rounding flips between
                # the micro-batch and the row alone, as in the mixing check
                inside = computed_in == {torch.float64} and torch.float32 in replayed_in
                for p, have in got.items():
                    if id(p) in self.stage._shared:
                        summed[p] = summed[p] + have if p in summed else have
                        continue
                    squared = float(per_param[p][unit]) if p in per_param else 0.0
                    want = reference.pop(p, None)
                    comparison.add(
                        p, names[id(p)], owners[p], name in called, want, have, squared, scale, computed_in, inside
                    )
            for p, have in summed.items():
                squared = float(per_param[p][unit]) if p in per_param else 0.0
                comparison.add(p, names[id(p)], owners[p], True, reference.pop(p, None), have, squared, scale)
            for p, want in reference.items():  # reached by autograd, by no layer call pipedp captured
                comparison.add(p, names[id(p)], owners[p], owners[p][0] in called, want, None, 0.0, scale)
        comparison.refuse_if_any(lambda: self._sums(state, outputs, output_grads))
        # every unit real and finite: a padding row (or a sample left out) could hide a flow between samples
        finite = [r for r in probe.units if all(bool(torch.isfinite(v[r])) for v in per_param.values())]
        self.conclusive = len(finite) == state.units and not comparison.unverified
        return messages

    def _seeds(self, outputs, selected: List[bool], probe: Probe, k: int, unit: int) -> List[torch.Tensor]:
        if self.stage.is_last:  # the loss of the unit alone: the sum of its rows' losses
            seed = torch.zeros_like(outputs[0])
            seed[self.stage.units.rows_of(unit)] = 1
            return [seed]
        incoming = [g for g, carries in zip(tensors_of(probe.messages[k]), selected) if carries]
        return [g.to(t.dtype) for t, g in zip(outputs, incoming)]

    def _unit_gradients(self, state: "MicroBatchState", unit: int):
        """(layer, {param: the per-sample gradient of ``unit``}, the dtypes its rule computed in) as pipedp's W
        would use it: the kept tensor's entry for it, or the layer's rule on the unit's rows alone (one-hot clip
        factors)."""
        span = self.stage.units.rows_of(unit)
        for name, grads in state.kept.items():
            yield name, {p: g[unit] for p, g in grads.items()}, set()
        for name, calls in state.calls.items():
            layer = self.stage.layers[name]
            got: Grads = {}
            with named_layer_errors(name, layer), self_check.Precisions() as computed:
                for call, bp in zip(calls, state.backprops[name]):
                    with call.replayed(layer):
                        one = clipped_grad_sum(layer, tuple(a[span] for a in call.inputs), bp[span])
                    for p, g in one.items():
                        got[p] = got[p] + g if p in got else g
            yield name, got, computed.dtypes

    def _sums(self, state: "MicroBatchState", outputs, output_grads) -> Tuple[Grads, Grads]:
        """For a refusal's diagnosis: pipedp's W with every clip factor 1, and autograd's micro-batch gradient."""
        total: Grads = {}
        for grads in state.kept.values():
            for p, g in grads.items():
                total[p] = total[p] + g.sum(0) if p in total else g.sum(0)
        for name, calls in state.calls.items():
            layer = self.stage.layers[name]
            for call, bp in zip(calls, state.backprops[name]):
                with call.replayed(layer):
                    one = clipped_grad_sum(layer, call.inputs, bp)
                for p, g in one.items():
                    total[p] = total[p] + g if p in total else g
        summed = torch.autograd.grad(
            outputs, list(self.stage.trainable), output_grads, retain_graph=True, allow_unused=True
        )
        return total, {p: g for p, g in zip(self.stage.trainable, summed) if g is not None}
