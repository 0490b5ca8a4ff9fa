"""What ``torch.compile`` gives non-private micro-batched training of a preset on this machine: the model's part of
a DP step, which pipedp runs as eager PyTorch. (pipedp's own part, the Gram and clipped-sum products and the
element-wise work around them, is not measured here.)

    python -m bench.compile_ceiling small 7          # preset, rounds (about 1 minute on 2 cores)
    python -m bench.compile_ceiling realistic 7      # about 3 minutes

One process, one thread (on the CPU; ``bench.gpu_check`` runs it on a GPU); the same model, batch and SGD step,
eager (``steps.plain``) and under ``torch.compile(model)`` (inductor's defaults), interleaved in rounds as the
harness does (``steps.interleave``), after the compiled side's first step (printed: the compile time) and one
warm-up each. Prints the median step times and the eager / compiled ratio of each round (above 1: compiling is
faster).
"""

from __future__ import annotations

import statistics
import sys
from typing import Dict, Union

import torch

from . import steps as S
from .presets import PRESETS, Preset


def measure(preset: Union[str, Preset] = "small", rounds: int = 7, device: str = "cpu") -> Dict:
    """{preset, compile_s, times: {eager, compiled: [s]}, ratios: [eager / compiled]} (on a GPU, timed between
    synchronisations: bench.gpu_check's compile row)."""
    preset = PRESETS[preset] if isinstance(preset, str) else preset
    if device == "cpu":
        torch.set_num_threads(1)

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)

    eager, compiled = (
        S.plain(preset, device=device, microbatches=preset.microbatches, compiled=c) for c in (False, True)
    )
    compile_s = S.timed(compiled.step, 0, 1, sync)[0]
    for contender in (eager, compiled):
        S.timed(contender.step, 1, 0)
    times = S.interleave([eager, compiled], rounds, 1, sync)
    times = {"eager": times[eager.name], "compiled": times[compiled.name]}
    ratios = [e / c for e, c in zip(times["eager"], times["compiled"])]
    return {"preset": preset.name, "compile_s": compile_s, "times": times, "ratios": ratios}


def main(argv=None) -> Dict:
    args = argv if argv is not None else sys.argv[1:]
    result = measure(args[0] if args else "small", int(args[1]) if len(args) > 1 else 7)
    median = {name: statistics.median(v) for name, v in result["times"].items()}
    print(
        f"{result['preset']}: first compiled step {result['compile_s']:.1f} s; eager {1000 * median['eager']:.0f} ms, "
        f"compiled {1000 * median['compiled']:.0f} ms a step (median); eager / compiled "
        f"{median['eager'] / median['compiled']:.2f}x, rounds " + " ".join(f"{r:.2f}" for r in result["ratios"])
    )
    return result


if __name__ == "__main__":
    main()
