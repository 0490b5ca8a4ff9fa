"""The layer-rule registry itself: the LayerRule type, register(), and the shared helpers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

Grads = Dict[nn.Parameter, torch.Tensor]


# the cost models' exchange rate (LayerRule.costs): a byte moved counts as this many multiply-adds (a 2-core CPU
# does ~25 G multiply-adds/s against ~10 GB/s)
MACS_PER_BYTE = 2.5


@dataclass(frozen=True)
class LayerRule:
    name: str
    grads: Callable[[nn.Module, Sequence[torch.Tensor], torch.Tensor], Grads]
    weight: Callable[[nn.Module, Sequence[torch.Tensor], torch.Tensor], Grads]
    norms: Optional[Callable[..., Optional[Grads]]] = None  # (layer, inputs, backprops, grams) -> {param: [n]}
    keepable: Optional[Callable[[nn.Module, Sequence[torch.Tensor], torch.Tensor], bool]] = None
    # the math sums over every dimension between the first (the sample) and the features: the rows of a
    # privacy layer may be folded into positions (privacy/units.py)
    pools_positions: bool = False
    # (layer, inputs, backprops, factors, sums) -> None: the clipped sum sum_i factors_i grad_i added into
    # the running sums in place (no full-size temporary per micro-batch), from the unscaled backprops and
    # the per-row factors [n] (the rule chooses which tensor to scale); None: weight() of the scaled
    # backprops, then an add
    add_weight: Optional[Callable[[nn.Module, Sequence[torch.Tensor], torch.Tensor, torch.Tensor, Grads], None]] = None
    # (layer, inputs, backprops) -> {way: cost} of the ways the rule can take for this call (keep, ghost,
    # materialize; runtime/grad_modes.py's auto takes the cheapest allowed); None: the grad mode's order
    costs: Optional[Callable[[nn.Module, Sequence[torch.Tensor], torch.Tensor], Dict[str, float]]] = None
    # the layer is called on the micro-batch's tokens flattened to [n T, ...] (every input; a mixture of
    # experts' router and bank): the capture folds its inputs and output-gradient to [n, T, ...]
    flat_tokens: bool = False
    # the rule reads the layer's first this many positional inputs; the capture keeps only those (a
    # router's score-correction bias, its second input, chooses experts: the rule takes the forward's choice)
    reads_inputs: Optional[int] = None
    # the layer returns a tuple: this element carries every gradient its parameters get (a router's logits)
    output_part: Optional[int] = None
    # the layer returns a tuple: this element is kept as one more input of the rule (detached): a scoring
    # router's logits, from which its rule replays the scores with the forward's own values
    kept_part: Optional[int] = None
    # with flat_tokens: the layer is called on every token once per expert, [E, batch T, ...] flattened
    # expert-first (Llama-4's experts); this gives E, and the capture folds to [batch, T E, ...] (t E + e)
    experts_first: Optional[Callable[[nn.Module], int]] = None
    # the rule computes with every trainable parameter below the module, which is one layer whose children are
    # never called on their own (PEFT's LoRA on an expert bank's parameters folds its factors into the bank's
    # weights): capture hooks the module, not its children
    holds_below: bool = False
    # the rule replays the layer's own forward (torch.func): its calls may take keyword arguments and positional
    # ones that are not batch-first (the capture keeps them for the replay, rules/keywords.py) and return a tuple
    # whose first element is its output (the others that the model uses are joined to it: keywords.join)
    keywords: bool = False
    # the rule replays each sample alone (LOOPED): the capture checks at the layer's first call of several samples
    # that the first and the last sample alone give their rows of the whole call (a block dropping tokens by
    # capacity would not), self-check or not
    alone: bool = False


def fold_tokens(t: torch.Tensor, rows: int, experts: int = 1) -> torch.Tensor:
    """Tokens flattened [rows T, ...] as [rows, T, ...]; flattened expert-first, [experts, rows T, ...], as
    [rows, T experts, ...] (sample i's position t E + e: expert e's call on its token t, so that the expert
    of a position is its index modulo E, also once a privacy unit's rows are folded into its positions)."""
    if experts == 1:
        return t.reshape(rows, -1, *t.shape[1:])
    return (
        t.reshape(experts, rows, -1, *t.shape[1:])
        .permute(1, 2, 0, *range(3, t.dim() + 2))
        .reshape(rows, -1, *t.shape[1:])
    )


RULES: Dict[type, LayerRule] = {}
PREDICATES: List[Tuple[Callable[[nn.Module], bool], LayerRule]] = []


def register(layer: "type | Callable[[nn.Module], bool]", rule: LayerRule) -> None:
    """Register ``rule`` for a layer type (exact type match), or for every module a predicate accepts."""
    if isinstance(layer, type):
        RULES[layer] = rule
    else:
        PREDICATES.append((layer, rule))


def unregister(layer: type, rule: LayerRule) -> None:
    """Forget ``rule`` for the layer type if it is the one registered (a model's adapter decides again)."""
    if RULES.get(layer) is rule:
        del RULES[layer]


def typed_rule(module: nn.Module) -> Optional[LayerRule]:
    """The rule registered for the module's exact type, else the first registered predicate's that accepts it."""
    rule = RULES.get(type(module))
    if rule is not None:
        return rule
    return next((rule for accepts, rule in PREDICATES if accepts(module)), None)


def holds_below(module: nn.Module) -> bool:
    """The module is one layer with every trainable parameter below it (LayerRule.holds_below)."""
    rule = typed_rule(module)
    return rule is not None and rule.holds_below


def per_row(factors: torch.Tensor, dim: int) -> torch.Tensor:
    """[n] factors as [n, 1, ...], broadcastable to a [n, ...] tensor of ``dim`` dimensions."""
    return factors.reshape((-1,) + (1,) * (dim - 1))


CONTAINERS = (nn.ParameterDict, nn.ParameterList)


def has_trainable_children(layer: nn.Module) -> bool:
    """Children (other than parameter containers) with trainable parameters of their own."""
    return any(p.requires_grad for c in layer.children() if not isinstance(c, CONTAINERS) for p in c.parameters())


# a module's attribute naming the children (paths below it) whose parameters it reads itself in its forward
# without calling them (F.conv1d(x, self.conv.weight): a Mamba mixer's, LFM2's short convolution), set where the
# model is split (split/hf_capturable.py): it is one layer with them, replayed by torch.func
READS = "_pipedp_reads"


def read_children(module: nn.Module) -> Tuple[str, ...]:
    """The children whose parameters ``module`` reads itself (READS)."""
    return module.__dict__.get(READS, ())


def layer_parameters(module: nn.Module) -> List[Tuple[str, nn.Parameter]]:
    """The trainable parameters a module computes with as one *layer*, by name relative to it: its own
    (not those it only re-registers from a child that computes with them, as Opacus's DPLSTM does for
    nn.LSTM's state-dict names), and those of the parameter containers (ParameterDict / ParameterList)
    directly under it, which it reads itself (PEFT's LoRA on an embedding, IA3), and of the children it reads
    without calling them (READS); all those below it for a module whose rule holds them (LayerRule.holds_below)."""
    if isinstance(module, CONTAINERS):
        return []
    if holds_below(module):
        return [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    below = {id(p) for c in module.children() if not isinstance(c, CONTAINERS) for p in c.parameters()}
    own = [(n, p) for n, p in module.named_parameters(recurse=False) if p.requires_grad and id(p) not in below]
    for name, child in module.named_children():
        if isinstance(child, CONTAINERS):
            own += [(f"{name}.{n}", p) for n, p in child.named_parameters() if p.requires_grad]
    for path in read_children(module):
        own += [(f"{path}.{n}", p) for n, p in module.get_submodule(path).named_parameters() if p.requires_grad]
    return own


def reads_containers(module: nn.Module) -> bool:
    """Parameters it reads itself from parameter containers under it, or from children it does not call (READS)."""
    if read_children(module):
        return True
    return any(isinstance(c, CONTAINERS) and any(p.requires_grad for p in c.parameters()) for c in module.children())
