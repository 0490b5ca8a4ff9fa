"""``--report-to``: the metrics also go to TensorBoard, Weights & Biases or MLflow, each through its own
library's API (no writer of ours). Only rank 0 reports.

    tensorboard  RUN/tensorboard (torch.utils.tensorboard)
    wandb        wandb.init(dir=RUN): online, or offline with WANDB_MODE=offline (then ``wandb sync``);
                 project WANDB_PROJECT (default "pipedp"); a resumed run continues the same wandb run
    mlflow       MLFLOW_TRACKING_URI (default sqlite:///RUN/mlflow.db); experiment MLFLOW_EXPERIMENT_NAME
                 (default "pipedp"); a resumed run continues the same mlflow run

Each tracker gets the run's flags as its config / params (never the seed: a known seed regenerates the
noise), and per step the metrics.jsonl line (names
``train/loss``, ``eval/loss``... as in TensorBoard), non-finite values left out. The wandb and mlflow run
ids go to RUN/trackers.json, and --resume continues those runs. Steps after the checkpoint that an
interrupted run had already logged are logged again on resume: TensorBoard drops the old ones
(purge_step), wandb keeps the old ones (it ignores steps below its last), mlflow keeps both.

A tracker that fails (to start, at a step, or to close: a login missing, a server gone) is said on stderr
and dropped; it never ends the training run (metrics.jsonl has every step).

Imports no torch at module level (the names are checked before anything is loaded).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
from typing import Any, Dict, List, Optional, Protocol, Tuple

from ..errors import ConfigError

TRACKERS = ("tensorboard", "wandb", "mlflow")
# what the trackers leave in the run folder (RUN/wandb is wandb's own folder under dir=RUN; trackers.json: run ids)
TENSORBOARD, WANDB, MLFLOW_DB, IDS = "tensorboard", "wandb", "mlflow.db", "trackers.json"
OUTPUTS = (TENSORBOARD, WANDB, MLFLOW_DB, IDS)
# never sent to a tracker (a third party's server, for wandb online): a known seed regenerates the noise
SECRET = ("seed", "checkpoint_key")


def parse(text: str) -> Tuple[str, ...]:
    """``--report-to``'s value: none, all (every installed tracker), or a comma-separated list, as Hugging
    Face's report_to takes it."""
    names = [n.strip().lower() for n in text.split(",") if n.strip()]
    if names in ([], ["none"]):
        return ()
    if names == ["all"]:
        return tuple(n for n in TRACKERS if _missing(n) is None)
    unknown = [n for n in names if n not in TRACKERS]
    if unknown:
        raise ConfigError(
            f"--report-to {text}: {', '.join(unknown)} is not a tracker pipedp reports to; give none, all, or a "
            f"comma-separated list of {', '.join(TRACKERS)}",
            "report_to",
        )
    return tuple(dict.fromkeys(names))


def _missing(name: str) -> Optional[str]:
    """What ``name`` lacks to report (None: nothing): its package, or MLflow's default store's."""
    if importlib.util.find_spec(name) is None:
        return f"--report-to {name} needs the {name} package: pip install {name}"
    if name == "mlflow" and "MLFLOW_TRACKING_URI" not in os.environ and importlib.util.find_spec("sqlalchemy") is None:
        return (
            "--report-to mlflow stores the run in sqlite:///RUN/mlflow.db, which needs sqlalchemy (mlflow-skinny "
            "lacks it): pip install mlflow (or sqlalchemy alembic), or point MLFLOW_TRACKING_URI at your server"
        )
    return None


def check_installed(names: Tuple[str, ...]) -> None:
    """Before any process starts: each tracker can report (``all`` took only those that can)."""
    for name in names:
        problem = _missing(name)
        if problem is not None:
            raise ImportError(problem)


class Tracker(Protocol):
    name: str  # tensorboard, wandb or mlflow
    where: str  # said at the start: where the metrics go

    def log(self, metrics: Dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


def tags(line: Dict[str, Any]) -> Dict[str, float]:
    """A metrics.jsonl line as tracker metrics: ``eval/loss``, ``train/loss``...; the step and non-numbers out."""
    out = {}
    for key, value in line.items():
        if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            continue
        out[f"eval/{key[5:]}" if key.startswith("eval_") else f"train/{key}"] = float(value)
    return out


class _TensorBoard:
    name = "tensorboard"

    def __init__(self, run_dir: str, start_step: int):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=os.path.join(run_dir, TENSORBOARD), purge_step=start_step + 1)
        self.where = f"tensorboard: {os.path.join(run_dir, TENSORBOARD)}"

    def log(self, metrics: Dict[str, float], step: int) -> None:
        for tag, value in metrics.items():
            self.writer.add_scalar(tag, value, step)

    def close(self) -> None:
        self.writer.close()


class _WandB:
    name = "wandb"

    def __init__(self, run_dir: str, config: Dict[str, Any], run_id: Optional[str]):
        import wandb

        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "pipedp"),
            dir=run_dir,
            name=os.path.basename(os.path.abspath(run_dir)),
            config=config,
            id=run_id,
            resume="allow" if run_id else None,
            # no system metadata: it records the command line, and with it a --seed (SECRET)
            settings=wandb.Settings(x_disable_meta=True, save_code=False),
        )
        self.id = self.run.id
        mode = "offline, `wandb sync` uploads it" if self.run.settings.mode == "offline" else "online"
        self.where = (
            f"wandb: run {self.id} of project {self.run.project} ({mode}; files in {os.path.join(run_dir, WANDB)})"
        )

    def log(self, metrics: Dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


class _MLflow:
    name = "mlflow"

    def __init__(self, run_dir: str, config: Dict[str, Any], run_id: Optional[str]):
        import mlflow

        self.mlflow = mlflow
        uri = os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:///" + os.path.abspath(os.path.join(run_dir, MLFLOW_DB))
        mlflow.set_tracking_uri(uri)
        mlflow.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME", "pipedp"))
        self.run = mlflow.start_run(run_id=run_id, run_name=None if run_id else os.path.basename(run_dir))
        self.id = self.run.info.run_id
        self.where = f"mlflow: run {self.id} at {uri}"
        if run_id is None:  # params are written once (mlflow refuses to change them)
            mlflow.log_params({k: str(v)[:500] for k, v in config.items()})

    def log(self, metrics: Dict[str, float], step: int) -> None:
        self.mlflow.log_metrics(metrics, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


def failed(name: str, what: str, exc: BaseException) -> None:
    """A tracker's failure never ends a training run: it is said on stderr, and the tracker dropped."""
    text = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
    message = f"--report-to {name} {what} ({type(exc).__name__}: {text}); training goes on without it"
    print(f"pipedp: warning: {message} (metrics.jsonl has every step)", file=sys.stderr, flush=True)


def log_all(trackers: List[Tracker], metrics: Dict[str, float], step: int) -> List[Tracker]:
    """Each tracker logs the step; returns those still working."""
    working = []
    for tracker in trackers:
        try:
            tracker.log(metrics, step)
            working.append(tracker)
        except Exception as exc:
            failed(tracker.name, f"failed at step {step}", exc)
    return working


def close_all(trackers: List[Tracker]) -> None:
    for tracker in trackers:
        try:
            tracker.close()
        except Exception as exc:  # (the others are still closed: their last events flushed)
            failed(tracker.name, "failed to close", exc)


def open_trackers(names: Tuple[str, ...], run_dir: str, config: Dict[str, Any], start_step: int) -> List[Tracker]:
    """The trackers of ``names``; a resumed run (``start_step`` > 0) continues the runs RUN/trackers.json names."""
    config = {k: v for k, v in config.items() if k not in SECRET}
    path = os.path.join(run_dir, IDS)
    ids: Dict[str, str] = {}
    if start_step and os.path.exists(path):
        with open(path) as f:
            ids = json.load(f)
    out: List[Tracker] = []
    for name in names:
        try:
            if name == "tensorboard":
                out.append(_TensorBoard(run_dir, start_step))
                continue
            tracker = (_WandB if name == "wandb" else _MLflow)(run_dir, config, ids.get(name))  # (ids: a resumed run's)
        except Exception as exc:  # (a login missing, a server unreachable): said, and the run goes on
            failed(name, "could not start", exc)
            continue
        ids[name] = tracker.id
        out.append(tracker)
    if ids:
        with open(path, "w") as f:
            json.dump(ids, f)
    return out
