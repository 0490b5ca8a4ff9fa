"""The per-step callback of ``pipedp train``: progress bar, metrics log, trackers (--report-to), evaluation.

``RUN/metrics.jsonl`` gets one line per step: step, loss (the step's mean per-sample loss), lr (the
rate that step used), batch_size (rows sampled), clipped_fraction, samples_per_s (rows per second of
training time so far, evaluation left out) and elapsed_s; every ``epsilon_every`` steps, the last
step and every evaluation step also carry epsilon (the accountant's, at the run's delta: exactly
``trainer.epsilon()``; null where there is no finite guarantee: --disable-dp). An evaluation adds a line with eval_loss (the mean over the evaluation rows
of each row's mean token loss, computed through the pipeline without DP machinery) and
eval_perplexity (its exp).

The progress: a bar on a terminal (eps "–" until first computed), plain lines every ``epsilon_every`` steps
in a log (stderr not a terminal); none with --no-progress.

Not private: clipped_fraction is computed from the private batch without noise (a diagnostic, like
Opacus's), and eval_loss on a held-out split of the private data is a statistic of those records
published without noise. Only rank 0 writes; every rank evaluates (the pipeline needs them all).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any, Dict, List, Optional

from ..privacy.accounting import adjacency
from ..runtime.microbatch import rows, take
from .dataset import RankData
from .record import CONFIG_JSON, METRICS
from .spec import Job
from .trackers import close_all, log_all, open_trackers, tags


def _finite(value: Optional[float]) -> Optional[float]:
    return value if value is not None and math.isfinite(value) else None


def epsilon_text(value: Optional[float]) -> str:
    """The progress's epsilon: '–' until first computed, '∞' without a finite guarantee (DP disabled, or no noise)."""
    if value is None:
        return "–"
    return "∞" if math.isinf(value) else f"{value:.2f}"


def rate_text(value: float) -> str:
    """Samples per second to 3 significant digits (a big model's 0.04/s must not print as 0)."""
    return f"{value:.3g}"


class Monitor:
    def __init__(self, job: Job, trainer, data: RankData, lead: bool):
        self.job, self.trainer, self.data, self.lead = job, trainer, data, lead
        self.start_step = trainer.steps_taken
        self.samples = 0
        self.train_s = 0.0
        self.mark = time.perf_counter()
        self.first_loss: Optional[float] = None
        self.first_nonfinite: Optional[int] = None
        self.epsilon: Optional[float] = trainer.epsilon() if (lead and self.start_step) else None  # None: not yet
        self.history: Dict[str, List[Any]] = {"step": [], "loss": [], "eps_step": [], "epsilon": [], "eval": []}
        self.last_eval: Optional[dict] = None
        self._evaluated_at: Optional[int] = None
        self.log = self._open_log() if lead else None
        self.trackers = self._open_trackers() if lead and job.report_to else []
        self.bar = None
        self.plain = lead and job.progress and not sys.stderr.isatty()  # a log, not a terminal: plain lines
        if lead and job.progress and not self.plain:
            from tqdm import tqdm

            # (on a terminal) the bar shows eps: say what it is for
            desc = f"DP training (eps: {adjacency(job.privacy.sampling, job.data.privacy_unit)})"
            if not job.privacy.enabled:
                desc = "non-private training (--disable-dp: no clipping, no noise, eps ∞)"
            self.bar = tqdm(total=job.steps, initial=self.start_step, desc=desc, unit="step", dynamic_ncols=True)

    # ---- outputs ----------------------------------------------------------------------------------
    def _open_log(self):
        path = os.path.join(self.job.run_dir, METRICS)
        kept: List[str] = []
        if self.start_step and os.path.exists(path):  # resumed: keep the lines of the steps the checkpoint holds
            with open(path) as f:
                kept = [line for line in f if line.strip() and json.loads(line).get("step", 0) <= self.start_step]
        f = open(path, "w")
        f.writelines(kept)
        f.flush()
        return f

    def _open_trackers(self) -> list:
        try:  # the run's flags, as config.json saved them, are each tracker's config / params
            with open(os.path.join(self.job.run_dir, CONFIG_JSON)) as f:
                config = json.load(f)["flags"]
        except (OSError, ValueError, KeyError):
            config = {}
        trackers = open_trackers(self.job.report_to, self.job.run_dir, config, self.start_step)
        for tracker in trackers:
            print(f"report to {tracker.where}", flush=True)
        return trackers

    def _write(self, line: dict) -> None:
        if self.log is not None:
            self.log.write(json.dumps(line) + "\n")
            self.log.flush()
        if self.trackers:
            self.trackers = log_all(self.trackers, tags(line), line["step"])

    # ---- the callback -----------------------------------------------------------------------------
    def begin(self) -> None:
        """Training starts now (samples/s counts from here)."""
        self.mark = time.perf_counter()

    def on_step(self, step: int, loss: float, trainer) -> None:
        now = time.perf_counter()
        self.train_s += now - self.mark
        batch = trainer.last_batch_size
        self.samples += batch
        if batch and self.first_loss is None:
            self.first_loss = loss
        if batch and not math.isfinite(loss) and self.first_nonfinite is None:
            self.first_nonfinite = step
        job = self.job
        evaluate = self.data.eval is not None and job.data.eval_every is not None and step % job.data.eval_every == 0
        if self.lead:
            line = {
                "step": step,
                "loss": _finite(loss),
                "lr": job.optim.lr * job.optim.lr_factor(step - 1, job.steps),
                "batch_size": batch,
                "clipped_fraction": trainer.last_clipped_fraction,
                "samples_per_s": self.samples / max(self.train_s, 1e-9),
                "elapsed_s": self.train_s,
            }
            if step % job.epsilon_every == 0 or step == job.steps or evaluate:
                self.epsilon = trainer.epsilon()
                line["epsilon"] = _finite(self.epsilon)  # null: no finite guarantee (--disable-dp)
                self.history["eps_step"].append(step)
                self.history["epsilon"].append(self.epsilon)
            self.history["step"].append(step)
            self.history["loss"].append(_finite(loss))
            self._write(line)
            eps = epsilon_text(self.epsilon) + ("" if job.privacy.enabled else " (DP disabled)")
            if self.bar is not None:
                self.bar.set_postfix(loss=f"{loss:.3f}", eps=eps, samples_s=rate_text(line["samples_per_s"]))
                self.bar.update(1)
            elif self.plain and (step % job.epsilon_every == 0 or step == job.steps):
                print(
                    f"step {step}/{job.steps}: loss {loss:.3f}, eps {eps}, {rate_text(line['samples_per_s'])} "
                    "samples/s",
                    flush=True,
                )
        if evaluate:
            self.evaluate(step)
        self.mark = time.perf_counter()

    def evaluate(self, step: int) -> Optional[dict]:
        """Loss and perplexity on the evaluation rows (every rank takes part; rank 0 reports)."""
        assert self.data.eval is not None
        inputs, targets = self.data.eval
        k = self.data.unit_rows
        total_rows, n = rows(inputs), self.data.eval_rows
        size = max(k, self.job.eval_batch_size // k * k)  # whole units per evaluation batch
        total = 0.0
        for start in range(0, total_rows, size):
            part = slice(start, min(total_rows, start + size))
            # evaluate() is the mean loss per unit (a unit's loss: the sum of its rows'): times the units
            total += self.trainer.evaluate(take(inputs, part), targets[part]) * ((part.stop - part.start) // k)
        loss = total / n
        self._evaluated_at = step
        result = {"step": step, "eval_loss": _finite(loss), "eval_perplexity": _finite(math.exp(min(loss, 700.0)))}
        self.last_eval = dict(result, eval_rows=n)
        if self.lead:
            self._write(self.last_eval)
            self.history["eval"].append((step, loss))
            text = f"eval at step {step}: loss {loss:.4f}, perplexity {math.exp(min(loss, 700.0)):.4g} ({n} rows)"
            if self.bar is not None:
                self.bar.write(text)
            else:
                print(text, flush=True)
        return result

    def finish(self, result) -> None:
        """After fit: the final evaluation (unless the last step had one)."""
        self.train_s += time.perf_counter() - self.mark
        if self.data.eval is not None and self._evaluated_at != self.trainer.steps_taken:
            self.evaluate(self.trainer.steps_taken)
        if self.lead and result.epsilon is not None:
            self.epsilon = result.epsilon

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.log is not None:
            self.log.close()
            self.log = None
        if self.trackers:
            trackers, self.trackers = self.trackers, []
            close_all(trackers)
