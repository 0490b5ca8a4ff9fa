"""The dry run: a Hugging Face model's own forward, run once at construction on a tiny batch (2 x 3
tokens, one row left-padded) with every decoder layer stubbed and every weight replaced by zeros (so
it costs nothing, on a real model or on meta). It tells each part's side (before the layers: the
first stage's; after: the last's) and how a layer's output reaches the next (as it is, or as the
first element of a tuple), and checks what the adapter relies on:
- the layers are called once each, in order, each given the previous one's output unchanged;
- what the forward gives a layer besides the hidden state depends on no trainable parameter nor on
  an earlier layer (every stage recomputes it from its micro-batch's inputs);
- a part owning parameters runs on one side of the layers only, called in a way the blocks can make
  positional (hf_runs.positional), and no trainable parameter is read outside its module's call.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Dict, List, Set, Tuple

import torch
import torch.nn as nn

from ..errors import UnsupportedModelError
from .hf_runs import (
    Stop,
    call_forward,
    layers_replaced,
    owns_parameters,
    positional,
    read_outside_calls,
    standing_in,
    trainable_of,
)

WAY_OUT = (
    "give the model a pipeline_blocks() method returning [(name, module), ...], or mark split points with "
    "pipe_split() and wrap it in pipedp.SplitModel"
)
ROWS, LENGTH = 2, 3


# how a layer's output reaches the next: (a tuple, how many of its first elements the next layer takes as its
# first positional arguments): a tensor; a 1-tuple; a 2-tuple whose second element is a stream of its own (ZAYA's
# router states, which the next layer's router reads)
OUTPUTS = ((False, 1), (True, 1), (True, 2))


def dry_run(s, parts: Dict[str, nn.Module]) -> Tuple[Dict[str, Set[str]], Tuple[bool, int], list]:
    """Run ``s.model``'s forward (``s``: hf_structure.Structure) with stubs returning each of OUTPUTS in turn: the
    first under which each layer's output reaches the next layer unchanged is the forward's. Returns where each
    part ran ("pre" / "post"), that choice, and what each layer was given (its hidden state's shape, its other
    arguments, a stream's as the forward gives it to the first layer)."""
    errors: List[Exception] = []
    for output in OUTPUTS:
        run = _DryRun(s, parts, *output)
        try:
            run.run()
            return run.sides, output, [c[:3] for c in run.calls]
        except (_Mismatch, _Failed) as exc:  # (a forward unpacking two outputs fails on one)
            errors.append(exc)
    # (the plain outputs' errors say what is wrong; a stream was only a guess)
    failed = next((e for e in errors[:2] if isinstance(e, _Failed)), None)
    if failed is not None:
        raise failed
    raise UnsupportedModelError(
        f"{type(s.model).__name__}: its forward does not pass each decoder layer's output on to the next layer "
        f"unchanged ({errors[0]}); pipedp runs the layers on their own, so it would miss what happens between "
        f"them: {WAY_OUT}"
    )


class _Mismatch(Exception):
    pass


class _Failed(UnsupportedModelError):
    """The model's own forward failed with the layers stubbed."""


class _DryRun:
    def __init__(self, s, parts: Dict[str, nn.Module], tuple_output: bool, streams: int):
        self.s, self.parts, self.tuple_output, self.streams = s, parts, tuple_output, streams
        self.name, self.count = type(s.model).__name__, len(s.layers)
        self.device = next((t.device for t in s.model.parameters() if not t.is_meta), torch.device("cpu"))
        self.owns = {p: next(part.parameters(), None) is not None for p, part in parts.items()}
        self.modules = {f"{p}.{n}" if n else p: m for p, part in parts.items() for n, m in part.named_modules()}
        self.sides: Dict[str, Set[str]] = {}  # part -> where it ran: "pre", "post" (or "between", no parameters)
        self.called: set = set()  # ids of the modules owning parameters that ran
        self.handed: List[object] = []  # what each stub returned, to find as the next layer's input
        self.calls: list = []  # (hidden shape, args, kwargs, hidden) per layer

    def inputs(self) -> Dict[str, torch.Tensor]:
        pad = getattr(self.s.model.config.get_text_config(), "pad_token_id", None)
        ids = torch.full((ROWS, LENGTH), 1 if pad != 1 else 2, dtype=torch.long, device=self.device)
        mask = torch.ones(ROWS, LENGTH, dtype=torch.long, device=self.device)
        mask[0, 0] = 0  # a left-padded row: positions computed from the mask differ from 0..T-1
        return {"input_ids": ids, "attention_mask": mask}

    def run(self) -> None:
        handles = [
            m.register_forward_pre_hook(self.part_hook(path), with_kwargs=True)
            for path, part in self.parts.items()
            for m in part.modules()
            if m is part or owns_parameters(m)
        ]
        trainable = trainable_of(self.modules)
        everything = list(self.parts.values())
        try:
            with layers_replaced(self.s.body, self.s.layers_name, self.layer), torch.enable_grad():
                with standing_in(everything, self.device, real_too=True, own=self.s.holders):
                    out = call_forward(self.s.model, self.inputs())
                    logits = out.logits if hasattr(out, "logits") else out[0]
                    # the hidden state given to layer 0, and the logits, may depend only on parameters their module read
                    first = self.calls[0][3] if self.calls else None
                    outside = read_outside_calls(first, self.modules, self.called, trainable)
                    outside += read_outside_calls(logits, self.modules, self.called, trainable)
                    self.check_last_streams(logits)
        except (UnsupportedModelError, _Mismatch):
            raise
        except Exception as exc:  # the model's own forward failed on a plain batch with the layers stubbed
            raise _Failed(
                f"{self.name}: pipedp could not run the model's own forward with its decoder layers stood in for "
                f"({type(exc).__name__}: {exc}): {WAY_OUT}"
            ) from exc
        finally:
            for handle in handles:
                handle.remove()
        if len(self.handed) != self.count:
            raise UnsupportedModelError(
                f"{self.name}: its forward called {len(self.handed)} of its {self.count} decoder layers: {WAY_OUT}"
            )
        if outside:
            raise UnsupportedModelError(
                f"{self.name}: {', '.join(outside[:4])} is read outside the call of the module that owns it (e.g. "
                f"F.linear(x, self.embed.weight)), where per-sample gradient capture cannot see it: {WAY_OUT}"
            )

    def layer(self, i: int, args: tuple, kwargs: dict):
        """Stub of decoder layer i: checks what it is given, returns a fresh hidden state."""
        if i != len(self.handed):
            raise UnsupportedModelError(
                f"{self.name}: its forward calls decoder layer {i} after {len(self.handed)} layers (pipedp needs each "
                f"layer called once, in order): {WAY_OUT}"
            )
        hidden = args[0] if args else None
        if i and hidden is not _first(self.handed[-1]):
            raise _Mismatch(f"layer {i} did not get layer {i - 1}'s output as its first argument")
        if not isinstance(hidden, torch.Tensor) or tuple(hidden.shape[:2]) != (ROWS, LENGTH):
            shape = tuple(hidden.shape) if isinstance(hidden, torch.Tensor) else type(hidden).__name__
            raise UnsupportedModelError(
                f"{self.name}: decoder layer {i} gets {shape} as its first argument, not the hidden state "
                f"[batch, seq, hidden]: {WAY_OUT}"
            )
        if not i and len(args) < self.streams:  # (the first layer is given its streams positionally too)
            raise _Mismatch(f"layer 0 got {len(args)} positional arguments, not the hidden state and its streams")
        given = self.handed[-1] if i and isinstance(self.handed[-1], tuple) else ()
        for k in range(1, self.streams):  # a stream of the layers' own: the previous layer's output k, unchanged
            if given and (len(args) <= k or args[k] is not given[k]):
                raise _Mismatch(f"layer {i} did not get layer {i - 1}'s output {k} as its argument {k}")
        for key, value in _tensors(args[1:] if not i else args[self.streams :], kwargs):
            if value.requires_grad:
                raise UnsupportedModelError(
                    f"{self.name}: its forward gives decoder layer {i} the argument {key!r} computed from trainable "
                    "parameters or from an earlier layer; pipedp recomputes a layer's arguments on its stage from "
                    f"the micro-batch's inputs, so it cannot pass this one: {WAY_OUT}"
                )
        # (a stream as the forward gives it to the first layer: what the probes of every layer are given)
        streams = self.calls[0][1][: self.streams - 1] if i else args[1 : self.streams]
        self.calls.append((tuple(hidden.shape), (*streams, *args[self.streams :]), kwargs, hidden))
        out = torch.zeros_like(hidden).requires_grad_(True)
        markers = tuple(
            torch.zeros(ROWS, LENGTH, 1, device=self.device, requires_grad=True) for _ in range(self.streams - 1)
        )
        self.handed.append((out, *markers) if self.tuple_output else out)
        return self.handed[-1]

    def check_last_streams(self, logits: torch.Tensor) -> None:
        """The forward drops the last layer's streams (its head reads the hidden state only, as the blocks do)."""
        last = self.handed[-1] if self.streams > 1 and self.handed else ()
        markers = [t for t in last[1:] if isinstance(t, torch.Tensor)] if isinstance(last, tuple) else []
        if markers and logits.requires_grad:
            reached = torch.autograd.grad(logits.sum(), markers, allow_unused=True)
            if any(g is not None for g in reached):
                raise UnsupportedModelError(
                    f"{self.name}: its forward reads the last decoder layer's output beyond the hidden state (a "
                    f"stream the layers pass on) after the layers; pipedp's head reads the hidden state only: {WAY_OUT}"
                )

    def part_hook(self, path: str):
        def hook(module, args, kwargs):
            side = "pre" if not self.handed else "post" if len(self.handed) == self.count else "between"
            sides = self.sides.setdefault(path, set())
            if not self.owns[path]:  # a part without parameters (rotary embeddings, a norm) may run anywhere
                sides.add(side)
            elif side == "between" or sides | {side} != {side}:
                when = "between decoder layers" if side == "between" else "both before and after the decoder layers"
                raise UnsupportedModelError(
                    f"{self.name}: {path} ({type(module).__name__}) runs {when}; pipedp puts each part of the model "
                    f"on one stage: {WAY_OUT}"
                )
            sides.add(side)
            if owns_parameters(module):  # as the blocks will call it
                self.called.add(id(module))
                weights = partial(_random_like, module, self.device)  # made only if the call needs the check
                positional(f"{self.name}: {path}", module, args, kwargs, ROWS, weights)

        return hook


def reads_token_ids(s, parts: Dict[str, nn.Module]) -> bool:
    """Whether what the forward gives its layers depends on the token ids beyond their shape: the same
    as given ``inputs_embeds`` instead (what a stage does without an input dict) or not. The ids hold a
    padding token, in case the forward makes a mask from them."""
    device = next((t.device for t in s.model.parameters() if not t.is_meta), torch.device("cpu"))
    pad = getattr(s.model.config.get_text_config(), "pad_token_id", None)
    ids = torch.full((ROWS, LENGTH), 1 if pad != 1 else 2, dtype=torch.long, device=device)
    if pad is not None:
        ids[0, 0] = pad
    weight = s.model.get_input_embeddings().weight
    embeds = torch.zeros(ROWS, LENGTH, weight.shape[-1], dtype=weight.dtype, device=device)
    quiet = logging.getLogger("transformers")  # not the user's: "padding without an attention mask"
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        with torch.no_grad(), standing_in(list(parts.values()), device, real_too=True, own=s.holders):
            given = [_layer_arguments(s, {"input_ids": ids}), _layer_arguments(s, {"inputs_embeds": embeds})]
    finally:
        quiet.setLevel(level)
    return not _same(*given)


def _layer_arguments(s, inputs: Dict[str, torch.Tensor]) -> list:
    calls: list = []

    def on_call(i, args, kwargs):
        calls.append((args[1:], kwargs))
        if i == len(s.layers) - 1:
            raise Stop()
        return s.stand_in(args)

    with layers_replaced(s.body, s.layers_name, on_call):
        try:
            call_forward(s.base, inputs)
        except Stop:
            pass
    return calls


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and (a is b or a == b)


def _random_like(module: nn.Module, device) -> Dict[str, torch.Tensor]:
    """Random values for a module's own parameters: a call that reads other rows of a table than the
    model's own call shows as another output (zeros would hide it)."""
    g = torch.Generator(device=device).manual_seed(0)
    return {
        k: torch.randn(p.shape, generator=g, device=device).to(p.dtype) if p.is_floating_point() else p
        for k, p in module._parameters.items()
        if p is not None
    }


def _first(value):
    return value[0] if isinstance(value, tuple) else value


def _tensors(args, kwargs):
    stack = [(f"argument {k + 1}", a) for k, a in enumerate(args)] + list(kwargs.items())
    while stack:
        key, value = stack.pop()
        if isinstance(value, torch.Tensor):
            yield key, value
        elif isinstance(value, (tuple, list)):
            stack.extend((key, v) for v in value)
        elif isinstance(value, dict):
            stack.extend((key, v) for v in value.values())
