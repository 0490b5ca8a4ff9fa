"""What loading one stage for tensor parallelism holds at its peak: the whole stage's tensors, or each rank's slices.

    python -m bench.slice_loading                      # a 4-layer Llama of width 1024, vocabulary 32000, bf16
    python -m bench.slice_loading --width 2048 --layers 8 --tensor-parallel 4

A Llama-shaped folder with random weights is written once; then, each in a fresh process, the peak-RSS increment
(bench.memory.PeakMemory) of ``load_pipeline_stage`` (1 stage) followed by the tensor-parallel split of rank 0:
- ``whole``: loaded as before slice-by-slice reading (tensor_parallel=1 at loading, cut afterwards);
- ``slices``: ``load_pipeline_stage(..., tensor_parallel=T)``: the split layers read slice by slice.
Beside each: the bytes rank 0 holds once split, and the peak over them (1.0x: nothing held beyond the slices).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch

from .memory import PeakMemory


def write_folder(folder: str, width: int, layers: int, vocab: int) -> None:
    import transformers

    from .presets import llama_of_width

    torch.manual_seed(0)
    transformers.LlamaForCausalLM(llama_of_width(width, layers, vocab)).to(torch.bfloat16).save_pretrained(folder)


def measure(folder: str, tensor_parallel: int, slices: bool) -> dict:
    """Rank 0's load and split, in this process: its peak increment and the bytes it then holds."""
    from pipedp.parallel.layers import Group
    from pipedp.parallel.plan import split_stage, tensor_parallel_plan
    from pipedp.split.adapters import model_blocks
    from pipedp.split.hf_loading import build_on_meta, load_pipeline_stage, resident_parameter_bytes

    build_on_meta(folder)  # transformers and the model's modules imported before the phase: their code is not data
    with PeakMemory() as peak:
        model = load_pipeline_stage(folder, 1, 0, tensor_parallel=tensor_parallel if slices else 1)
        blocks = model_blocks(model)
        split_stage(blocks, tensor_parallel_plan(model, blocks, tensor_parallel), Group(0, tensor_parallel, None))
    return {"peak_mib": peak.host_mib, "held_mib": resident_parameter_bytes(model) / 2**20}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--tensor-parallel", type=int, default=2)
    parser.add_argument("--measure", choices=["whole", "slices"], help=argparse.SUPPRESS)  # one contender
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure:
        print(json.dumps(measure(args.folder, args.tensor_parallel, args.measure == "slices")))
        return
    with tempfile.TemporaryDirectory() as folder:
        write_folder(folder, args.width, args.layers, args.vocab)
        stored = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder)) / 2**20
        print(
            f"Llama-shaped folder: width {args.width}, {args.layers} layers, vocabulary {args.vocab}, bf16: "
            f"{stored:.0f} MiB; rank 0 of tensor_parallel={args.tensor_parallel}"
        )
        print(f"{'loading':<8} {'peak MiB':>9} {'held MiB':>9} {'peak/held':>9}")
        for way in ("whole", "slices"):
            command = [sys.executable, "-m", "bench.slice_loading", "--measure", way, "--folder", folder]
            command += ["--tensor-parallel", str(args.tensor_parallel)]
            out = subprocess.run(command, capture_output=True, text=True, check=True)
            row = json.loads(out.stdout.strip().splitlines()[-1])
            print(
                f"{way:<8} {row['peak_mib']:>9.0f} {row['held_mib']:>9.0f} {row['peak_mib'] / row['held_mib']:>8.2f}x"
            )


if __name__ == "__main__":
    main()
