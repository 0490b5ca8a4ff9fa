"""The estimate: a model built on meta (no weight read: seconds even for 7B), LoRA applied on meta as ``pipedp train``
applies it, prepared and split as training prepares it (``pipedp.train.prepare``); each stage's static bytes
(static.py) and its passes simulated on fake tensors (simulate.py), composed along the schedule's own action order
into each stage's peak (report.compose): the first micro-batch (it makes the clipped sums) and the later ones each
as simulated, and with the self-check on, the first step's self-checked micro-batch. ``estimate`` is the entry
point (``pipedp plan`` calls it); ``largest_fit`` searches the largest micro-batch size that fits a memory.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import replace
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

import schedules
from schedules import Kind

from ..config import TINY_GPT, TINY_GPT_SHAPE, PipelineConfig, PrivacyConfig
from ..errors import PipeDPError
from ..models import GPTConfig, tiny_gpt, token_loss
from ..parallel.layers import Group
from ..parallel.plan import split_stage
from ..runtime.microbatch import PassBatch
from ..split.adapters import model_blocks
from ..split.hf_experts import moe_parts
from ..split.hf_loading import build_on_meta
from ..split.partition import block_costs
from ..train.lora import with_lora
from ..train.prepare import prepare, vocab_parallel
from .report import Plan, Profile, StagePlan, compose, format_bytes
from .simulate import fake_mode, simulate
from .static import static_bytes


def estimate(
    model: Any,
    stages: int,
    microbatch_size: int,
    seq_len: int,
    *,
    lora_r: Optional[int] = None,
    lora_targets: Sequence[str] = ("q_proj", "v_proj"),
    pipeline: Optional[PipelineConfig] = None,
    privacy: Optional[PrivacyConfig] = None,
    optimizer: str = "adamw",
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    device_memory: Optional[int] = None,
    seed: int = 0,
):
    """The plan (pipedp.planner.Plan) of training ``model`` — a Hugging Face folder, a transformers config,
    or "tiny-gpt" — on ``stages`` stages with micro-batches of ``microbatch_size`` rows of ``seq_len`` tokens.
    ``pipeline`` gives the schedule, micro-batches, grad mode, precision, checkpointing, balance (its
    ``stages`` is replaced by ``stages``)."""
    pipeline = replace(pipeline or PipelineConfig(), stages=stages).validate()
    privacy = privacy or PrivacyConfig()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        setup = Setup(
            model, pipeline, privacy, seq_len, lora_r, tuple(lora_targets), seed, optimizer, momentum, weight_decay
        )
        plans = setup.plans(microbatch_size)
        plan = Plan(setup.describe(microbatch_size), microbatch_size, seq_len, plans, device_memory)
        if device_memory is not None:
            _fit(setup, plan, device_memory)
    return plan


def _fit(setup, plan, memory: int) -> None:
    """The largest micro-batch size that fits ``memory`` on every stage: searched on profiles interpolated
    in the micro-batch size (a profile is affine in it, but for the self-check's rows below 3), simulated at
    each answer until it stands."""

    def fits(b: int, simulated: bool = False) -> bool:
        return max(s.total for s in setup.plans(b, simulated)) <= memory

    fit = largest_fit(fits)
    for _ in range(4):
        setup.profiles(max(fit, 1))  # a simulated size next to the answer: the interpolation is then local
        again = largest_fit(fits)
        if again == fit:
            break
        fit = again
    while fit and not fits(fit, simulated=True):
        fit -= 1
    while fit < 3 and fits(fit + 1, simulated=True):  # below 3 rows the interpolation is not exact
        fit += 1
    plan.largest_fit = fit
    if fit:
        tight = max(setup.plans(fit, simulated=True), key=lambda s: s.total)
        plan.fit_note = (
            f"largest micro-batch size that fits {format_bytes(memory)} on every stage: {fit} (stage {tight.index} "
            f"at {format_bytes(tight.total)}, set by its {tight.binding})"
        )
    else:
        worst = max(setup.plans(1, simulated=True), key=lambda s: s.total)
        plan.fit_note = (
            f"no micro-batch size fits {format_bytes(memory)}: with 1 row stage {worst.index} needs "
            f"{format_bytes(worst.total)} (its {worst.binding}); use more stages, LoRA, bf16-true, or --no-self-check "
            "if the first step binds"
        )


class Setup:
    """The model on meta, split and prepared as the trainer prepares it, and its fake twin for the passes."""

    def __init__(self, name, pipeline, privacy, seq_len, lora_r, targets, seed, optimizer, momentum, weight_decay=0.0):
        self.pipeline, self.seq_len, self.lora_r, self.targets = pipeline, seq_len, lora_r, targets
        self.model, self.name, base_costs = _planned_model(
            name, seq_len, pipeline.untie_weights, pipeline.balance, lora_r, targets, seed
        )
        self.hf = type(self.model).__module__.startswith(("transformers.", "peft."))
        _refuse_experts(self.model, self.name)
        # as the trainer prepares it for pipedp train's loss (token_loss: on vocabulary slices under tensor parallelism)
        self.loss = vocab_parallel(token_loss, self.model, pipeline.tensor_parallel) or token_loss
        prepared = prepare(self.model, pipeline, privacy, base_costs, vocab_parallel_loss=self.loss is not token_loss)
        self.stage_blocks, self.tie, self.options = prepared.stage_blocks, prepared.tie, prepared.options
        self.parts: List[Any] = [None] * len(self.stage_blocks)  # each stage's tensor-parallel slices
        if pipeline.tensor_parallel > 1:  # each stage as its tensor-parallel rank 0 holds it (every rank alike)
            group = Group(0, pipeline.tensor_parallel, None)  # simulated: no peers
            self.parts = [split_stage(b, prepared.tensor_parallel_plan, group) for b in self.stage_blocks]
        shard_over = pipeline.replicas if pipeline.shard_optimizer else 1
        self.static = [
            static_bytes(b, optimizer, momentum, weight_decay=weight_decay, shard_over=shard_over)
            for b in self.stage_blocks
        ]
        self.optimizer = optimizer
        self._fake = None
        self._profiles: Dict[int, tuple] = {}
        self._ways: List[Dict[str, int]] = [{} for _ in self.stage_blocks]

    def describe(self, b: int) -> str:
        p = self.pipeline
        total = sum(s.params for s in self.static)
        trainable = sum(s.trainable for s in self.static)
        tuned = f"LoRA r={self.lora_r} on {','.join(self.targets)}" if self.lora_r else "full fine-tuning"
        dtypes = sorted({str(t.dtype).replace("torch.", "") for b in self.stage_blocks for t in _params(b)})
        return (
            f"pipedp plan: {self.name} ({_count(total)} parameters in {'/'.join(dtypes)}, {_count(trainable)} "
            f"trainable: {tuned}); "
            f"{p.stages} stages"
            + (f" x {p.tensor_parallel} tensor-parallel ranks (per rank)" if p.tensor_parallel > 1 else "")
            + (f" x {p.replicas} replicas" if p.replicas > 1 else "")
            + (" (optimizer state sharded over them)" if p.shard_optimizer and p.replicas > 1 else "")
            + f", {p.schedule} x {p.microbatches} micro-batches of {b} x {self.seq_len} tokens; "
            f"precision {p.precision}, grad mode {p.grad_mode}, {self.optimizer}"
            + (", activation checkpointing" if p.activation_checkpointing else "")
            + ("" if p.self_check else ", no self-check")
        )

    # ---- the plans at a micro-batch size ------------------------------------------------------------------
    def plans(self, b: int, simulated: bool = True):
        """The stages' plans at micro-batch size ``b``: from passes simulated at ``b`` (``simulated``), or
        from the profiles interpolated between the two sizes simulated nearest to it."""
        p = self.pipeline
        costs = None if p.schedule_costs is None else dict(zip((Kind.F, Kind.I, Kind.W), p.schedule_costs))
        schedule = schedules.build(p.schedule, p.stages, p.microbatches, costs)
        sim = schedules.simulate(schedule, costs)
        plain, probed = self.profiles(b) if simulated or b in self._profiles else self._interpolated(b)
        out = []
        for s, blocks in enumerate(self.stage_blocks):
            actions = schedule.for_stage(s)
            first_mb, later_mb = plain[s]
            peak, phase = compose(actions, first_mb, later_mb)
            first = compose(actions, probed[s][0], later_mb)[0] if probed is not None else None
            out.append(
                StagePlan(
                    index=s,
                    blocks=_block_names(blocks),
                    static=self.static[s],
                    per_microbatch=later_mb.held,
                    in_flight=sim.peak_inflight[s],
                    kept=later_mb.kept * _held_between_i_and_w(actions),
                    pass_peak=peak,
                    pass_phase=phase,
                    first_pass_peak=first,
                    ways=self._ways[s],
                )
            )
        return out

    def profiles(self, b: int):
        """Per stage, the profiles of a pass's first and later micro-batches; and of the first step's
        self-checked micro-batch (None with the self-check off)."""
        if b not in self._profiles:
            plain = self.simulate(b, probe=False, microbatches=2)
            probed = self.simulate(b, probe=True, microbatches=1) if self.pipeline.self_check else None
            self._profiles[b] = (plain, probed)
        return self._profiles[b]

    def _interpolated(self, b: int):
        """Profiles at ``b`` from the two simulated sizes nearest it (a second one simulated if needed)."""
        if len(self._profiles) < 2:
            only = next(iter(self._profiles))
            self.profiles(max(2 * only, 4))  # (the self-check takes min(3, rows) rows)
        lo, hi = sorted(sorted(self._profiles, key=lambda k: (abs(k - b), k))[:2])
        t = (b - lo) / (hi - lo)
        (plain_lo, probed_lo), (plain_hi, probed_hi) = self._profiles[lo], self._profiles[hi]
        plain = [[x.towards(y, t) for x, y in zip(a, b)] for a, b in zip(plain_lo, plain_hi)]
        probed = None
        if probed_lo is not None:
            probed = [[x.towards(y, t) for x, y in zip(a, b)] for a, b in zip(probed_lo, probed_hi)]
        return plain, probed

    # ---- one micro-batch's pass on fake tensors -------------------------------------------------------------
    def simulate(self, b: int, probe: bool, microbatches: int) -> List[List[Profile]]:
        """[[Profile per micro-batch] per stage]: a pass of ``microbatches`` micro-batches of ``b`` rows on fake
        tensors (simulate.py); ``probe``: micro-batch 0 self-checked."""
        rows = b * self.options.units.rows
        batch = PassBatch(
            [self._inputs(rows) for _ in range(microbatches)],
            [torch.zeros(rows, self.seq_len, dtype=torch.long) for _ in range(microbatches)],
            [torch.ones(rows) for _ in range(microbatches)],
        )
        with self._fake_mode():
            profiles, ways = simulate(
                self.name, self.stage_blocks, self.loss, self.options, self.tie, self.parts, batch, probe
            )
        if not probe:
            self._ways = ways
        return profiles

    def _inputs(self, rows: int):
        ids = torch.zeros(rows, self.seq_len, dtype=torch.long)
        if not self.hf:
            return ids
        return {"input_ids": ids, "attention_mask": torch.ones(rows, self.seq_len, dtype=torch.long)}

    def _fake_mode(self):
        """The fake-tensor mode the model's parameters were moved into (once)."""
        if self._fake is None:
            self._fake = fake_mode(self.model)
        return self._fake


def _planned_model(name, seq_len: int, untie: bool, balance, lora_r, targets, seed) -> Tuple[Any, str, Optional[list]]:
    """(the model on meta as pipedp train builds it, its name, the block costs to split by: with LoRA, the
    base model's by ``balance``, since training splits where the stage loader split the base model)."""
    if name == TINY_GPT:
        with torch.device("meta"):
            model = tiny_gpt(GPTConfig(vocab_size=256, seq_len=seq_len, **TINY_GPT_SHAPE))
        label = "tiny-gpt"
    else:
        if isinstance(name, str) and not os.path.isdir(name):
            raise FileNotFoundError(f"model folder {name!r} does not exist")
        model = build_on_meta(name)
        label = f"{os.path.basename(os.path.normpath(name)) if isinstance(name, str) else ''} ({type(model).__name__})"
        label = label.strip()
    if lora_r is None:
        return model, label, None

    costs = block_costs(model_blocks(model, untie), balance)
    return with_lora(model, lora_r, targets, seed), label, costs


def _held_between_i_and_w(actions) -> int:
    """The most micro-batches of this stage's action list between their I and their W."""
    held = peak = 0
    for a in actions:
        if a.kind is Kind.I:
            held += 1
            peak = max(peak, held)
        elif a.kind is Kind.W:
            held -= 1
    return peak


def _params(blocks):
    for b in blocks:
        yield from b.module.parameters()


def _block_names(blocks) -> str:
    """'model.layers.0-15' style: the blocks' names (layer indices folded into a range)."""
    names: List[str] = []
    for b in blocks:
        module = b.module
        index = getattr(module, "index", None)
        kind = type(module).__name__
        if kind == "HFEmbeddings":
            names.append("embeddings")
        elif kind == "HFHead":
            names.append("head")
        elif index is not None:
            names.append(f"layer {index}")
        else:
            names.append(b.name or kind)
    layers = [n for n in names if n.startswith("layer ")]
    if len(layers) > 2:
        first, last = layers[0].split()[1], layers[-1].split()[1]
        out = [n for n in names if not n.startswith("layer ")]
        position = names.index(layers[0])
        out.insert(min(position, len(out)), f"layers {first}-{last}")
        return ", ".join(out)
    return ", ".join(names)


def _count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return str(n)


def _refuse_experts(model, name: str) -> None:
    """A mixture of experts routes by value, so the shapes of its experts' products are not known on fake
    tensors (transformers' eager loop asks which experts a token went to, its grouped kernel wants bf16)."""
    found = moe_parts(model)
    if found:
        raise PipeDPError(
            f"pipedp plan does not simulate mixtures of experts yet: {name}'s {found[0][0]} "
            f"({type(found[0][1]).__name__}) routes each token by its values, which fake tensors do not have; "
            "train a few steps with pipedp train and read the peak memory it reports"
        )


def largest_fit(fits: Callable[[int], bool], limit: int = 1 << 20) -> int:
    """The largest B in 1..limit with ``fits(B)`` (0 if none), for ``fits`` true up to some B and false after
    (memory grows with the micro-batch size)."""
    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and fits(hi):
        lo, hi = hi, 2 * hi
    hi = min(hi, limit + 1)
    while hi - lo > 1:  # fits(lo), not fits(hi) (or hi past the limit)
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo
