"""What a checkpoint save adds to the peak resident memory, against the bytes it writes.

    python -m bench.checkpoint_memory                       # 16 x Linear(2048, 2048) fp32 (256 MiB), Adam
    python -m bench.checkpoint_memory --optimizer sgd --layers 32

One in-process trainer on 2 stages; one DP step so that the optimizer has its state; then the
peak-RSS increment (bench.memory.PeakMemory: the kernel's VmHWM, reset before the phase) of
``save_checkpoint`` — the streamed safetensors writer — and, for comparison, of the previous
format's way (``torch.save`` of each stage's state into a BytesIO before writing it).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import tempfile
import time
import warnings

import torch
import torch.nn as nn

from .memory import PeakMemory


def build(width: int, layers: int, optimizer: str):
    from pipedp import PipelineDPTrainer

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])

    def make(params):
        if optimizer == "adam":
            return torch.optim.Adam(params, lr=1e-4)
        return torch.optim.SGD(params, lr=0.1)

    trainer = PipelineDPTrainer(
        model,
        lambda out, y: ((out - y) ** 2).mean(dim=1),
        make,
        stages=2,
        microbatches=2,
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        expected_batch_size=4,
        sample_rate=0.01,
        seed=0,
    )
    trainer.step(torch.randn(4, width), torch.randn(4, width), sampling="poisson")
    return trainer


def old_way(trainer, folder: str) -> None:
    """The previous format: each stage's parameters and optimizer state through torch.save into memory."""
    for stage, opt in zip(trainer.runtime.local_stages, trainer.state.optimizers):
        buf = io.BytesIO()
        torch.save({"params": stage.named_state(), "optimizer": opt.state_dict()}, buf)
        data = buf.getvalue()
        with open(os.path.join(folder, f"stage-{stage.index}.pt"), "wb") as f:
            f.write(data)
        del buf, data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    trainer = build(args.width, args.layers, args.optimizer)
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as root:
        with PeakMemory() as new:
            start = time.perf_counter()
            trainer.save_checkpoint(os.path.join(root, "ckpt"))
            seconds = time.perf_counter() - start
        folder = os.path.join(root, "ckpt", "step-00000001")
        sizes = [os.path.getsize(os.path.join(folder, n)) for n in sorted(os.listdir(folder)) if "safetensors" in n]
        os.mkdir(os.path.join(root, "old"))
        with PeakMemory() as old:
            old_way(trainer, os.path.join(root, "old"))
    stage_mib = max(sizes) / 2**20
    print(
        json.dumps(
            {
                "model": f"{args.layers} x Linear({args.width}, {args.width}) fp32, {args.optimizer}, 2 stages",
                "stage_file_mib": [round(s / 2**20, 1) for s in sizes],
                "save_s": round(seconds, 2),
                "save_peak_increase_mib": round(new.peak_mib, 1),
                "save_peak_increase_of_largest_stage": f"{100 * new.peak_mib / stage_mib:.1f}%",
                "old_torch_save_peak_increase_mib": round(old.peak_mib, 1),
                "old_of_largest_stage": f"{100 * old.peak_mib / stage_mib:.1f}%",
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
