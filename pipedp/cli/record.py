"""The run folder (``--checkpoint-dir``): what a run leaves there beside its checkpoints, and the checks
a new run makes against it.

    RUN/config.toml      the run's flags (``pipedp train --config RUN/config.toml`` runs it again)
    RUN/config.json      the flags and the resolved job (noise multiplier, sample rate, units, steps, data)
    RUN/metrics.jsonl    one line per step (and one per evaluation)
    RUN/summary.json     the end of the run
    RUN/training.png     loss and epsilon against steps (with matplotlib)
    RUN/tensorboard/     with --report-to tensorboard
    RUN/wandb/, RUN/mlflow.db, RUN/trackers.json   with --report-to wandb / mlflow (trackers.json: their run ids)
    RUN/data-cache/      the tokenised rows (a copy of the data: keep the folder private)
    RUN/step-*/, lock    the checkpoints (pipedp.train.checkpoint)

On --resume, the previous run's config.json says what changed: options that do not alter the update
(micro-batches, schedule, stages, the length, evaluation, logging) are accepted and listed; the
learning rate and its schedule apply from the resumed step on; the model, the data, the privacy unit
and every option that shapes the mechanism (the checkpoint's own check compares those too) are refused
before any process starts.

The checkpoint code (torch) is imported inside the methods that use it: the preflight imports this module
while it checks the flags, before torch loads.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from dataclasses import Field
from typing import Any, Dict, Iterator, List, Optional

from ..config import describe
from ..errors import ConfigError
from .configfile import NOT_SAVED, dumps
from .flags import CLI_DEFAULTS, DEFAULT_RUNS, cli_fields, field_default, flag_name
from .options import TABLES, OnResume, on_resume
from .spec import TINY_GPT
from .trackers import OUTPUTS as TRACKER_OUTPUTS

CONFIG_TOML, CONFIG_JSON = "config.toml", "config.json"
METRICS, SUMMARY, PLOT, CACHE = ("metrics.jsonl", "summary.json", "training.png", "data-cache")
RECORD_FILES = (CONFIG_TOML, CONFIG_JSON, METRICS, SUMMARY, PLOT, *TRACKER_OUTPUTS)


def job_fields() -> List[Field]:
    """Every field that is a flag of pipedp train."""
    return [f for _, cls in TABLES for f in cli_fields(cls)]


def _ran_as_default(f: Field) -> bool:
    """Whether a run record without this flag ran at its default: a flag newer than the record; but a flag that
    must not change on resume and that every record holds is missing only from a damaged record."""
    return not on_resume(f).refused or f.metadata.get("newer_than_records", False)


# flags that are neither recorded in config.json nor compared on --resume
IGNORED = set(NOT_SAVED) | {"command"} | {f.name for f in job_fields() if on_resume(f) is OnResume.NOT_COMPARED}


LATEST = DEFAULT_RUNS + "-latest"


def default_run_dir(resume: bool, under_torchrun: bool) -> str:
    """The run folder without --checkpoint-dir: a new runs/pipedp-train-TIME per run; with --resume, the newest
    (where runs/pipedp-train-latest points)."""
    if resume:
        try:
            return os.path.join(os.path.dirname(LATEST), os.readlink(LATEST))
        except OSError:
            raise ConfigError(
                f"--resume without --checkpoint-dir continues {LATEST}, but there is none: give the run's "
                "--checkpoint-dir",
                "checkpoint_dir",
            ) from None
    if under_torchrun:  # each rank would name its own folder
        raise ConfigError(
            "under torchrun give --checkpoint-dir: the ranks must agree on one run folder", "checkpoint_dir"
        )
    stem = f"{DEFAULT_RUNS}-{time.strftime('%Y%m%d-%H%M%S')}"
    path, n = stem, 1
    while os.path.lexists(path):  # two runs in one second
        n += 1
        path = f"{stem}-{n}"
    return path


def link_latest(path: str) -> None:
    """Point runs/pipedp-train-latest at ``path`` (replaced atomically; skipped where symlinks are not allowed)."""
    tmp = f"{LATEST}.{os.getpid()}"
    with contextlib.suppress(OSError):
        os.symlink(os.path.relpath(path, os.path.dirname(LATEST)), tmp)
        os.replace(tmp, LATEST)


class RunFolder:
    def __init__(self, path: str):
        self.path = path
        self._lock: Any = None  # the folder's FolderLock while this process holds it for the job

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def cache_dir(self) -> str:
        return self.file(CACHE)

    # ---- the checks --------------------------------------------------------------------------------
    def holds_checkpoint(self) -> bool:
        from ..train import checkpoint

        return checkpoint.exists(self.path)

    def check_free(self) -> None:
        """Refuse a folder another live job holds (its lock); a dead job's lock is free."""
        if not os.path.isdir(self.path):
            return
        from ..train.checkpoint import FolderLock

        lock = FolderLock(self.path)
        lock.acquire()
        lock.release()

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the folder's lock (refusing a live job's folder) until the block ends: taken before anything is
        written here, and handed down to the job's fit loop and ranks."""
        self._take()
        try:
            yield
        finally:
            self._lock.release()
            self._lock = None

    def _take(self) -> None:
        from ..train.checkpoint import FolderLock

        lock = FolderLock(self.path)
        lock.acquire()
        lock.hand_down()
        self._lock = lock

    def move_aside(self) -> str:
        """--overwrite: move the previous run to DIR.previous-TIME (nothing is deleted); keep the data cache.
        A held lock moves with the folder: the fresh folder is locked anew before anything is written."""
        aside = f"{self.path.rstrip(os.sep)}.previous-{time.strftime('%Y%m%d-%H%M%S')}"
        os.rename(self.path, aside)
        os.makedirs(self.path)
        if self._lock is not None:
            self._lock.release()
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(aside, "lock"))
            self._take()
        if os.path.isdir(os.path.join(aside, CACHE)):
            os.rename(os.path.join(aside, CACHE), self.cache_dir())
        return aside

    # ---- the record -----------------------------------------------------------------------------------
    def write_config(self, flags: Dict[str, Any], job, defaults: Dict[str, Any]) -> None:
        """config.toml: the flags the user set or left away from their defaults (so never both sides of an exclusive
        pair, and ``--config`` runs it again); config.json: every flag and the resolved job (what --resume compares)."""
        os.makedirs(self.path, exist_ok=True)
        with open(self.file(CONFIG_TOML), "w") as f:
            chosen = flags.get("given", ())  # set by the user, even to the default: kept
            f.write(
                dumps(
                    sections({k: v for k, v in flags.items() if k not in defaults or v != defaults[k] or k in chosen})
                )
            )
        resolved = {
            "pipeline": describe(job.pipeline),
            "privacy": describe(job.privacy),
            "fit": {k: v for k, v in describe(job.fit).items() if k != "checkpoint_key"},
            "units": job.privacy.dataset_size,
            "rows_per_unit": job.privacy.unit_rows,  # (the record's key, kept: earlier runs' records name it so)
            "seq_len": job.data.seq_len,  # as given, or chosen from the data
            "train_rows": os.path.basename(job.train_rows) if job.train_rows else None,
            "eval_rows": os.path.basename(job.eval_rows) if job.eval_rows else None,
            "model_files": model_files(job.model.name),
        }
        saved = {k: v for k, v in flags.items() if k not in IGNORED}
        with open(self.file(CONFIG_JSON), "w") as f:
            json.dump({"flags": saved, "resolved": resolved}, f, indent=1)

    def previous(self) -> Optional[dict]:
        try:
            with open(self.file(CONFIG_JSON)) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def compare(self, args, job) -> List[str]:
        """The changes since the run being resumed, as notes; refuse those the resumed run cannot take."""
        before = self.previous()
        if before is None:
            return [f"{self.path} has no readable {CONFIG_JSON}: only the checkpoint's own check compares the options"]
        now = {k: v for k, v in vars(args).items() if k not in IGNORED}
        was = before.get("flags", {})
        resolved = before.get("resolved", {})
        notes: List[str] = []
        refused: List[str] = []
        fields_by_name = {f.name: f for f in job_fields()}
        for key in sorted(set(now) | set(was)):
            if key in fields_by_name and key not in was and _ran_as_default(fields_by_name[key]):
                was[key] = field_default(fields_by_name[key], CLI_DEFAULTS)
            if key in IGNORED or now.get(key) == was.get(key):
                continue
            change = f"{flag_name(key)}: {_shown(was.get(key))} -> {_shown(now.get(key))}"
            rule = on_resume(fields_by_name[key]) if key in fields_by_name else OnResume.FREE
            if key == "model" and _moved(resolved, now[key]):
                notes.append(
                    f"{change} (the model folder moved: its config and tokenizer files are the same; the checkpoint "
                    "checks the sha256 of every frozen tensor)"
                )
            else:
                (refused if rule.refused else notes).append(f"{change} ({rule.reason})")
        for name, config in (("pipeline", job.pipeline), ("privacy", job.privacy)):
            shaping = describe(config, only_resume=True)
            for field, value in shaping.items():
                old = resolved.get(name, {}).get(field, value)
                if old != value:
                    refused.append(
                        f"{field.replace('_', ' ')}: checkpoint {old!r}, now {value!r} (it shapes the update)"
                    )
        for key, what in (("train_rows", "training rows"), ("rows_per_unit", "rows per unit"), ("units", "units")):
            new = {
                "train_rows": os.path.basename(job.train_rows) if job.train_rows else None,
                "rows_per_unit": job.privacy.unit_rows,
                "units": job.privacy.dataset_size,
            }[key]
            if key in resolved and resolved[key] != new and not refused:
                refused.append(
                    f"the {what} differ from the checkpoint's ({resolved[key]!r}, now {new!r}): the data, the "
                    "tokenizer or the options that make rows changed"
                )
        if refused:
            raise ConfigError(
                f"cannot resume the run in {self.path}: it was started with other options:\n  "
                + "\n  ".join(refused)
                + f"\nresume with the run's own options (pipedp train --config {self.file(CONFIG_TOML)} "
                f"--checkpoint-dir {self.path} --resume), or start afresh with --overwrite"
            )
        return notes

    def clear_record(self) -> None:
        """A fresh run's record replaces what an unfinished earlier run left (there was no checkpoint)."""
        for name in RECORD_FILES:
            path = self.file(name)
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            elif os.path.exists(path):
                os.unlink(path)


def _shown(value: Any) -> str:
    return "(default)" if value is None else repr(value)


def model_files(model: str) -> Optional[str]:
    """The sha256 of a model folder's files other than its weights (config, tokenizer); None for the built-in."""
    if model == TINY_GPT or not os.path.isdir(model):
        return None
    from ..data.tokenize import folder_fingerprint

    return folder_fingerprint(model)


def _moved(resolved: Dict[str, Any], model: Any) -> bool:
    """Whether the run's model folder is now at ``model``: the same files but its weights (a record written before
    model_files was recorded cannot tell: refused as another model)."""
    return resolved.get("model_files") is not None and resolved["model_files"] == model_files(str(model))


def sections(flags: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    """The flags grouped as config.toml's tables."""
    out: Dict[str, Dict[str, Any]] = {}
    placed: set = set()
    for name, cls in TABLES:
        out[name] = {f.name: flags[f.name] for f in cli_fields(cls) if f.name in flags and f.name not in placed}
        placed |= set(out[name])
    rest = {k: v for k, v in flags.items() if k not in placed and k not in IGNORED}
    if rest:
        out["other"] = rest
    return out
