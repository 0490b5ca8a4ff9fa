"""One prepared command for a machine with a GPU: parity on CUDA, processes over NCCL, a stalled rank, memory.

    python -m bench.gpu_check                 # at most ~6 minutes on one GPU; no network
    python -m bench.gpu_check --budget-s 120  # a tighter budget: later sections are skipped, and say so
    python -m bench.gpu_check --device cpu --quick   # the same code paths on the CPU (gloo; a self-test)

Without CUDA (and without --device) it prints that it skipped and exits 0. With CUDA:

1. Parity, float64, on cuda:0: one pipedp step (noise 0, in one process) against a loop of batch-size-1
   backward passes on the same device (each sample's gradient alone, clipped as Opacus clips:
   min(1, C / (||g|| + 1e-6)), summed). The clipped sum pipedp hands the optimizer (recorded by an
   optimizer that only records p.grad, times expected_batch_size) must equal the loop's to 1e-9 of its
   largest coordinate. A small GPT (pipedp.models) and a small HF Llama; 1-3 stages; ghost, materialize
   and keep; 1f1b and dp-zb; a batch that does not divide into the micro-batches.
2. Parity, bf16, on cuda:0: precision "bf16-mixed" (float32 weights, bf16 autocast forward) and "bf16-true"
   (the model in bf16) against the float64 loop on the same weights; bounds 3e-2 (mixed) and 6e-2
   (true) of the largest coordinate (bf16 keeps 8 bits of mantissa; the CPU figures in the README
   are 2.3e-3 and 7.4e-3).
3. Two devices in one process: PipelineConfig(devices=("cuda:0", "cuda:1")) when two GPUs exist, against
   the loop on cuda:0 (float64); skipped with the reason otherwise.
4. Two processes: on one GPU, a 2-stage run over gloo with device "cuda" (both ranks share cuda:0, every tensor
   crossing through pinned host memory: pipedp/wire.py) against the float64 loop; with two GPUs, the same over NCCL (pipedp.runtime.launch, inputs on each rank's device) against
   the float64 loop; with two GPUs, 2 tensor-parallel ranks of the small Llama over NCCL (one DP-SGD step,
   SGD, noise 0; the slices joined by state_dict) against the loop's step (float64, 1e-9; on the CPU with
   --tensor-parallel).
5. A stalled rank under NCCL (two GPUs; rank 1 stops answering after building its trainer): rank 0's step
   must end in pipedp's named error ("stopped answering") within the 10 s timeout (plus the start).
6. Peak GPU memory of one stage (torch.cuda.max_memory_allocated over the first step and two more, the
   model's weights included) against the planner's tensor bytes (0.8-1.25), and the planner's GPU estimate
   (context, allocator slack, NCCL: planner/report.py's constants) beside the allocator's reserved peak.
7. The harness at realistic sizes on one GPU (one process, CUDA-synchronised timing, contenders
   interleaved in rounds as in bench.questions): non-private training of the whole model (on one GPU
   torch's 1F1B of one stage is that), Opacus ghost clipping, pipedp on one stage (ghost, keep), and the
   self-check's first-step cost.
8. What torch.compile gives non-private training of the realistic preset on the GPU (bench.compile_ceiling:
   eager / compiled step time, and the first compile's seconds): what compiling the model's part of a DP step
   could win there (on the CPU, ~1.0x: docs/schedules.md). Not with --quick or on the CPU.

Prints one table (check | device | dtype | result | measured | bound | seconds); exits 1 if any row fails.
With --device cpu the process sections run over gloo (their code path) and the memory row is for
information only (it reads the resident set).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
import traceback
import warnings
from typing import Callable, Dict, List, Optional

import torch
import torch.nn as nn

from . import steps

ROWS: List[Dict] = []


def row(check: str, device: str, dtype: str, result: str, measured: str = "", bound: str = "", seconds: float = 0.0):
    ROWS.append(dict(check=check, device=device, dtype=dtype, result=result, measured=measured, bound=bound, s=seconds))
    print(f"  {result:5s} {check} [{device}, {dtype}] {measured} {bound} ({seconds:.1f} s)", flush=True)


def _budget_spent(deadline: float, check: str, device: str, dtype: str) -> bool:
    """Past the time budget: a skip row for the check, which the caller then leaves out."""
    if time.monotonic() <= deadline:
        return False
    row(check, device, dtype, "skip", "time budget spent")
    return True


def _failed(check: str, device: str, dtype: str, exc: BaseException, start: float) -> None:
    """A FAIL row for a check that raised (its first 120 characters; the traceback printed)."""
    row(check, device, dtype, "FAIL", f"{type(exc).__name__}: {str(exc)[:120]}", "", time.monotonic() - start)
    traceback.print_exc()


class Recorder(torch.optim.SGD):
    """An optimizer that only records the gradient pipedp hands it (a float64 copy), never updating."""

    def __init__(self, params, into: Dict[int, torch.Tensor]):
        super().__init__(params, lr=1.0)
        self.into = into

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.into[id(p)] = p.grad.detach().double().clone()


# ---- models ----------------------------------------------------------------------------------------------
def small_gpt():
    from pipedp.models import GPTConfig, tiny_gpt

    torch.manual_seed(0)
    return tiny_gpt(GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2))


def small_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg)


def _logits(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    return out.logits if hasattr(out, "logits") else out


def loop_clipped_sum(model: nn.Module, loss_fn: Callable, x, y, clip: float) -> Dict[str, torch.Tensor]:
    """sum_i min(1, C / (||g_i|| + 1e-6)) g_i, each g_i from a batch-size-1 backward pass, in float64."""
    params = {k: p for k, p in model.named_parameters() if p.requires_grad}
    total = {k: torch.zeros(p.shape, dtype=torch.float64, device=p.device) for k, p in params.items()}
    for i in range(len(y)):
        model.zero_grad(set_to_none=True)
        loss_fn(_logits(model, x[i : i + 1]), y[i : i + 1]).sum().backward()
        grads = {k: p.grad.double() for k, p in params.items() if p.grad is not None}
        norm = float(torch.sqrt(sum((g**2).sum() for g in grads.values())))
        factor = min(1.0, clip / (norm + 1e-6))
        for k, g in grads.items():
            total[k] += factor * g
    model.zero_grad(set_to_none=True)
    return total


def pipedp_clipped_sum(model: nn.Module, x, y, clip: float, **options) -> Dict[str, torch.Tensor]:
    """The clipped sum of one pipedp step (noise 0): what it hands the optimizer, times the batch size."""
    from pipedp import PipelineDPTrainer
    from pipedp.models import token_loss

    got: Dict[int, torch.Tensor] = {}
    names = {id(p): k for k, p in model.named_parameters()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = PipelineDPTrainer(
            model,
            token_loss,
            lambda params: Recorder(params, got),
            noise_multiplier=0.0,
            max_grad_norm=clip,
            expected_batch_size=len(y),
            transport="inprocess",
            **options,
        )
        trainer.step(x, y)
        trainer.close()
    return {names[i]: g * len(y) for i, g in got.items()}


def relative_error(got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor]) -> float:
    missing = set(want) ^ set(got)
    if missing:
        raise AssertionError(f"parameters differ: {sorted(missing)[:4]}")
    scale = max(float(v.abs().max()) for v in want.values())
    return max(float((got[k].to(want[k].device) - want[k]).abs().max()) for k in want) / max(scale, 1e-300)


def _batch(vocab: int, n: int, seq: int, device):
    g = torch.Generator().manual_seed(1)
    return (
        torch.randint(0, vocab, (n, seq), generator=g).to(device),
        torch.randint(0, vocab, (n, seq), generator=g).to(device),
    )


# ---- 1-3: parity ----------------------------------------------------------------------------------------
def parity(device: str, quick: bool, deadline: float) -> None:
    import copy

    from pipedp.models import token_loss

    models = {"gpt": small_gpt}
    try:
        import transformers  # noqa: F401

        models["llama"] = small_llama
    except ImportError:
        row("parity: HF Llama", device, "float64", "skip", "transformers not installed")
    combos = [
        (stages, mode, schedule)
        for stages in (1, 2, 3)
        for mode in ("ghost", "materialize", "keep")
        for schedule in ("1f1b", "dp-zb")
    ]
    if quick:
        combos = [(2, "ghost", "1f1b"), (3, "keep", "dp-zb")]
    clip = 0.05  # below most per-sample norms: the clipping is exercised
    for name, make in models.items():
        base = make().double().to(device)
        x, y = _batch(64, 7, 16, device)  # 7 rows: micro-batches of unequal size
        want = loop_clipped_sum(copy.deepcopy(base), token_loss, x, y, clip)
        for stages, mode, schedule in combos:
            label = f"parity {name}: {stages} stage(s), {mode}, {schedule}, m=3"
            if _budget_spent(deadline, label, device, "float64"):
                continue
            start = time.monotonic()
            try:
                got = pipedp_clipped_sum(
                    copy.deepcopy(base), x, y, clip, stages=stages, microbatches=3, grad_mode=mode, schedule=schedule
                )
                err = relative_error(got, want)
                row(
                    label,
                    device,
                    "float64",
                    "pass" if err < 1e-9 else "FAIL",
                    f"{err:.1e}",
                    "< 1e-9",
                    time.monotonic() - start,
                )
            except Exception as exc:  # noqa: BLE001 - reported in the table
                row(
                    label,
                    device,
                    "float64",
                    "FAIL",
                    f"{type(exc).__name__}: {str(exc)[:120]}",
                    "",
                    time.monotonic() - start,
                )
                traceback.print_exc()
    # bf16 on the same device: against the float64 loop on the same weights
    for precision, bound in (("bf16-mixed", 3e-2), ("bf16-true", 6e-2)):
        for name, make in models.items():
            label = f"parity {name}: 2 stages, ghost, {precision}"
            if _budget_spent(deadline, label, device, "bf16"):
                continue
            start = time.monotonic()
            try:
                base = make().to(device)
                if precision == "bf16-true":
                    base = base.to(torch.bfloat16)  # the weights the bf16 run trains, also the reference's
                x, y = _batch(64, 6, 16, device)
                want = loop_clipped_sum(copy.deepcopy(base).double(), token_loss, x, y, 0.05)
                got = pipedp_clipped_sum(copy.deepcopy(base), x, y, 0.05, stages=2, microbatches=2, precision=precision)
                err = relative_error(got, want)
                row(
                    label,
                    device,
                    "bf16",
                    "pass" if err < bound else "FAIL",
                    f"{err:.1e}",
                    f"< {bound:.0e}",
                    time.monotonic() - start,
                )
            except Exception as exc:  # noqa: BLE001
                row(
                    label,
                    device,
                    "bf16",
                    "FAIL",
                    f"{type(exc).__name__}: {str(exc)[:120]}",
                    "",
                    time.monotonic() - start,
                )
                traceback.print_exc()


def two_devices(devices: List[str], deadline: float) -> None:
    import copy

    from pipedp import PipelineConfig
    from pipedp.models import token_loss

    label = f"two devices in one process: devices={tuple(devices)}"
    fields = {f.name for f in dataclasses.fields(PipelineConfig)}
    if "devices" not in fields:
        row(label, "+".join(devices), "float64", "skip", "PipelineConfig has no 'devices' field")
        return
    if _budget_spent(deadline, label, "+".join(devices), "float64"):
        return
    for name, make in (("gpt", small_gpt), ("llama", small_llama)):
        start = time.monotonic()
        try:
            base = make().double().to(devices[0])
            x, y = _batch(64, 7, 16, devices[0])
            want = loop_clipped_sum(copy.deepcopy(base), token_loss, x, y, 0.05)
            got = pipedp_clipped_sum(
                copy.deepcopy(base), x, y, 0.05, stages=2, microbatches=3, devices=tuple(devices), grad_mode="ghost"
            )
            err = relative_error(got, want)
            row(
                f"{label}, {name}",
                "+".join(devices),
                "float64",
                "pass" if err < 1e-9 else "FAIL",
                f"{err:.1e}",
                "< 1e-9",
                time.monotonic() - start,
            )
        except ImportError as exc:
            row(f"{label}, {name}", "+".join(devices), "float64", "skip", str(exc)[:120])
        except Exception as exc:  # noqa: BLE001
            row(
                f"{label}, {name}",
                "+".join(devices),
                "float64",
                "FAIL",
                f"{type(exc).__name__}: {str(exc)[:120]}",
                "",
                time.monotonic() - start,
            )
            traceback.print_exc()


# ---- 4-5: processes: 2 on one GPU, NCCL parity, a stalled rank ---------------------------------------------
def _rank_clipped_sum(rank: int, device_type: str, clip: float) -> Dict[str, torch.Tensor]:
    """One rank of a 2-stage run (noise 0): its stage's clipped sum, on the CPU. Module level: spawned."""
    from pipedp import PipelineDPTrainer
    from pipedp.models import token_loss

    base = small_gpt().double()
    got: Dict[int, torch.Tensor] = {}
    names = {id(p): k for k, p in base.named_parameters()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = PipelineDPTrainer(
            base,
            token_loss,
            lambda params: Recorder(params, got),
            noise_multiplier=0.0,
            max_grad_norm=clip,
            expected_batch_size=7,
            stages=2,
            microbatches=3,
            transport="distributed",
            device=device_type,  # "cuda": NCCL's own GPU, or under gloo one the ranks share
        )
        x, y = _batch(64, 7, 16, str(trainer.runtime.device))  # on the rank's device: the batch check reads them there
        trainer.step(x, y)
        trainer.close()
    return {names[i]: (g * len(y)).cpu() for i, g in got.items()}


def _stalling_rank(rank: int, timeout_s: float) -> None:
    """Rank 1 builds its trainer, then stops answering; rank 0's step must fail within the timeout."""
    from pipedp import PipelineDPTrainer
    from pipedp.models import token_loss

    trainer = PipelineDPTrainer(
        small_gpt(),
        token_loss,
        lambda params: torch.optim.SGD(params, lr=0.1),
        noise_multiplier=0.0,
        expected_batch_size=7,
        stages=2,
        microbatches=2,
        timeout=timeout_s,
        transport="distributed",
    )
    if rank == 1:
        time.sleep(20 * timeout_s)
    trainer.step(*_batch(64, 7, 16, "cpu"))


def _rank_tensor_parallel(rank: int, device_type: str, clip: float, lr: float) -> Optional[Dict[str, torch.Tensor]]:
    """One of 2 tensor-parallel ranks of a 1-stage run of the small Llama (noise 0, SGD): the state dict after one
    step on rank 0 (the slices joined), None elsewhere. Module level: spawned."""
    from pipedp import PipelineDPTrainer
    from pipedp.models import token_loss

    device = f"cuda:{torch.cuda.current_device()}" if device_type == "cuda" else "cpu"
    x, y = _batch(64, 6, 16, device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = PipelineDPTrainer(
            small_llama().double(),
            token_loss,
            lambda params: torch.optim.SGD(params, lr=lr),
            noise_multiplier=0.0,
            max_grad_norm=clip,
            expected_batch_size=len(y),
            stages=1,
            tensor_parallel=2,
            microbatches=2,
            transport="distributed",
        )
        trainer.step(x, y)
        state = trainer.state_dict()
        trainer.close()
    return {k: v.cpu() for k, v in state.items()} if rank == 0 else None


def tensor_parallel(device: str, backend: str, where: str, deadline: float) -> None:
    """2 tensor-parallel ranks of the small Llama against the loop oracle's DP-SGD step (float64, noise 0)."""
    import copy

    from pipedp.models import token_loss
    from pipedp.runtime.launch import launch

    label = f"tensor parallel llama: 2 ranks over {backend}, 1 stage"
    if _budget_spent(deadline, label, where, "float64"):
        return
    start, clip, lr = time.monotonic(), 0.05, 0.5
    try:
        got = launch(_rank_tensor_parallel, 2, ("cuda" if device.startswith("cuda") else "cpu", clip, lr), timeout_s=180,
                     backend=backend)[0]  # fmt: skip
        base = small_llama().double().to(device)
        x, y = _batch(64, 6, 16, device)
        total = loop_clipped_sum(copy.deepcopy(base), token_loss, x, y, clip)
        want = {k: (v - lr * total[k] / len(y) if k in total else v).cpu() for k, v in base.state_dict().items()}
        err = relative_error(got, want)
        row(label, where, "float64", "pass" if err < 1e-9 else "FAIL", f"{err:.1e}", "< 1e-9", time.monotonic() - start)
    except Exception as exc:  # noqa: BLE001 - reported in the table
        _failed(label, where, "float64", exc, start)


def two_process_parity(what: str, device: str, where: str, backend: str, deadline: float) -> None:
    """A 2-stage run in 2 processes (ghost, 1f1b, 3 micro-batches, noise 0) against the float64 loop."""
    import copy

    from pipedp.models import token_loss
    from pipedp.runtime.launch import launch

    label = f"parity gpt: {what}, ghost, 1f1b, m=3"
    if _budget_spent(deadline, label, where, "float64"):
        return
    start = time.monotonic()
    try:
        device_type = "cuda" if device.startswith("cuda") else "cpu"
        parts = launch(_rank_clipped_sum, 2, (device_type, 0.05), timeout_s=180, backend=backend)
        base = small_gpt().double().to(device)
        x, y = _batch(64, 7, 16, device)
        want = loop_clipped_sum(copy.deepcopy(base), token_loss, x, y, 0.05)
        got = {k: v.to(device) for part in parts for k, v in part.items()}
        err = relative_error(got, want)
        row(label, where, "float64", "pass" if err < 1e-9 else "FAIL", f"{err:.1e}", "< 1e-9", time.monotonic() - start)
    except Exception as exc:  # noqa: BLE001 - reported in the table
        _failed(label, where, "float64", exc, start)


def processes(device: str, deadline: float, with_tensor_parallel: bool = False) -> None:
    """2 ranks: on one GPU (gloo, host-staged), over NCCL on 2 GPUs (or gloo on the CPU), and a stall."""
    from pipedp.errors import RankFailedError
    from pipedp.runtime.launch import launch

    cuda = device.startswith("cuda")
    if cuda:
        two_process_parity("2 processes on one GPU over gloo, host-staged", device, "cuda:0 (shared)", "gloo", deadline)
    if cuda and torch.cuda.device_count() < 2:
        row("NCCL parity and stalled rank, 2 processes", device, "float64", "skip", "one GPU here")
        return
    backend, where = ("nccl", "cuda:0+cuda:1") if cuda else ("gloo", "cpu")
    two_process_parity(f"2 processes over {backend}", device, where, backend, deadline)
    if cuda or with_tensor_parallel:
        tensor_parallel(device, backend, where, deadline)
    else:
        row("tensor parallel llama: 2 ranks", where, "float64", "skip", "on 2 GPUs, or --tensor-parallel on the CPU")
    label, timeout_s = f"stalled rank over {backend}: named error within the timeout", 10.0
    if _budget_spent(deadline, label, where, "float32"):
        return
    start = time.monotonic()
    try:
        launch(_stalling_rank, 2, (timeout_s,), timeout_s=180, backend=backend, op_timeout_s=timeout_s)
        row(label, where, "float32", "FAIL", "the step finished though rank 1 stalled", "", time.monotonic() - start)
    except RankFailedError as exc:
        took = time.monotonic() - start
        named = "stopped answering" in str(exc)
        ok = named and took < timeout_s + 90  # the timeout plus two processes' start (CUDA, NCCL)
        row(
            label,
            where,
            "float32",
            "pass" if ok else "FAIL",
            str(exc).splitlines()[0][:120],
            f"< {timeout_s + 90:.0f} s",
            took,
        )


# ---- 6: peak GPU memory against the planner ------------------------------------------------------------------
def memory_vs_planner(device: str, quick: bool, deadline: float) -> None:
    """One stage in one process (the planner's stage, self-check on): the allocator's peak over the first step
    and two more, against the planner's tensor bytes (and its GPU estimate against the reserved peak)."""
    from pipedp import PipelineDPTrainer
    from pipedp.config import PipelineConfig
    from pipedp.models import token_loss
    from pipedp.planner import estimate

    from .memory import PeakMemory

    label = "peak memory: pipedp 1 stage vs planner"
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        row(label, device, "float32", "skip", "transformers not installed")
        return
    if _budget_spent(deadline, label, device, "float32"):
        return
    start = time.monotonic()
    width, layers, seq, rows_ = (64, 2, 32, 2) if quick else (1024, 4, 512, 4)
    config = LlamaConfig(
        vocab_size=4096 if not quick else 256,
        hidden_size=width,
        intermediate_size=4 * width,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=seq,
        tie_word_embeddings=False,
    )
    pipeline = PipelineConfig(stages=1, microbatches=2)
    try:
        plan = estimate(config, 1, rows_, seq, pipeline=pipeline, optimizer="sgd")
        predicted = plan.stages[0]
        torch.manual_seed(0)
        with PeakMemory(device) as mem:
            model = LlamaForCausalLM(config).to(device)
            trainer = PipelineDPTrainer(
                model,
                token_loss,
                lambda params: torch.optim.SGD(params, lr=1e-3),
                stages=1,
                microbatches=2,
                noise_multiplier=1.0,
                expected_batch_size=2 * rows_,
                transport="inprocess",
            )
            for _ in range(3):
                trainer.step(*_batch(config.vocab_size, 2 * rows_, seq, device))
        trainer.close()
        ratio = predicted.total / max(mem.peak_mib * 2**20, 1.0)
        row(
            label,
            device,
            "float32",
            ("pass" if 0.8 <= ratio <= 1.25 else "FAIL") if device.startswith("cuda") else "info",  # RSS: noisy
            f"predicted / measured {ratio:.2f} ({predicted.total / 2**20:.0f} / {mem.peak_mib:.0f} MiB)",
            "0.8-1.25",
            time.monotonic() - start,
        )
        if device.startswith("cuda"):
            row(
                "peak memory: planner's GPU estimate vs reserved + context",
                device,
                "float32",
                "info",
                f"{predicted.on_gpu / 2**20:.0f} MiB estimated, {mem.reserved_mib:.0f} MiB reserved (add the "
                "context: nvidia-smi)",
                "",
                0.0,
            )
    except Exception as exc:  # noqa: BLE001
        _failed(label, device, "float32", exc, start)


# ---- 7: the harness on one GPU ----------------------------------------------------------------------------
def harness(device: str, quick: bool, deadline: float) -> None:
    from pipedp.models import GPTConfig

    from .presets import PRESETS, gpt_preset

    presets = (
        [PRESETS["tiny"]]
        if quick
        else [
            PRESETS["realistic"],
            gpt_preset(  # matrix work a GPU notices
                GPTConfig(vocab_size=4096, seq_len=256, d_model=2048, n_heads=16, n_layers=8),
                "GPU GPT: 8 blocks, d=2048, T=256, vocab 4096; batch 32 as 4 micro-batches of 8",
                "gpu-large",
                batch=32,
                microbatches=4,
            ),
        ]
    )
    rounds, reps = (2, 1) if quick else (5, 3)

    def sync():
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    for preset in presets:
        if _budget_spent(deadline, f"harness {preset.name}", device, "float32"):
            continue
        start = time.monotonic()
        try:
            contenders = _contenders(preset, device)
            for c in contenders:
                steps.timed(c.step, 2, 0)
            times = steps.interleave(contenders, rounds, reps, sync)
            names = [c.name for c in contenders]
            best = min((n for n in names if n.startswith("pipedp")), key=lambda n: statistics.median(times[n]))
            for other in ("plain", "opacus-ghost"):
                ratios = [b / a for a, b in zip(times[best], times[other])]
                row(
                    f"harness {preset.name}: {best} / {other} (samples/s)",
                    device,
                    "float32",
                    "info",
                    f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}, {rounds} rounds)",
                    ">= 1.5 vs Opacus" if other == "opacus-ghost" else "",
                    time.monotonic() - start,
                )
            for n in names:
                row(
                    f"harness {preset.name}: {n}",
                    device,
                    "float32",
                    "info",
                    f"{preset.batch / statistics.median(times[n]):.1f} samples/s",
                    "",
                    0.0,
                )
            _self_check_cost(preset, device, sync, rounds)
        except Exception as exc:  # noqa: BLE001
            row(
                f"harness {preset.name}",
                device,
                "float32",
                "FAIL",
                f"{type(exc).__name__}: {str(exc)[:120]}",
                "",
                time.monotonic() - start,
            )
            traceback.print_exc()


def _contenders(preset, device) -> List[steps.Contender]:
    made = [steps.plain(preset, device=device), steps.opacus(preset, "ghost", device=device)]
    for mode in ("ghost", "keep"):
        made.append(steps.pipedp(preset, "1f1b", mode, stages=1, device=device, name=f"pipedp-1stage-{mode}"))
    return made


def _self_check_cost(preset, device, sync, rounds: int) -> None:
    x, y = (t.to(device) for t in preset.make_batch(preset.batch, 0))
    first: Dict[bool, List[float]] = {True: [], False: []}
    model = steps.stage_model(preset, 1, 0, False)  # one model, a new trainer on it per measurement
    for r in range(rounds + 1):
        for check in (True, False) if r % 2 else (False, True):
            trainer = steps.pipedp_trainer(
                preset, "1f1b", "ghost", self_check=check, stages=1, model=model, device=device
            )
            sync()
            t = time.perf_counter()
            trainer.step(x, y)
            sync()
            if r:  # the first round warms the process up
                first[check].append(time.perf_counter() - t)
            trainer.close()
    ratios = [a / b for a, b in zip(first[True], first[False])]
    row(
        f"harness {preset.name}: self-check, first step True / False (time)",
        device,
        "float32",
        "info",
        f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})",
        "",
        0.0,
    )


def compile_ceiling(device: str, quick: bool, deadline: float) -> None:
    label = "torch.compile: plain realistic, eager / compiled (time)"
    if quick or not device.startswith("cuda"):
        row(label, device, "float32", "skip", "on a GPU only, not with --quick (the CPU's: bench/RESULTS.md)")
        return
    if _budget_spent(deadline, label, device, "float32"):
        return
    from . import compile_ceiling as ceiling

    start = time.monotonic()
    try:
        got = ceiling.measure("realistic", rounds=5, device=device)
        r = got["ratios"]
        measured = f"{statistics.median(r):.2f}x ({min(r):.2f}-{max(r):.2f}); compiling {got['compile_s']:.0f} s"
        row(label, device, "float32", "info", measured, "", time.monotonic() - start)
    except Exception as exc:  # noqa: BLE001
        _failed(label, device, "float32", exc, start)


def table() -> str:
    lines = ["| check | device | dtype | result | measured | bound | s |", "|---|---|---|---|---|---|---|"]
    for r in ROWS:
        lines.append(
            f"| {r['check']} | {r['device']} | {r['dtype']} | {r['result']} | {r['measured']} | {r['bound']} | "
            f"{r['s']:.1f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.splitlines()[0])
    p.add_argument(
        "--budget-s",
        type=float,
        default=240.0,
        help="stop starting new checks after this many seconds (the last may run on)",
    )
    p.add_argument("--device", default=None, help="run on this device instead of cuda:0 (cpu: a self-test)")
    p.add_argument("--quick", action="store_true", help="a few parity cases and the tiny preset")
    p.add_argument(
        "--tensor-parallel",
        action="store_true",
        help="on the CPU too: the tensor-parallel row (on GPUs it runs always)",
    )
    args = p.parse_args(argv)
    ROWS.clear()
    if args.device is None and not torch.cuda.is_available():
        print("bench.gpu_check: CUDA is not available on this machine: skipped (nothing was checked)")
        return 0
    device = args.device or "cuda:0"
    start = time.monotonic()
    deadline = start + args.budget_s
    if device.startswith("cuda"):
        print(f"{torch.cuda.get_device_name(device)}, {torch.cuda.device_count()} device(s), torch {torch.__version__}")
        torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32 in the parity checks
        torch.backends.cudnn.allow_tf32 = False
    print("1-2. parity", flush=True)
    parity(device, args.quick, deadline)
    print("3. two devices in one process", flush=True)
    if device.startswith("cuda") and torch.cuda.device_count() >= 2:
        two_devices(["cuda:0", "cuda:1"], deadline)
    elif device == "cpu":
        two_devices(["cpu", "cpu"], deadline)  # the code path, on the CPU
    else:
        row("two devices in one process", device, "float64", "skip", f"{torch.cuda.device_count()} GPU(s) here")
    print("4-5. processes", flush=True)
    processes(device, deadline, args.tensor_parallel)
    print("6. peak memory vs the planner", flush=True)
    memory_vs_planner(device, args.quick, deadline)
    print("7. harness", flush=True)
    harness(device, args.quick, deadline)
    print("8. torch.compile's ceiling", flush=True)
    compile_ceiling(device, args.quick, deadline)
    print(f"\n{table()}\n\n({time.monotonic() - start:.0f} s)")
    failed = [r for r in ROWS if r["result"] == "FAIL"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
