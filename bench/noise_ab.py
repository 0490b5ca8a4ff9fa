"""An A/B of pipedp's 1F1B against torch 1F1B with fewer contenders than ``bench.questions dp-cost`` (no naive split,
no zero-bubble or keep variants), so more rounds fit: for comparing two checkouts of pipedp, run alternately.

    python -m bench.noise_ab realistic 5 2 after      # preset, rounds, steps per round, a label for the lines
    python -m bench.noise_ab realistic 8 2 now 1f1b:auto,1f1b:ghost,dp-zb:ghost   # other variants (schedule:mode)

Prints, per pipedp contender, the median and every round's pipedp / torch 1F1B samples/s ratio (the harness's own
``_pipeline_rank``: 2 processes x 1 thread, contenders interleaved, their order rotating). To measure an older
commit, copy this file into a checkout of it and run it there.
"""

from __future__ import annotations

import statistics
import sys

from pipedp.runtime.launch import launch

from .questions import _pipeline_rank

VARIANTS = [("1f1b", "auto"), ("1f1b", "ghost")]


def main(argv=None) -> None:
    argv = argv if argv is not None else sys.argv[1:]
    preset, rounds, steps, label = argv[:4]
    variants = [tuple(v.split(":")) for v in argv[4].split(",")] if len(argv) > 4 else VARIANTS
    args = ("ab", preset, int(rounds), int(steps), 1, variants)
    times = launch(_pipeline_rank, 2, args, timeout_s=3600, threads=1, op_timeout_s=1800)[0]["times"]
    for name, own in times.items():
        if name.startswith("pipedp"):
            ratios = [theirs / mine for theirs, mine in zip(times["torch-1f1b"], own)]
            rounds_text = " ".join(f"{r:.3f}" for r in ratios)
            print(f"{label} {preset} {name}: median {statistics.median(ratios):.3f} rounds {rounds_text}")


if __name__ == "__main__":
    main()
