"""The three runs of a Hugging Face model's own forward that its pipeline blocks are made of.

- embed(inputs):       the forward up to the first decoder layer; its input is the hidden state.
- layer_call(i, ...):  what the forward gives layer i besides the hidden state, from a run without
                       gradients that stops at the last layer (one run per micro-batch and stage:
                       every layer block of the stage reads the same record; the run leaves the
                       random state as it found it, see rng_kept).
- head(hidden, ...):   the forward with the last layer's output replaced by the stage's hidden
                       state, on to the logits (before it, nothing is recorded for gradients).

A stage recomputes all this from its micro-batch's input dict (``side_inputs``); with plain token
ids (no dict) the later stages get zeros as ``inputs_embeds`` instead, the same masks and positions.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch

from ..errors import BatchError, UnsupportedModelError
from .hf_runs import LayerCall, Stop, call_forward, layers_replaced, positional_calls, rng_kept, standing_in
from .hf_structure import Structure


class Driver:
    """Runs one model's forward for its blocks (hf_blocks.py); shared by them."""

    def __init__(self, structure: Structure):
        self.s = structure
        self._record: Optional[tuple] = None  # (key, inputs, [LayerCall per layer]) of the last micro-batch probed

    # ---- the runs ------------------------------------------------------------------------------
    def embed(self, inputs) -> torch.Tensor:
        batch = dict(inputs) if isinstance(inputs, dict) else {"input_ids": inputs}
        rows = int(next(iter(batch.values())).shape[0])

        def on_call(i, args, kwargs):
            raise Stop(args[0])

        self._check_context()
        with layers_replaced(self.s.body, self.s.layers_name, on_call), positional_calls(self.s.pre, rows):
            try:
                call_forward(self.s.base, batch)
            except Stop as stop:
                return stop.value
        raise UnsupportedModelError(f"{type(self.s.model).__name__}: its forward did not reach decoder layer 0")

    def layer_call(self, index: int, hidden: torch.Tensor, side: Optional[Dict[str, torch.Tensor]]) -> LayerCall:
        """Read from the record of the last micro-batch probed when it had the same inputs (by value:
        a micro-batch's tensors may be refilled in place) and shape, device and embedding dtype (the
        masks' dtype); probed anew otherwise."""
        dtype = self.s.model.get_input_embeddings().weight.dtype
        key = (tuple(hidden.shape[:2]), hidden.device, dtype, tuple(sorted(side or {})))
        if self._record is None or self._record[0] != key or not _same_values(self._record[1], side or {}):
            calls = self._probe(hidden, side)
            self._record = (key, {k: v.clone() for k, v in (side or {}).items()}, calls)
        return self._record[2][index]

    def head(self, hidden: torch.Tensor, side: Optional[Dict[str, torch.Tensor]]) -> torch.Tensor:
        last, outer = len(self.s.layers) - 1, torch.is_grad_enabled()

        def on_call(i, args, kwargs):
            if i < last:
                return self.s.stand_in(args)
            torch.set_grad_enabled(outer)  # from here on (final norm, head) the forward is the stage's
            return self.s.stand_in(args, hidden)

        inputs = self._inputs(hidden, side)
        self._check_context()
        torch.set_grad_enabled(False)  # the embeddings it computes first are thrown away
        try:
            with (
                layers_replaced(self.s.body, self.s.layers_name, on_call),
                standing_in(list(self.s.pre.values()), hidden.device, own=self.s.holders),
                positional_calls(self.s.post, int(hidden.shape[0])),
            ):
                out = call_forward(self.s.model, inputs)
        finally:
            torch.set_grad_enabled(outer)
        return out.logits if hasattr(out, "logits") else out[0]

    # ---- helpers --------------------------------------------------------------------------------
    def _probe(self, hidden: torch.Tensor, side) -> List[LayerCall]:
        calls: List[LayerCall] = []
        last = len(self.s.layers) - 1

        def on_call(i, args, kwargs):
            calls.append((args[1:], kwargs))
            if i == last:
                raise Stop()
            return self.s.stand_in(args)

        inputs = self._inputs(hidden, side)
        self._check_context()
        with torch.no_grad(), rng_kept(hidden.device), layers_replaced(self.s.body, self.s.layers_name, on_call):
            with standing_in(list(self.s.pre.values()), hidden.device, own=self.s.holders):
                try:
                    call_forward(self.s.base, inputs)
                except Stop:
                    pass
        return calls

    def _inputs(self, hidden: torch.Tensor, side) -> Dict[str, torch.Tensor]:
        if side is not None:
            return {k: v.to(hidden.device) for k, v in side.items()}
        if self.s.kind == "classification" or self.s.reads_ids:
            needs = (
                "reads each sequence's score at its last token that is not padding"
                if self.s.kind == "classification"
                else "gives its layers arguments computed from the token ids"
            )
            raise BatchError(
                f"{type(self.s.model).__name__} {needs}, which every stage needs then: pass the inputs as a dict "
                "{'input_ids': ..., 'attention_mask': ...}"
            )
        weight = self.s.model.get_input_embeddings().weight
        shape = (*hidden.shape[:2], weight.shape[-1])
        return {"inputs_embeds": torch.zeros(shape, dtype=weight.dtype, device=hidden.device)}

    def _check_context(self) -> None:
        for path, part in self.s.context.items():
            meta = [n for n, b in part.named_buffers() if b.is_meta]
            if meta:
                raise UnsupportedModelError(
                    f"{type(self.s.model).__name__}: {path}.{meta[0]} is on the meta device (buffers not saved in "
                    "checkpoints have no value there): build the model with pipedp.split.hf_loading.build_on_meta or "
                    "load it with load_pipeline_stage, which compute them, or build it on a real device"
                )


def _same_values(kept: Dict[str, torch.Tensor], side: Dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(kept[k], v.to(kept[k].device)) for k, v in side.items())
