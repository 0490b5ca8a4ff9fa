"""The names a Hugging Face user already types: underscores accepted (``--learning_rate``, as HfArgumentParser
takes them), Hugging Face / dp-transformers names whose meaning differs from every pipedp flag refused with the
difference (``NOT_THE_SAME``), and a "did you mean" for any other unknown flag. The aliases whose meaning is
pipedp's own are in flags.ALIASES (and main.py's job flags); docs/cli.md has the table.

Imports no torch.
"""

from __future__ import annotations

import argparse
import difflib
from typing import Dict, List, Optional, Sequence

BATCH = (
    "pipedp's --batch-size is the whole logical batch of a step (Hugging Face's per_device_train_batch_size x "
    "gradient_accumulation_steps x devices; the expected Poisson batch, q = B / N) and pipedp splits it into "
    "pipeline passes itself; --microbatch-size caps the rows of one micro-batch (what bounds memory)"
)
NOT_THE_SAME: Dict[str, str] = {  # Hugging Face / dp-transformers names that pipedp cannot take as they mean
    "--per-device-train-batch-size": "has no single equivalent: " + BATCH,
    "--gradient-accumulation-steps": "is not needed: " + BATCH,
    "--auto-find-batch-size": "is not needed: " + BATCH,
    "--logging-strategy": "does not apply: metrics.jsonl gets every step; --epsilon-every sets how often epsilon "
    "and the progress lines are written",
    "--logging-dir": "does not apply: the metrics go to RUN/metrics.jsonl and, with --report-to, to RUN/tensorboard, "
    "RUN/wandb or RUN/mlflow.db (RUN: --checkpoint-dir)",
    "--bf16": "is --precision bf16-mixed here (bf16 autocast, float32 weights and optimizer; bf16-true: the model "
    "in bf16)",
    "--fp16": "has no equivalent: pipedp has no float16 mode; use --precision bf16-mixed",
    "--resume-from-checkpoint": "is --resume here: a switch, continuing the newest checkpoint of --checkpoint-dir "
    "(without it, the latest run's): give --checkpoint-dir DIR --resume",
    "--optim": "is --optimizer here: adamw (Hugging Face's adamw_torch), adam or sgd",
    "--block-size": "has no equivalent: pipedp never packs records into blocks (packing would make one record move "
    "the others between rows); --seq-len is the length each record is truncated or padded to",
    "--do-train": "is not needed: pipedp train always trains",
    "--do-eval": "is not needed: evaluation runs with --eval-data FILE or --eval-fraction F",
    "--dataset-name": "has no equivalent: nothing is downloaded; pass a local file or save_to_disk folder to --data",
    "--push-to-hub": "has no equivalent: --export DIR writes the Hugging Face folder; push it yourself",
}
SWITCH_VALUES = {"true", "false", "yes", "no", "1", "0"}


def normalize(argv: Sequence[str]) -> List[str]:
    """``--learning_rate=1e-4`` -> ``--learning-rate=1e-4`` (pipedp's flags have no underscores); values kept."""
    out = []
    for token in argv:
        if token.startswith("--") and "_" in token.split("=", 1)[0]:
            name, eq, value = token.partition("=")
            token = name.replace("_", "-") + eq + value
        out.append(token)
    return out


def unknown_message(parser: argparse.ArgumentParser, extras: Sequence[str]) -> str:
    """What is wrong with the first unknown token and what to type instead."""
    flags = [t.split("=", 1)[0] for t in extras if t.startswith("-")]
    if not flags:  # a stray value, e.g. "--disable-tqdm True": a switch given a value
        return _stray_value(parser, extras)
    flag = flags[0]
    if flag in NOT_THE_SAME:
        return f"{flag} (a Hugging Face / dp-transformers argument) {NOT_THE_SAME[flag]}"
    known = [s for s in parser._option_string_actions if s.startswith("--")]
    close = difflib.get_close_matches(flag, known, n=3, cutoff=0.6)
    hint = f": did you mean {' or '.join(close)}?" if close else ""
    return f"unrecognized arguments: {' '.join(extras)}{hint}"


def _stray_value(parser: argparse.ArgumentParser, extras: Sequence[str]) -> str:
    if extras[0].lower() in SWITCH_VALUES:
        return (
            f"unrecognized arguments: {' '.join(extras)}: pipedp's switches take no value (give --flag alone to turn it on; "
            "leave it out to keep it off)"
        )
    return f"unrecognized arguments: {' '.join(extras)}"


def close_keys(name: str, known: Sequence[str]) -> Optional[str]:
    """A "did you mean" for a config file's unknown key."""
    close = difflib.get_close_matches(name, list(known), n=3, cutoff=0.6)
    return " or ".join(close) if close else None
