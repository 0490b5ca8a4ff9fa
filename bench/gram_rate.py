"""How fast this machine's BLAS runs the ghost norms' Gram products, against the weight-gradient product of the
same tensors: the part of DP's cost that no change to pipedp's arithmetic removes.

    python -m bench.gram_rate            # about 20 s; one thread
    python -m bench.gram_rate 8 64       # rows per micro-batch, positions

For an output-gradient (or input) g of [n, T, width], per width:
- gram: torch.bmm(g, g^T), the Gram matrices [n, T, T] that linear.py's ghost norms read (an "NT" product: g is
  row-major [T, width], and so is the matrix it is multiplied with);
- gram from [width, T]: the same product from a copy transposed once (a "TN" product), with and without the copy;
- weight product: g^T a over the micro-batch's n T rows (a: [n, T, 256]), the plain backward's weight gradient;
each as GFLOP/s (2 x multiply-adds / time, the median of 9 runs of 20 calls).
"""

from __future__ import annotations

import statistics
import sys
from typing import Dict, List

import torch

from . import steps as S


def _rate(fn, flops: float, calls: int = 20) -> float:
    def many() -> None:
        for _ in range(calls):
            fn()

    times = S.timed(many, warmup=1, reps=9)
    return flops * calls / statistics.median(times) / 1e9


def rates(rows: int, positions: int, width: int) -> Dict:
    """The four products' GFLOP/s for one width."""
    g = torch.randn(rows, positions, width)
    a = torch.randn(rows * positions, 256)
    gt = g.transpose(1, 2).contiguous()
    gram_flops = 2 * rows * positions * positions * width

    def gram_after_copy():
        t = g.transpose(1, 2).contiguous()
        return torch.bmm(t.transpose(1, 2), t)

    return {
        "width": width,
        "gram": _rate(lambda: torch.bmm(g, g.transpose(1, 2)), gram_flops),
        "gram from [width, T]": _rate(lambda: torch.bmm(gt.transpose(1, 2), gt), gram_flops),
        "the same with its copy": _rate(gram_after_copy, gram_flops),
        "weight product": _rate(lambda: g.reshape(-1, width).t() @ a, 2 * rows * positions * width * a.shape[1]),
    }


def measure(rows: int = 8, positions: int = 64, widths=(256, 768, 1024, 3072, 4096)) -> List[Dict]:
    torch.set_num_threads(1)
    return [rates(rows, positions, width) for width in widths]


def main(argv=None) -> None:
    argv = argv if argv is not None else sys.argv[1:]
    rows, positions = (int(argv[0]), int(argv[1])) if len(argv) >= 2 else (8, 64)
    table = measure(rows, positions)
    columns = [k for k in table[0] if k != "width"]
    print(f"GFLOP/s, one thread, [n, T, width] = [{rows}, {positions}, width]")
    print("| width | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for row in table:
        print(f"| {row['width']} | " + " | ".join(f"{row[c]:.0f}" for c in columns) + " |")


if __name__ == "__main__":
    main()
