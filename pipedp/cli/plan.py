"""``pipedp plan``: each stage's predicted peak memory, and the largest micro-batch size that fits.

The model is built on the meta device from its folder's config.json (no weight is read: seconds even for
7B), LoRA applied on meta as ``pipedp train`` applies it, and split by pipedp's own adapter and partition.
The static parts (weights, clipped sums, optimizer state) are counted from the stages' tensors
(pipedp/split/plan.py). The activations are simulated: a pass of two micro-batches runs through every stage
with pipedp's own Stage and Executor on fake tensors (torch's FakeTensorMode on the CPU: shapes, dtypes,
autocast and kernel choices as on the CPU, no memory, no arithmetic), while a MemoryTracker counts every
storage each stage's operations create and free: autograd's saved tensors, the captures, output-gradients
and per-sample gradients, Gram matrices, messages (held until their peer releases them, as the
distributed transport holds them), the clipped sums. What each action of a micro-batch does to its stage's
bytes (what it leaves held, its peak above the level before it) is then composed along the schedule's own
action order into each stage's peak (pipedp.split.plan.compose): the first micro-batch (it makes the
clipped sums) and the later ones each as simulated. With the self-check on (the default), one self-checked
micro-batch is simulated too: the first step's first micro-batch.

``estimate(...)`` is the Python entry point (the simulation needs the runtime, so it lives here, above it);
``add_plan_flags`` and ``run`` are the subcommand. Parsing imports no torch.
"""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import replace
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..config import OptimizerConfig, PipelineConfig, PrivacyConfig
from .flags import add_config_flags

PLAN_SKIP = ("microbatch_size", "timeout", "transport", "device")  # (timeout, transport: no flags)
OPTIMIZER_FLAGS = ("optimizer", "momentum", "weight_decay")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


_UNITS = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}


def parse_bytes(text: str) -> int:
    """'80GB' / '80G' (10^9 bytes), '80GiB' (2^30), '1.5TB', '24000000000' -> bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:E[0-9]+)?)\s*([KMGT]I?)?B?\s*", text.upper())
    value = float(match.group(1)) * _UNITS[match.group(2) or ""] if match else 0.0
    if not (value >= 1 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"cannot read {text!r} as a memory size: use e.g. 80GB, 80GiB or 24000000000")
    return int(value)


def add_plan_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", required=True, help="a local Hugging Face model folder (config.json is enough), or tiny-gpt"
    )
    p.add_argument("--microbatch-size", type=_positive_int, required=True, help="rows per micro-batch (B)")
    p.add_argument("--seq-len", type=_positive_int, required=True, help="tokens per row (T)")
    p.add_argument("--lora-r", type=_positive_int, default=None, help="plan PEFT LoRA adapters of this rank")
    p.add_argument("--lora-targets", default="q_proj,v_proj", help="comma-separated module names LoRA adapts")
    p.add_argument(
        "--device-memory",
        type=parse_bytes,
        default=None,
        help="memory per stage (e.g. 80GB, 80GiB): also search the largest micro-batch size that fits on every stage",
    )
    p.add_argument("--json", default=None, help="also write the whole plan here")
    p.add_argument("--seed", type=int, default=0, help="LoRA's initialisation seed (as pipedp train's --seed)")
    pipeline = p.add_argument_group("pipeline options (as pipedp train's)")
    add_config_flags(p, (PipelineConfig,), skip=PLAN_SKIP, groups={PipelineConfig: pipeline})
    optim = p.add_argument_group("optimizer options (as pipedp train's)")
    skip = [f for f in OptimizerConfig.__dataclass_fields__ if f not in OPTIMIZER_FLAGS]
    add_config_flags(p, (OptimizerConfig,), skip=skip, groups={OptimizerConfig: optim})


def run(args) -> int:
    import json

    from ..split.plan import format_plan
    from .flags import config_from_args

    pipeline = config_from_args(PipelineConfig, args).validate()
    optim = config_from_args(OptimizerConfig, args).validate()
    plan = estimate(
        args.model,
        pipeline.stages,
        args.microbatch_size,
        args.seq_len,
        lora_r=args.lora_r,
        lora_targets=tuple(t.strip() for t in args.lora_targets.split(",") if t.strip()),
        pipeline=pipeline,
        optimizer=optim.optimizer,
        momentum=optim.momentum,
        weight_decay=optim.weight_decay,
        device_memory=args.device_memory,
        seed=args.seed,
    )
    print(format_plan(plan))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(plan.as_dict(), f, indent=1)
    return 0


# ---- the estimate ------------------------------------------------------------------------------------
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
    """The plan (pipedp.split.plan.Plan) of training ``model`` — a Hugging Face folder, a transformers config,
    or "tiny-gpt" — on ``stages`` stages with micro-batches of ``microbatch_size`` rows of ``seq_len`` tokens.
    ``pipeline`` gives the schedule, micro-batches, grad mode, precision, checkpointing, balance (its
    ``stages`` is replaced by ``stages``)."""
    import warnings

    from ..split.plan import Plan

    pipeline = replace(pipeline or PipelineConfig(), stages=stages).validate()
    privacy = privacy or PrivacyConfig()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        setup = _Setup(
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
    from ..split.plan import format_bytes, largest_fit

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


class _Setup:
    """The model on meta, split and prepared as the trainer prepares it, and its fake twin for the passes."""

    def __init__(self, name, pipeline, privacy, seq_len, lora_r, targets, seed, optimizer, momentum, weight_decay=0.0):
        from ..models import token_loss
        from ..split.plan import static_bytes
        from ..train.prepare import prepare, vocab_parallel

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
            from ..parallel.layers import Group
            from ..parallel.plan import split_stage

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
        import schedules
        from schedules import Kind

        from ..split.plan import StagePlan, compose

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
    def simulate(self, b: int, probe: bool, microbatches: int):
        """[[Profile per micro-batch] per stage]: a pass of ``microbatches`` micro-batches of ``b`` rows (all
        forwards, then all backwards: each action of a micro-batch does the same whatever the schedule) on
        fake tensors, each action's bytes counted; ``probe``: micro-batch 0 self-checked."""
        import torch

        import schedules

        from ..errors import PipeDPError
        from ..runtime.executor import Executor
        from ..runtime.inprocess_transport import InProcessHub
        from ..runtime.microbatch import PassBatch
        from ..runtime.self_check import Probe
        from ..runtime.stage import Stage
        from ..runtime.tie import TieRole
        from ..split.plan import MemoryTracker, Profile

        fake = self._fake_mode()
        p = self.pipeline.stages
        options = replace(self.options, self_check=False)  # the probe is set below, as StageCheck.plan would set it
        schedule = schedules.build("gpipe", p, microbatches)
        rows = b * self.options.units.rows
        batch = PassBatch(
            [self._inputs(rows) for _ in range(microbatches)],
            [torch.zeros(rows, self.seq_len, dtype=torch.long) for _ in range(microbatches)],
            [torch.ones(rows) for _ in range(microbatches)],
        )
        tracker = MemoryTracker(p)
        found: List[List[dict]] = [[{"actions": {}, "kept": 0} for _ in range(microbatches)] for _ in range(p)]
        built: List[Any] = []
        with fake, tracker:
            try:
                hub = InProcessHub(p)
                for s, blocks in enumerate(self.stage_blocks):
                    role = TieRole.for_stage(s, p, self.tie, False)
                    built.append(Stage(s, p, blocks, self.loss, options, role, self.parts[s]))
                executors = []
                for s, stage in enumerate(built):
                    e = Executor(stage, _HeldTransport(hub.transport(s)), schedule.for_stage(s))
                    _tag(e, tracker, s, found[s])
                    executors.append(e)
                for e in executors:
                    e.start_pass(batch)
                    if probe:
                        assert e.state is not None
                        e.state.probe = Probe(tuple(range(self.options.units.count(rows))))  # every unit
                try:
                    _drive(executors, tracker)
                except PipeDPError:
                    raise
                except Exception as exc:  # an operation fake tensors cannot run: say so, not a traceback
                    raise PipeDPError(
                        f"pipedp plan could not simulate {self.name} on fake tensors ({type(exc).__name__}: "
                        f"{str(exc).splitlines()[0][:300] if str(exc) else ''}); the static parts of the plan "
                        "(weights, clipped sums, optimizer state) need no simulation, but its activations do"
                    ) from exc
                hub.end_pass()
                if not probe:
                    self._ways = [dict(_counts(stage.ways.values())) for stage in built]
            finally:
                for stage in built:
                    stage.reset()
                    stage.close()
        out = []
        for s in range(p):
            profiles = []
            for mb in found[s]:
                acts = mb["actions"]
                held = acts.get("RECV_F", (0, 0))[0] + acts.get("F", (0, 0))[0]
                profiles.append(Profile(acts, held, mb["kept"]))
            out.append(profiles)
        return out

    def _inputs(self, rows: int):
        import torch

        ids = torch.zeros(rows, self.seq_len, dtype=torch.long)
        if not self.hf:
            return ids
        return {"input_ids": ids, "attention_mask": torch.ones(rows, self.seq_len, dtype=torch.long)}

    def _fake_mode(self):
        """The model's parameters and meta buffers replaced by fake CPU tensors (once)."""
        if self._fake is None:
            from torch._subclasses.fake_tensor import FakeTensorMode

            self._fake = FakeTensorMode(allow_non_fake_inputs=True)
            _to_fake(self.model, self._fake)
        return self._fake


def _planned_model(name, seq_len: int, untie: bool, balance, lora_r, targets, seed) -> Tuple[Any, str, Optional[list]]:
    """(the model on meta as pipedp train builds it, its name, the block costs to split by: with LoRA, the
    base model's by ``balance``, since training splits where the stage loader split the base model)."""
    import os

    import torch

    from ..split.adapters import model_blocks
    from ..split.partition import block_costs
    from .spec import TINY_GPT, TINY_GPT_SHAPE

    if name == TINY_GPT:
        from ..models import GPTConfig, tiny_gpt

        with torch.device("meta"):
            model = tiny_gpt(GPTConfig(vocab_size=256, seq_len=seq_len, **TINY_GPT_SHAPE))
        label = "tiny-gpt"
    else:
        from ..split.hf_loading import build_on_meta

        if isinstance(name, str) and not os.path.isdir(name):
            raise FileNotFoundError(f"model folder {name!r} does not exist")
        model = build_on_meta(name)
        label = f"{os.path.basename(os.path.normpath(name)) if isinstance(name, str) else ''} ({type(model).__name__})"
        label = label.strip()
    if lora_r is None:
        return model, label, None
    from .build import with_lora

    costs = block_costs(model_blocks(model, untie), balance)
    return with_lora(model, lora_r, targets, seed), label, costs


def _to_fake(model, mode) -> None:
    import torch
    import torch.nn as nn

    converter = mode.fake_tensor_converter
    cpu = torch.device("cpu")
    done: Dict[int, Any] = {}

    def fake(t):
        meta = t if t.is_meta else t.to("meta")
        return converter.from_meta_and_device(mode, meta, cpu)

    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            if id(p) not in done:
                done[id(p)] = nn.Parameter(fake(p.data), requires_grad=p.requires_grad)
            module._parameters[name] = done[id(p)]
        for name, t in list(module._buffers.items()):
            if t is not None and t.is_meta:
                if id(t) not in done:
                    done[id(t)] = fake(t)
                module._buffers[name] = done[id(t)]


class _HeldTransport:
    """The in-process transport, with the distributed transport's memory: a sent message is held (a joined
    copy after the pass's first micro-batch) until its peer has received it (release), and a received one
    is a new buffer of the receiver's."""

    def __init__(self, inner):
        self.inner = inner
        self.held: Dict[tuple, list] = {}

    def send(self, kind, mb, message) -> None:
        from ..runtime.microbatch import tensors_of

        tensors = [t.detach().contiguous() for t in tensors_of(message)]
        kept = tensors if mb == 0 else [t.clone() for t in tensors]
        self.held.setdefault((_channel(kind), mb), []).extend(kept)
        self.inner.send(kind, mb, message)

    def recv(self, kind, mb):
        message = self.inner.recv(kind, mb)
        if isinstance(message, tuple):
            return tuple(t.clone() for t in message)
        return message.clone()

    def norm_reduce_start(self, mb, squared_norms):
        return self.inner.norm_reduce_start(mb, squared_norms)

    def send_aborted(self, kind, mb) -> None:
        self.inner.send_aborted(kind, mb)

    def release(self, kind, mb) -> None:
        self.held.pop((_channel(kind), mb), None)

    def finish_pass(self) -> None:
        self.held = {}
        self.inner.finish_pass()


def _channel(kind) -> str:
    return "F" if kind.value.endswith("_F") else "B"


def _tag(executor, tracker, stage: int, found: List[dict]) -> None:
    """Wrap the executor's handlers: each action's allocations carry its name, and its bytes are recorded
    (what it leaves held, its peak above the level before it); I's kept per-sample gradients too."""
    from schedules import Kind

    from ..split.plan import storage_bytes

    def wrap(kind, handler):
        def tagged(mb: int) -> None:
            tracker.phase = kind.value
            before = tracker.current[stage]
            tracker.peak[stage] = before
            handler(mb)
            found[mb]["actions"][kind.value] = (tracker.current[stage] - before, tracker.peak[stage] - before)
            if kind is Kind.I:
                state = executor.stage.pending.get(mb)
                if state is not None and state.kept:
                    kept = storage_bytes(g for grads in state.kept.values() for g in grads.values())
                    found[mb]["kept"] = kept

        return tagged

    for kind, handler in list(executor.handlers.items()):
        executor.handlers[kind] = wrap(kind, handler)


def _drive(executors, tracker) -> None:
    """run_in_process, with the tracker told which stage runs."""
    while True:
        before = [e.position for e in executors]
        finished = []
        for s, e in enumerate(executors):
            tracker.stage = s
            finished.append(e.run())
        if all(finished):
            return
        if [e.position for e in executors] == before:
            raise RuntimeError("the planned pipeline deadlocked")


def _held_between_i_and_w(actions) -> int:
    """The most micro-batches of this stage's action list between their I and their W."""
    from schedules import Kind

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


def _counts(values) -> Dict[str, int]:
    out: Dict[str, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return out


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
    from ..errors import PipeDPError
    from ..split.hf_experts import moe_parts

    found = moe_parts(model)
    if found:
        raise PipeDPError(
            f"pipedp plan does not simulate mixtures of experts yet: {name}'s {found[0][0]} "
            f"({type(found[0][1]).__name__}) routes each token by its values, which fake tensors do not have; "
            "train a few steps with pipedp train and read the peak memory it reports"
        )
