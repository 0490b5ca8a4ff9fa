"""The layer-rule registry: one entry per layer type, holding that layer's per-sample DP math.

A rule answers, for one *layer* (a module directly owning trainable parameters) called on
batch-first ``inputs`` with output-gradients ``backprops``:
- ``grads``: the per-sample gradients {param: [n, *param.shape]};
- ``weight``: the summed gradient {param: [*param.shape]} for backprops already scaled by each
  sample's clip factor (W: one local vector-Jacobian product, no per-sample tensors);
- ``norms`` (optional): the per-sample squared norms {param: [n]} without materializing the
  gradients (ghost norms), or None where no closed form applies or materializing is cheaper;
- ``add_weight`` (optional): that sum added in place into the running sums, from the unscaled
  backprops and the factors (the rule scales the cheaper tensor: a Linear its narrower side);
- ``keepable`` (optional): whether this call's per-sample gradients are cheap enough in closed form
  to be computed once in I and kept until W (their memory is then checked by the caller).

Lookup (``rule_for``): a rule that holds every parameter below its layer (``holds_below``: PEFT's
LoRA on an expert bank); a layer that also has trainable children -> the torch.func fallback; the
exact type; a registered predicate (e.g. Hugging Face's Conv1D, matched by shape not import); a
layer type Opacus has a grad sampler for; else the torch.func fallback. Adding a layer type is one
``register`` call (as Opacus's ``register_grad_sampler``).
"""

from __future__ import annotations

import torch.nn as nn

from . import embedding, expert_lora, generic, layer_norm, linear  # noqa: F401  (each registers its rules)
from .experts import EXPERTS, ROUTER  # (registered per class by the adapter that checks a model's bank)
from .registry import (
    RULES,
    Grads,
    LayerRule,
    has_trainable_children,
    holds_below,
    layer_parameters,
    reads_containers,
    register,
    typed_rule,
)

__all__ = [
    "Grads",
    "LayerRule",
    "RULES",
    "register",
    "rule_for",
    "layer_parameters",
    "holds_below",
    "EXPERTS",
    "ROUTER",
]


def rule_for(layer: nn.Module) -> LayerRule:
    rule = typed_rule(layer)
    if rule is not None and rule.holds_below:
        return rule
    if has_trainable_children(layer) or reads_containers(layer):  # (typed rules know one module's own tensors)
        return generic.FUNCTORCH
    if rule is not None:
        return rule
    if type(layer) in generic.GRAD_SAMPLERS:
        return generic.OPACUS
    return generic.FUNCTORCH
