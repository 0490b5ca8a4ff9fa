"""The ``pipedp`` command: ``pipedp train`` and ``pipedp schedule show``.

Parsing imports no torch; ``train`` loads the training stack only when it runs.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import List, Optional

from ..errors import ConfigError, PipeDPError
from .flags import DEFAULT_STEPS, add_config_flags, flag_name

DEFAULT_CHECKPOINTS = os.path.join("runs", "pipedp-train")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be > 0 and finite, got {value}")
    return value


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one clear line, no usage dump
        print(f"pipedp: error: {message} (see '{self.prog} --help')", file=sys.stderr)
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="pipedp", description="DP-SGD on micro-batched pipeline-parallel models")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    t = sub.add_parser("train", help="DP training with pipeline stages (default: a tiny GPT on a generated corpus)")
    add_config_flags(t)  # --stages, --microbatches, --schedule, --noise-multiplier, ... from the config fields
    t.add_argument("--model", default="tiny-gpt", help="'tiny-gpt' (built in) or a local Hugging Face model folder")
    t.add_argument("--data", default=None, help="local .txt or .jsonl ('text' field) file; default: generated corpus")
    rate = t.add_mutually_exclusive_group()
    rate.add_argument("--sample-rate", type=_positive_float, default=None, help="Poisson sampling rate q")
    rate.add_argument("--batch-size", type=_positive_int, default=32, help="expected logical batch size (q = B / N)")
    length = t.add_mutually_exclusive_group()
    length.add_argument("--steps", type=_positive_int, default=None, help=f"total DP steps (default {DEFAULT_STEPS})")
    length.add_argument("--epochs", type=_positive_float, default=None, help="epochs: ceil(epochs / q) steps")
    t.add_argument("--lr", type=_positive_float, default=3e-3, help="Adam learning rate")
    t.add_argument("--seq-len", type=_positive_int, default=32)
    t.add_argument("--checkpoint-dir", default=DEFAULT_CHECKPOINTS)
    t.add_argument("--checkpoint-every", type=_positive_int, default=50)
    t.add_argument(
        "--export",
        default=None,
        help="after training, write the Hugging Face model (config + safetensors + tokenizer) to this folder",
    )
    t.add_argument(
        "--lora-r",
        type=_positive_int,
        default=None,
        help="train PEFT LoRA adapters of this rank (base weights frozen); needs a Hugging Face --model",
    )
    t.add_argument(
        "--lora-targets", default="q_proj,v_proj", help="comma-separated module names LoRA adapts (GPT-2: c_attn)"
    )
    t.add_argument("--keep-last", type=_positive_int, default=3, help="keep only the newest N checkpoints")
    t.add_argument(
        "--checkpoint-key",
        default=None,
        help="HMAC key that signs checkpoints and refuses unsigned or altered ones on --resume "
        "(visible to other users in the process list: prefer the PIPEDP_CHECKPOINT_KEY variable)",
    )
    t.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --checkpoint-dir")
    t.add_argument("--inprocess", action="store_true", help="run every stage in this one process (debugging)")
    t.add_argument("--threads", type=_positive_int, default=1, help="torch threads per process")
    t.add_argument("--no-progress", action="store_true")

    a = sub.add_parser("audit", help="one-run privacy audit: empirical epsilon lower bound vs the accountant")
    a.add_argument(
        "--kind",
        default="whitebox",
        choices=["whitebox", "blackbox"],
        help="whitebox: gradient canaries on their own coordinates; blackbox: canary sequences on the GPT job",
    )
    a.add_argument("--canaries", type=_positive_int, default=1000)
    a.add_argument("--steps", type=_positive_int, default=None, help="DP steps (default: whitebox 10, blackbox 100)")
    a.add_argument("--sample-rate", type=_positive_float, default=None, help="default: whitebox 0.5, blackbox 0.01")
    a.add_argument("--noise-multiplier", type=float, default=3.0)
    a.add_argument("--max-grad-norm", type=_positive_float, default=1.0)
    a.add_argument("--lr", type=_positive_float, default=0.1)
    a.add_argument("--delta", type=_positive_float, default=1e-5)
    a.add_argument("--confidence", type=_positive_float, default=0.95)
    a.add_argument("--stages", type=_positive_int, default=2)
    a.add_argument("--microbatches", type=_positive_int, default=4)
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--inprocess", action="store_true", help="every stage in this process")
    a.add_argument("--png", default=None, help="draw the score histograms (included vs excluded) here")
    a.add_argument("--json", default=None, help="write the whole result here")

    s = sub.add_parser("schedule", help="inspect pipeline schedules")
    ssub = s.add_subparsers(dest="schedule_command", required=True, parser_class=_Parser)
    show = ssub.add_parser("show", help="per-rank timeline, bubble fraction and peak in-flight micro-batches")
    show.add_argument("name", help="gpipe, 1f1b, dp-zb or dp-zb-2x")
    show.add_argument("--stages", type=_positive_int, required=True)
    show.add_argument("--microbatches", type=_positive_int, required=True)
    show.add_argument("--costs", default="F=1,I=1,W=1", help="relative action costs, e.g. F=1,I=2,W=1")
    show.add_argument("--png", default=None, help="also draw the timeline into this PNG file")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "schedule":
            from .schedule_view import show

            print(show(args.name, args.stages, args.microbatches, args.costs, args.png))
            return 0
        if args.command == "audit":
            from .audit import run as run_audit_command

            return run_audit_command(args)
        from .job import run

        return run(args)
    except (PipeDPError, ValueError, FileNotFoundError, ImportError) as exc:
        print(f"pipedp: error: {_message(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("pipedp: interrupted", file=sys.stderr)
        return 130


def _message(exc: Exception) -> str:
    """The whole message (every line), with a config field named as its flag."""
    text = str(exc).strip() or type(exc).__name__
    if isinstance(exc, ConfigError) and exc.field and text.startswith(exc.field + ":"):
        text = flag_name(exc.field) + text[len(exc.field) :]
    return text


if __name__ == "__main__":
    sys.exit(main())
