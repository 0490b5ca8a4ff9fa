"""An input embedding tied to the output head across the first and last stage, in one place.

The tie (found by ``pipedp.split.partition.find_ties``) makes one parameter's per-sample gradient
the sum of two uses on two stages: ``||g_emb + g_head||^2 = ||g_emb||^2 + ||g_head||^2 +
2 <g_emb, g_head>``. The cross term is ``2 sum_t <G_i[t], M_i[t]>`` with ``M_i = B_i[:, x_i]^T H_i``
(B the head's output-grads, H its inputs, x the token ids, G the embedding's output-grads): after
its I, the head's stage builds M and sends it back behind the gradient (middle stages relay it),
and stage 0 adds the cross term to its norms before the norm reduction. After W, both clipped
parts are summed into the tensor(s) that get stepped, and the noise is added once, by the owner.

The executor calls ``StageTie.after_backward`` after every I; the runtimes call ``combine`` (one
process: the owner adds the partner's part; processes: an all-reduce over the two copies).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Set, Tuple

import torch
import torch.nn as nn

from ..errors import UnsupportedModelError
from ..split.partition import Tie


def the_tie(ties: List[Tie], flat_clipping: bool) -> Optional[Tie]:
    """The one embedding / head tie pipedp handles across stages, under flat clipping."""
    if not ties:
        return None
    if len(ties) > 1 or not flat_clipping:
        raise UnsupportedModelError(
            f"tied weights across stages {[t.owner for t in ties]}: pipedp clips one embedding tied to the head "
            "exactly under clipping='flat'; untie them (untie_weights=True) for per-stage / per-layer clipping"
        )
    return ties[0]


@dataclass(frozen=True)
class TieRole:
    role: str  # "owner": the first stage's embedding; "relay": a middle stage; "partner": the last stage's head
    name: str  # the tied parameter's name on this stage ("" on a relay)
    own_copy: bool  # partner only: holds its own copy (another process) rather than the owner's tensor

    @staticmethod
    def for_stage(stage: int, stages: int, tie: Optional[Tie], own_copy: bool) -> Optional["TieRole"]:
        if tie is None:
            return None
        if stage == 0:
            return TieRole("owner", tie.owner, own_copy)
        if stage == stages - 1:
            return TieRole("partner", tie.partner, own_copy)
        return TieRole("relay", "", own_copy)


class StageTie:
    """One stage's part in the tie."""

    def __init__(self, role: TieRole, stage_index: int, layers: Dict[str, nn.Module]):
        self.role, self.stage_index = role, stage_index
        self.layer = ""  # the layer holding the tied weight (the Embedding, or the head Linear)
        self.module: Optional[nn.Module] = None
        self.weight: Optional[nn.Parameter] = None
        if role.role != "relay":
            self.layer = next((name for name in layers if f"{name}.weight" == role.name), "")
            if not self.layer:
                raise UnsupportedModelError(f"stage {stage_index}: tied parameter {role.name} belongs to no layer here")
            self.module = layers[self.layer]
            self.weight = self.module.weight

    # ---- which parameters this stage steps and noises -------------------------------------------
    def stepped(self, parameters: List[nn.Parameter]) -> List[nn.Parameter]:
        """In one process the owner steps the shared tensor: the partner leaves it out."""
        if self.role.role == "partner" and not self.role.own_copy:
            return [p for p in parameters if p is not self.weight]
        return parameters

    def noised_elsewhere(self, parameters: List[nn.Parameter]) -> Set[int]:
        """Indices of ``parameters`` whose noise another stage adds (the partner's own copy)."""
        if self.role.role == "partner" and self.role.own_copy:
            return {k for k, p in enumerate(parameters) if p is self.weight}
        return set()

    def index_in(self, parameters: List[nn.Parameter]) -> int:
        return next(i for i, p in enumerate(parameters) if p is self.weight)

    # ---- after I: the message, the relay, the cross term -----------------------------------------
    def after_backward(
        self, state, ids: torch.Tensor, norms: torch.Tensor, incoming: Optional[torch.Tensor]
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(this stage's norms, the message to send back behind the gradient, if any)."""
        if self.role.role == "partner":
            return norms, self._message(state, ids)
        if self.role.role == "relay":
            return norms, incoming
        assert incoming is not None
        return norms + 2 * self._cross(state, incoming, ids).to(norms.device), None

    def _message(self, state, ids: torch.Tensor) -> torch.Tensor:
        """M[i, t] = sum_s B_i[s, x_i[t]] H_i[s], [n, T, d], from the head's output-grads B and inputs H."""
        calls = state.calls.get(self.layer, [])
        if len(calls) != 1:
            raise UnsupportedModelError(f"the tied head {self.layer!r} must run once per micro-batch, ran {len(calls)}")
        n = state.units  # a privacy unit's rows are folded into its positions (privacy/units.py)
        head_in = calls[0].inputs[0].reshape(n, -1, calls[0].inputs[0].shape[-1])
        grads, first = self._held_columns(state.backprops[self.layer][0])
        grads = grads.reshape(n, -1, grads.shape[-1])
        ids = ids.reshape(n, -1).to(grads.device)
        if ids.shape[1] != grads.shape[1]:
            raise UnsupportedModelError(
                f"the tied head sees {grads.shape[1]} positions per sample but the inputs have {ids.shape[1]} ids: "
                "an embedding tied to the head needs the head applied to every input position"
            )
        # a tensor-parallel head holds the rows [first, first + width) of the weight: the ids of other rows add
        # nothing here (the rank holding them adds their part of the cross term; the parts sum over the ranks)
        local = ids - first
        outside = (local < 0) | (local >= grads.shape[-1])
        index = local.masked_fill(outside, 0)[:, None, :].expand(n, grads.shape[1], ids.shape[1])
        picked = grads.gather(2, index).masked_fill(outside[:, None, :], 0)  # [n, s, t] = B[s, x[t]]
        return torch.bmm(picked.transpose(1, 2), head_in.to(picked.dtype))

    def _held_columns(self, grads: torch.Tensor) -> Tuple[torch.Tensor, int]:
        """(the head's output-gradient columns of the weight rows this rank holds, the first row's id): all of
        them but under tensor parallelism, where the head holds rows [start, start + out_features) and its
        output-gradient is either that slice or, gathered for the user's loss, the whole vocabulary's."""
        assert self.module is not None
        first, width = getattr(self.module, "start", 0), self.module.out_features
        return (grads.narrow(-1, first, width) if grads.shape[-1] != width else grads), first

    def _cross(self, state, message: torch.Tensor, message_ids: torch.Tensor) -> torch.Tensor:
        """<g_emb,i, g_head,i> per privacy unit, [units] float64. ``message_ids``: the ids the partner built the
        message from, which must be the ones the embedding read."""
        calls = state.calls.get(self.layer, [])
        ids = calls[0].inputs[0] if len(calls) == 1 else None
        if ids is None or ids.shape != message_ids.shape or not torch.equal(ids, message_ids.to(ids.device)):
            raise UnsupportedModelError(
                f"the tied embedding {self.layer!r} must read the micro-batch's token ids, once and unchanged, for "
                "pipedp to compute the tie's cross term exactly; it read other values (or ran "
                f"{len(calls)} times): give the head its own weight"
            )
        grads = state.backprops[self.layer][0]
        padding = getattr(self.module, "padding_idx", None)
        if padding is not None:  # autograd gives the padding row no gradient (its id: a slice's row + its start)
            padding += getattr(self.module, "start", 0)
            grads = grads * (ids != padding).unsqueeze(-1).to(grads.dtype)
        g3 = grads.reshape(state.units, -1, grads.shape[-1]).double()
        scale = float(getattr(self.module, "embed_scale", 1.0))  # a scaled embedding (Gemma): d out / d weight row
        return scale * (g3 * message.reshape(g3.shape).double()).sum((1, 2))

    # ---- after W: both clipped parts into what gets stepped --------------------------------------
    def combine_in_process(
        self, grads: List[torch.Tensor], parameters: List[nn.Parameter], partner_part: Callable[[], torch.Tensor]
    ) -> List[torch.Tensor]:
        """Owner, one process: add the partner's clipped part of the shared tensor."""
        if self.role.role != "owner":
            return grads
        k = self.index_in(parameters)
        grads = list(grads)
        grads[k] = grads[k] + partner_part()
        return grads

    def combine_across(
        self, grads: List[torch.Tensor], parameters: List[nn.Parameter], all_reduce: Callable[[torch.Tensor], None]
    ) -> List[torch.Tensor]:
        """Processes: both copies get the sum of both clipped parts (noise added once, by the owner), so
        they stay equal."""
        if self.role.role == "relay":
            return grads
        k = self.index_in(parameters)
        total = grads[k].clone()
        all_reduce(total)
        return [total if i == k else g for i, g in enumerate(grads)]
