"""The share of a DP step spent recomputing what the plain backward gets for free: a LayerNorm's per-sample
gradients (its normalised input recomputed) and a biased Linear's per-sample output-gradient sums (taken in I for
the norm, and again in W for the clipped sum).

    python -m bench.rule_shares             # the small preset, about 30 s; one process, one thread
    python -m bench.rule_shares realistic 2

Times, inside pipedp's default step (grad_mode auto, 2 stages in one process, after the warm-up steps), with
plain micro-batched training's step alternating beside it:
- the LayerNorm rule in I (privacy/rules/layer_norm.py: normalised input, product, sums);
- torch.nn.functional.layer_norm inside that rule (the recomputed normalised input);
- the Linear rule's per-sample sums over positions, ``g.sum(1)``, in I and in W, and W's ``sum((0, 1))`` of the
  clip-scaled output-gradients (the bias's part of a wide-input layer's clipped sum): every such sum of a 3-D
  tensor in I and W outside the LayerNorm rule (the GPT presets' only other layers, the embeddings, sum none).
"""

from __future__ import annotations

import statistics
import sys
import time
from collections import defaultdict
from contextlib import ExitStack, contextmanager
from typing import Dict
from unittest import mock

import torch

import pipedp.privacy.rules.layer_norm as layer_norm_rule
from pipedp.runtime.stage import Stage

from .overhead import _plain_and_dp


class _Timers:
    def __init__(self) -> None:
        self.seconds: Dict[str, float] = defaultdict(float)
        self.phase = ""  # "I" in the per-sample norms, "W" in the clipped sums, "" elsewhere

    @contextmanager
    def timing(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - start

    @contextmanager
    def installed(self):
        """Wraps the pieces for the length of one DP step."""
        rule_grads, tensor_sum = layer_norm_rule._grads, torch.Tensor.sum
        norms, weight = Stage._per_parameter_norms, Stage.weight
        functional = layer_norm_rule.torch.nn.functional.layer_norm
        timers = self

        def timed_rule(*args, **kwargs):
            timers.in_rule = True
            try:
                with timers.timing("LayerNorm rule in I"):
                    return rule_grads(*args, **kwargs)
            finally:
                timers.in_rule = False

        def timed_recompute(*args, **kwargs):
            name = "its layer_norm recompute" if timers.in_rule else "model's own layer_norm"
            with timers.timing(name):
                return functional(*args, **kwargs)

        def in_phase(phase, method):
            def wrapped(stage, *args, **kwargs):
                timers.phase = phase
                try:
                    return method(stage, *args, **kwargs)
                finally:
                    timers.phase = ""

            return wrapped

        def timed_sum(t, *args, **kwargs):
            # a Linear's [n, T, out] output-gradient summed over positions (3-D: not the norms' [n, out] sums)
            if timers.phase and t.dim() == 3 and args and args[0] in (1, (0, 1)) and not timers.in_rule:
                with timers.timing(f"Linear sum({args[0]}) in {timers.phase}"):
                    return tensor_sum(t, *args, **kwargs)
            return tensor_sum(t, *args, **kwargs)

        self.in_rule = False
        with ExitStack() as patches:
            for owner, name, replacement in (
                (layer_norm_rule, "_grads", timed_rule),
                (layer_norm_rule.torch.nn.functional, "layer_norm", timed_recompute),
                (torch.Tensor, "sum", timed_sum),
                (Stage, "_per_parameter_norms", in_phase("I", norms)),
                (Stage, "weight", in_phase("W", weight)),
            ):
                patches.enter_context(mock.patch.object(owner, name, replacement))
            yield


def measure(preset: str = "small", reps: int = 3) -> Dict:
    """{preset, dp_s, plain_s (medians), shares: {piece: its seconds per DP step / the DP step}}."""
    torch.set_num_threads(1)
    steps, trainer = _plain_and_dp(preset, "auto")
    timers, dp, plain = _Timers(), [], []
    for _ in range(reps):
        with timers.installed():
            start = time.perf_counter()
            steps["dp"]()
            dp.append(time.perf_counter() - start)
        start = time.perf_counter()
        steps["plain"]()
        plain.append(time.perf_counter() - start)
    trainer.close()
    dp_s = statistics.median(dp)
    shares = {k: v / reps / dp_s for k, v in timers.seconds.items() if k != "model's own layer_norm"}
    return {"preset": preset, "dp_s": dp_s, "plain_s": statistics.median(plain), "shares": shares}


def main(argv=None) -> None:
    argv = argv if argv is not None else sys.argv[1:]
    got = measure(argv[0] if argv else "small", int(argv[1]) if len(argv) > 1 else 3)
    print(
        f"{got['preset']}: DP step {got['dp_s']:.3f} s (the wrappers' own time included), plain {got['plain_s']:.3f} s"
    )
    for name, share in got["shares"].items():
        print(f"  {name}: {100 * share:.1f}% of the DP step")


if __name__ == "__main__":
    main()
