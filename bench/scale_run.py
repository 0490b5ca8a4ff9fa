"""One bench.scale run: DP fine-tuning of a folder, one process per stage (``pipedp.launch``, 1 thread each);
each calls ``load_pipeline_stage`` (only its own tensors are read), adds LoRA (PEFT, r=8, alpha 16, q_proj and
v_proj; precision "bf16-mixed": the base stays bf16, the adapters and their AdamW state float32) or trains every
weight (precision "bf16-true": weights and AdamW state bf16), tokenises the corpus with the folder's tokenizer,
takes ``steps`` DP steps and saves a checkpoint (``trainer.save_checkpoint``).

Memory, per rank, from the kernel's peak RSS mark (VmHWM), reset at each phase (load, trainer build,
first step, later steps, save), so the whole run's peak is the largest phase peak. It is compared with
what the stage must hold, above the process's RSS before loading (Python, torch, transformers):
- its weights (every parameter with memory, as loaded),
- its optimizer state (bytes of the AdamW state tensors after the steps),
- one float32 clipped-sum buffer (4 bytes per trainable parameter),
- the in-flight activations: the bytes autograd saves for one micro-batch's plain forward of the stage
  (saved-tensor hooks, parameters excluded; the last stage with its loss), times the micro-batches 1F1B
  keeps in flight on the stage (min(m, stages - stage)).
The save's own cost is the peak increment during ``save_checkpoint`` (the mark reset before it).

Beside it (unless ``baseline=False``): non-private training of the same stages, split and batch under
torch's ``Schedule1F1B`` (GPipe where m < stages), in the same processes before the DP run; its peak above
the base and its step time. And the balance: the partition report's predicted imbalance (slowest / mean
stage cost, ``balance``, default the trainer's ``compute``) beside the measured one (each stage's
main-thread CPU time per later step). ``activation_checkpointing`` turns the trainer's option on.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import time
from typing import Dict, List, Optional

import torch

from .memory import reset_peak, status_kib
from .scale_folder import corpus_rows


# ---- one rank of a run -----------------------------------------------------------------------------------
class _Marks:
    """Peak RSS per phase: the kernel's mark read, then reset, at each phase's end."""

    def __init__(self):
        self.base = self._reset()
        self.phases: Dict[str, float] = {}

    @staticmethod
    def _reset() -> float:
        return reset_peak() / 1024.0

    def end(self, phase: str) -> float:
        """This phase's peak RSS (MiB, absolute), then the mark reset; returns the RSS after the reset."""
        self.phases[phase] = status_kib("VmHWM") / 1024.0
        return self._reset()


def _activation_bytes(stage_blocks, x, y, last: bool, autocast: bool, loss_fn) -> int:
    """Bytes autograd saves for one micro-batch's plain forward through these blocks (parameters and
    their views excluded)."""
    params = set()
    for b in stage_blocks:
        for p in b.module.parameters():
            if not p.is_meta:
                params.add(p.untyped_storage().data_ptr())
    seen: Dict[int, int] = {}

    def pack(t):
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            ptr = t.untyped_storage().data_ptr()
            if ptr not in params:
                seen[ptr] = max(seen.get(ptr, 0), t.untyped_storage().nbytes())
        return t

    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else torch.autocast("cpu", enabled=False)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), ctx:
        h = x
        for b in stage_blocks:
            h = b.module(h)
        if last:
            h = loss_fn(h.float(), y).sum()
    del h
    return sum(seen.values())


class _Autocast(torch.nn.Module):
    """A stage's blocks under bf16 autocast (bf16-mixed) for torch's pipelining, which has no precision option."""

    def __init__(self, blocks, autocast: bool):
        super().__init__()
        self.blocks = torch.nn.Sequential(*blocks)
        self.autocast = autocast

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
            out = self.blocks(x)
        return out.float() if self.autocast and out.is_floating_point() else out


def _plain_steps(stage_blocks, rank: int, stages: int, x, y, m: int, autocast: bool, steps: int, marks) -> List[float]:
    """Non-private training of the same stage, split and batch under torch's Schedule1F1B (per-token mean
    cross-entropy, fused AdamW): its step times; its memory is the phase ``marks`` records. Its optimizer
    state and gradients are freed before returning (the DP run starts from the same state)."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    module = _Autocast([b.module for b in stage_blocks], autocast)
    stage = PipelineStage(module, rank, stages, torch.device("cpu"))

    def mean_loss(out, target):
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))

    # torch's 1F1B refuses m < stages; there 1F1B runs every forward before the first backward anyway, as GPipe
    kind = Schedule1F1B if m >= stages else ScheduleGPipe
    schedule = kind(stage, n_microbatches=m, loss_fn=mean_loss)
    trainable = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-4, fused=True) if trainable else None
    times = []
    for _ in range(steps):
        dist.barrier()
        t = time.perf_counter()
        if rank == 0:
            schedule.step(x)
        elif rank == stages - 1:
            schedule.step(target=y)
        else:
            schedule.step()
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)
        dist.barrier()
        times.append(time.perf_counter() - t)
    marks.end("plain 1F1B steps")
    for p in trainable:
        p.grad = None
    del opt, schedule, stage, module
    return times


def preimport() -> None:
    """Every library the run uses, imported before the base RSS is taken (their code is not the stage's)."""
    import peft  # noqa: F401
    import safetensors.torch  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401
    import transformers.models.mistral.modeling_mistral  # noqa: F401

    import pipedp.train.checkpoint  # noqa: F401
    import pipedp.train.trainer  # noqa: F401


def _run_rank(rank: int, folder: str, args: Dict) -> Dict:
    import warnings

    import torch.distributed as dist

    from pipedp import PipelineDPTrainer, settle_process
    from pipedp.models import token_loss
    from pipedp.split.adapters import model_blocks
    from pipedp.split.hf_loading import load_pipeline_stage, resident_parameter_bytes
    from pipedp.split.partition import block_costs, partition
    from pipedp.train.prepare import apply_precision

    warnings.filterwarnings("ignore")
    preimport()
    stages, m, lora = args["stages"], args["microbatches"], args["mode"] == "lora"
    marks = _Marks()
    t0 = time.perf_counter()
    model = load_pipeline_stage(folder, stages, rank, balance=args["balance"])
    load_s = time.perf_counter() - t0
    marks.end("load")
    weights = resident_parameter_bytes(model)
    hidden = model.config.hidden_size
    blocks = model_blocks(model)
    costs = block_costs(blocks, args["balance"])
    mine = partition(blocks, stages, costs)[rank]
    if lora:
        from peft import LoraConfig, get_peft_model

        for p in model.parameters():
            p.requires_grad_(False)
        torch.manual_seed(0)
        model = get_peft_model(
            model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
        )
        weights = resident_parameter_bytes(model)  # with the adapters
        mine = partition(model_blocks(model), stages, costs)[rank]
    marks.end("blocks + adapters")  # pipedp's model_blocks (a stand-in layer for HF models) and PEFT
    x, y = corpus_rows(folder, args["batch"], args["seq"])
    size = args["batch"] // m
    sample = x[:size] if rank == 0 else torch.randn(size, args["seq"], hidden, dtype=torch.bfloat16, requires_grad=True)
    act = _activation_bytes(mine, sample, y[:size], rank == stages - 1, lora, token_loss)
    in_flight = min(m, stages - rank)
    marks.end("activation probe")
    plain_s: List[float] = []
    if args["baseline"]:
        if lora:  # bf16-mixed as the trainer applies it: float32 trainable parameters
            apply_precision(model, "bf16-mixed")
        plain_s = _plain_steps(mine, rank, stages, x, y, m, lora, args["steps"], marks)
    t0 = time.perf_counter()
    trainer = PipelineDPTrainer(
        model,
        token_loss,
        lambda params: torch.optim.AdamW(params, lr=1e-4, fused=True),  # no temporaries (train/narrowing.py)
        stages=stages,
        microbatches=m,
        schedule=args["schedule"],
        grad_mode=args["grad_mode"],
        precision="bf16-mixed" if lora else "bf16-true",
        self_check=args["self_check"],
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        expected_batch_size=args["batch"],
        sample_rate=0.01,
        sampling="poisson",
        balance=costs,
        activation_checkpointing=args["activation_checkpointing"],
    )
    settle_process()
    build_s = time.perf_counter() - t0
    marks.end("trainer build")
    params = [p for stage in trainer.runtime.local_stages for p in stage.parameters]
    trainable_numel = sum(p.numel() for p in params)
    trainable_bytes = sum(p.numel() * p.element_size() for p in params)
    times, busy = [], []
    for i in range(args["steps"]):
        dist.barrier()
        t, c = time.perf_counter(), time.thread_time()
        trainer.step(x, y)
        busy.append(time.thread_time() - c)  # this thread's CPU time: the stage's work, not its waits
        dist.barrier()
        times.append(time.perf_counter() - t)
        if i == 0:
            marks.end("first step")
    marks.end("later steps")
    opt_bytes = 0
    for opt in trainer.state.optimizers:
        if opt is not None:
            for state in opt.state.values():
                opt_bytes += sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))
    before_save = status_kib("VmRSS") / 1024.0
    t = time.perf_counter()
    trainer.save_checkpoint(args["checkpoint"])
    save_s = time.perf_counter() - t
    marks.end("save")
    dist.barrier()
    written = 0
    if rank == 0:
        for root, _, files in os.walk(args["checkpoint"]):
            written += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    must = {
        "weights": weights,
        "optimizer state": opt_bytes,
        "float32 clipped sum": 4 * trainable_numel,
        "activations in flight": act * in_flight,
    }
    trainer.close()
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    mib = 1 / 2**20
    peak = max(v for k, v in marks.phases.items() if k not in NOT_DP)  # the probe and the baseline: not pipedp's
    return {
        "rank": rank,
        "base_rss_mib": marks.base,
        "phase_peak_mib": marks.phases,
        "peak_mib": peak,
        "peak_above_base_mib": peak - marks.base,
        "must_hold_mib": {k: v * mib for k, v in must.items()},
        "must_hold_total_mib": sum(must.values()) * mib,
        "activation_mib_per_microbatch": act * mib,
        "in_flight": in_flight,
        "trainable_mib": trainable_bytes * mib,
        "trainable_params": trainable_numel,
        "save_increase_mib": marks.phases["save"] - before_save,
        "checkpoint_mib": written * mib,
        "step_s": times,
        "busy_s": busy,
        "plain_step_s": plain_s,
        "predicted_costs": list(trainer.partition_report.stage_costs),
        "load_s": load_s,
        "build_s": build_s,
        "save_s": save_s,
        "user_s": usage.ru_utime,
        "sys_s": usage.ru_stime,
        "minor_faults": usage.ru_minflt,
    }


def run(
    folder: str,
    mode: str,
    stages: int = 2,
    steps: int = 3,
    batch: int = 4,
    microbatches: int = 2,
    seq: int = 32,
    schedule: str = "1f1b",
    grad_mode: str = "ghost",
    self_check: bool = True,
    checkpoint: Optional[str] = None,
    activation_checkpointing: bool = False,
    balance: str = "compute",
    baseline: bool = True,
) -> Dict:
    from pipedp.runtime.launch import launch

    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    ckpt = checkpoint or os.path.join(os.path.dirname(os.path.abspath(folder)), f"ckpt-{os.getpid()}")
    args = dict(
        mode=mode,
        stages=stages,
        steps=steps,
        batch=batch,
        microbatches=microbatches,
        seq=seq,
        schedule=schedule,
        grad_mode=grad_mode,
        self_check=self_check,
        checkpoint=ckpt,
        activation_checkpointing=activation_checkpointing,
        balance=balance,
        baseline=baseline,
    )
    start = time.perf_counter()
    try:
        ranks = launch(_run_rank, stages, (folder, args), timeout_s=7200, threads=1, op_timeout_s=3600)
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)
    return {
        "folder": folder,
        "layers": cfg["num_hidden_layers"],
        "hidden": cfg["hidden_size"],
        "vocab": cfg["vocab_size"],
        "args": args,
        "ranks": ranks,
        "seconds": time.perf_counter() - start,
    }


TRAINING_PHASES = ("first step", "later steps", "save")
NOT_DP = ("activation probe", "plain 1F1B steps")  # this bench's own phases


def summary_row(name: str, folder_bytes: int, r: Dict) -> Dict:
    a = r["args"]
    ranks = r["ranks"]

    def above(x, phases):
        return max(v for k, v in x["phase_peak_mib"].items() if k in phases) - x["base_rss_mib"]

    def whole(x):  # every phase but this bench's own
        return above(x, [k for k in x["phase_peak_mib"] if k not in NOT_DP])

    plain = [above(x, ("plain 1F1B steps",)) if "plain 1F1B steps" in x["phase_peak_mib"] else None for x in ranks]
    plain_s = ranks[0].get("plain_step_s") or []

    steady = ranks[0]["step_s"][1:] or ranks[0]["step_s"]
    busy = [statistics.median(x["busy_s"][1:] or x["busy_s"]) for x in ranks]  # later steps: no self-check
    costs = ranks[0]["predicted_costs"]
    return {
        "model": f"{name}, {r['layers']} layers",
        "folder_gib": folder_bytes / 2**30,
        "mode": a["mode"],
        "stages": a["stages"],
        "self_check": a["self_check"],
        "activation_checkpointing": a.get("activation_checkpointing", False),
        "batch": f"{a['batch']} x T={a['seq']}, m={a['microbatches']}",
        "must_hold_mib": [x["must_hold_total_mib"] for x in ranks],
        "peak_above_base_mib": [whole(x) for x in ranks],
        "base_mib": [x["base_rss_mib"] for x in ranks],
        "peak_ratio": [whole(x) / x["must_hold_total_mib"] for x in ranks],
        "training_ratio": [above(x, TRAINING_PHASES) / x["must_hold_total_mib"] for x in ranks],
        "steady_ratio": [above(x, ("later steps", "save")) / x["must_hold_total_mib"] for x in ranks],
        "steady_peak_mib": [above(x, ("later steps",)) for x in ranks],
        # non-private torch Schedule1F1B on the same stages and batch (bench's own phase, before the DP run)
        "plain_peak_mib": plain,
        "dp_over_plain_peak": [above(x, ("later steps",)) / p if p else None for x, p in zip(ranks, plain)],
        "plain_step_s": statistics.median(plain_s[1:] or plain_s) if plain_s else None,
        # slowest / mean stage: the partition report's (from its costs) and the stages' CPU time per step
        "predicted_imbalance": max(costs) / statistics.mean(costs) if sum(costs) > 0 else 1.0,
        "measured_imbalance": max(busy) / statistics.mean(busy) if sum(busy) > 0 else 1.0,
        "busy_s": busy,
        "save_ratio": [x["save_increase_mib"] / x["must_hold_mib"]["weights"] for x in ranks],
        "first_step_s": ranks[0]["step_s"][0],
        "step_s": statistics.median(steady),
        "load_s": max(x["load_s"] for x in ranks),
        "build_s": max(x["build_s"] for x in ranks),
        "save_s": max(x["save_s"] for x in ranks),
        "user_s": [x.get("user_s", 0.0) for x in ranks],
        "sys_s": [x.get("sys_s", 0.0) for x in ranks],
        "worst_phase": [
            max((k for k in x["phase_peak_mib"] if k not in NOT_DP), key=x["phase_peak_mib"].get) for x in ranks
        ],
    }


def _per_rank(values, fmt: str, goal: Optional[float] = None) -> str:
    text = " / ".join(fmt.format(v) for v in values)
    if goal is None:
        return text
    return text + (" (met)" if all(v <= goal for v in values) else " (**missed**)")


def _imbalance(r: Dict) -> str:
    if "measured_imbalance" not in r:
        return ""
    predicted, measured = r["predicted_imbalance"], r["measured_imbalance"]
    met = abs(predicted / measured - 1) <= 0.10
    return f"{predicted:.2f} / {measured:.2f}" + (" (met)" if met else " (**missed**)")


def markdown_rows(rows: List[Dict]) -> List[str]:
    out = [
        "| model | folder | mode | stages | self-check | activation checkpointing | batch | must hold, MiB per "
        "rank | whole run: peak above base, MiB | whole run / must hold (goal <= 1.15) | steps + save / must hold "
        "| later steps + save / must hold | later steps: peak above base, MiB | save adds (of stage weights, goal "
        "<= 5%) | non-private torch 1F1B: peak above base, MiB | DP later steps / non-private peak | first step s "
        "| step s | non-private step s | stage CPU s per step | imbalance predicted / measured (goal: within 10%) "
        "| load s | build s | save s | cpu user / sys s (rank 0) | phase of the peak |",
        "|---" * 26 + "|",
    ]
    for r in rows:
        out.append(
            f"| {r['model']} | {r['folder_gib']:.1f} GiB | {r['mode']} | {r['stages']} | "
            f"{'on' if r['self_check'] else 'off'} | {'on' if r.get('activation_checkpointing') else 'off'} | "
            f"{r['batch']} | "
            + " | ".join(
                [
                    _per_rank(r["must_hold_mib"], "{:.0f}"),
                    _per_rank(r["peak_above_base_mib"], "{:.0f}"),
                    _per_rank(r["peak_ratio"], "{:.2f}", 1.15),
                    _per_rank(r["training_ratio"], "{:.2f}"),
                    _per_rank(r["steady_ratio"], "{:.2f}"),
                    _per_rank(r.get("steady_peak_mib", []), "{:.0f}"),
                    _per_rank([100 * v for v in r["save_ratio"]], "{:.1f}%", 5.0),
                    _per_rank([v for v in r.get("plain_peak_mib") or [] if v is not None], "{:.0f}"),
                    _per_rank([v for v in r.get("dp_over_plain_peak") or [] if v is not None], "{:.2f}"),
                ]
            )
            + f" | {r['first_step_s']:.1f} | {r['step_s']:.1f} | "
            + (f"{r['plain_step_s']:.1f}" if r.get("plain_step_s") else "")
            + f" | {_per_rank(r.get('busy_s', []), '{:.2f}')} | "
            + _imbalance(r)
            + f" | {r['load_s']:.0f} | {r['build_s']:.0f} | "
            f"{r['save_s']:.1f} | {r['user_s'][0]:.0f} / {r['sys_s'][0]:.0f} | " + " / ".join(r["worst_phase"]) + " |"
        )
    return out


def breakdown(name: str, r: Dict) -> List[str]:
    """Per rank: what the stage must hold, and each phase's peak above the base."""
    lines = [f"`{name}`, {r['layers']} layers, {r['args']['mode']}, {r['args']['stages']} stages:", ""]
    lines.append(
        "| rank | base RSS | weights | optimizer | fp32 clipped sum | activations (per mb x in flight) | "
        + " | ".join(r["ranks"][0]["phase_peak_mib"])
        + " | checkpoint written |"
    )
    lines.append("|---" * (7 + len(r["ranks"][0]["phase_peak_mib"])) + "|")
    for x in r["ranks"]:
        h = x["must_hold_mib"]
        lines.append(
            f"| {x['rank']} | {x['base_rss_mib']:.0f} | {h['weights']:.0f} | {h['optimizer state']:.0f} | "
            f"{h['float32 clipped sum']:.0f} | {x['activation_mib_per_microbatch']:.0f} x {x['in_flight']} | "
            + " | ".join(f"{v - x['base_rss_mib']:.0f}" for v in x["phase_peak_mib"].values())
            + f" | {x['checkpoint_mib']:.0f} |"
        )
    return lines + [""]
