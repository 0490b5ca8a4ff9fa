"""Which phase of a DP step sets its peak memory: the resident set before, at the peak of, and after
each stage's F / I / W, the hand-over of the clipped sums and the optimizer step.

    python -m bench.scale write llama-2-7b /tmp/l2 --layers 2
    python -m bench.step_memory /tmp/l2 --mode full      # bf16-true, AdamW, self_check off
    python -m bench.step_memory /tmp/l2 --mode lora

One process, every stage in it (in-process transport, ``--stages`` stages), the model read with
``load_pipeline_stage`` on 1 stage; each wrapped method resets the kernel's peak mark (VmHWM) before it
runs and reads it after. Two steps: the first allocates what stays (optimizer state), the second is the
steady state. Prints MiB.
"""

from __future__ import annotations

import argparse
import warnings
from typing import List, Tuple

import torch


def _kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field)


def _reset() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def measure(folder: str, mode: str, stages: int = 2, batch: int = 4, microbatches: int = 2, seq: int = 32):
    from pipedp import PipelineDPTrainer, settle_process
    from pipedp.models import token_loss
    from pipedp.split.hf_loading import load_pipeline_stage

    from .presets import BALANCE
    from .scale_folder import corpus_rows
    from .scale_run import preimport

    warnings.filterwarnings("ignore")
    preimport()
    model = load_pipeline_stage(folder, 1, 0, balance=BALANCE)
    if mode == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    x, y = corpus_rows(folder, batch, seq)
    trainer = PipelineDPTrainer(
        model,
        token_loss,
        lambda p: torch.optim.AdamW(p, lr=1e-4, fused=True),
        stages=stages,
        microbatches=microbatches,
        precision="bf16-mixed" if mode == "lora" else "bf16-true",
        self_check=False,
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        expected_batch_size=batch,
        sample_rate=0.01,
        sampling="poisson",
        balance=BALANCE,
        transport="inprocess",
    )
    settle_process()
    log: List[Tuple[str, float, float, float]] = []

    def wrap(obj, name: str, label: str):
        fn = getattr(obj, name)

        def measured(*args, **kwargs):
            before = _kib("VmRSS") / 1024
            _reset()
            out = fn(*args, **kwargs)
            log.append((label, before, _kib("VmHWM") / 1024, _kib("VmRSS") / 1024))
            return out

        setattr(obj, name, measured)

    for k, stage in enumerate(trainer.runtime.local_stages):
        for name in ("forward", "backward_input", "weight", "take_clipped_sum"):
            wrap(stage, name, f"stage {k} {name}")
    for k, opt in enumerate(trainer.state.optimizers):
        if opt is not None:
            wrap(opt, "step", f"stage {k} optimizer.step")
    steps = []
    for _ in range(2):
        log.clear()
        start = _kib("VmRSS") / 1024
        trainer.step(x, y)
        steps.append((start, list(log)))
    trainer.close()
    return steps


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.step_memory", description=__doc__.splitlines()[0])
    p.add_argument("folder")
    p.add_argument("--mode", choices=["lora", "full"], default="full")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--seq", type=int, default=32)
    args = p.parse_args(argv)
    torch.set_num_threads(2)
    steps = measure(args.folder, args.mode, args.stages, args.batch, args.microbatches, args.seq)
    for i, (start, log) in enumerate(steps):
        print(f"\nstep {i + 1}: RSS at the start {start:.0f} MiB")
        print("| phase | RSS before | peak | peak - before | RSS after |")
        print("|---|---|---|---|---|")
        for label, before, peak, after in log:
            print(f"| {label} | {before:.0f} | {peak:.0f} | +{peak - before:.0f} | {after:.0f} |")


if __name__ == "__main__":
    main()
