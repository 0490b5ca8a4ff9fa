"""A layer whose per-sample arithmetic fails is named in the error, with the way out (the stage's passes and
its self-check both run layer rules)."""

from __future__ import annotations

import contextlib

import torch.nn as nn

from ..errors import BatchError, TransportError, UnsupportedModelError


@contextlib.contextmanager
def named_layer_errors(name: str, layer: nn.Module):
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
