"""The ``pipedp`` command: ``pipedp train``, ``pipedp audit``, ``pipedp plan`` and ``pipedp schedule show``.

Parsing imports no torch (``--help`` and flag errors answer at once); ``train`` loads the
training stack only once its flags are known to be valid.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any, Dict, List, Optional

from ..config import DataConfig, FitConfig, OptimizerConfig, PipelineConfig, PrivacyConfig
from ..errors import ConfigError, PipeDPError
from .flags import ALIASES, CLI_DEFAULTS, JOB_CLASSES, add_config_flags, flag_name
from .names import normalize, unknown_message
from .plan import add_plan_flags

HELP_GROUPS = {  # pipedp train --help's argument groups, in this order
    "model": "the model, LoRA and the export",
    "data": "the records, their rows and evaluation",
    "privacy": "the DP-SGD mechanism and its accounting",
    "optimization": "the optimizer, its schedule, the batch and the run's length",
    "pipeline": "how the model is split and run",
    "run": "the run folder, checkpoints, resuming and logging",
}
CLASS_GROUPS = {
    PipelineConfig: "pipeline",
    PrivacyConfig: "privacy",
    FitConfig: "run",
    DataConfig: "data",
    OptimizerConfig: "optimization",
}
FIELD_GROUPS = {"steps": "optimization", "epochs": "optimization", "max_logical_batch": "privacy"}


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
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)  # a flag is its whole name (config files rely on it)
        super().__init__(*args, **kwargs)

    def error(self, message):  # one clear line, no usage dump, pointing to the (sub)command's own help
        print(f"pipedp: error: {message} (see '{self.prog} --help')", file=sys.stderr)
        sys.exit(2)

    def parse_known_args(self, args=None, namespace=None):
        return super().parse_known_args(normalize(sys.argv[1:] if args is None else args), namespace)

    def parse_args(self, args=None, namespace=None):
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:  # said by the subcommand that was given them, with its flags' "did you mean"
            command = _innermost(self, parsed)
            command.error(unknown_message(command, extras))
        return parsed


def _innermost(parser: argparse.ArgumentParser, parsed: argparse.Namespace) -> argparse.ArgumentParser:
    """The (sub)subcommand's parser the command line chose (``pipedp schedule show``: show's)."""
    while True:
        sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        chosen = getattr(parsed, sub.dest, None) if sub is not None else None
        if chosen not in (sub.choices if sub is not None else {}):
            return parser
        parser = sub.choices[chosen]  # type: ignore[union-attr]


STRATEGIES = ("steps", "epoch", "no")  # Hugging Face's eval_strategy / save_strategy values


def add_train_flags(t: argparse.ArgumentParser) -> None:
    group = {name: t.add_argument_group(f"{name} options", about) for name, about in HELP_GROUPS.items()}
    model, data, optimization, pipeline, run = (group[n] for n in ("model", "data", "optimization", "pipeline", "run"))
    run.add_argument(
        "--config",
        default=None,
        help="a TOML file with any of these flags as keys (e.g. seq-len = 128, in any [table]); flags given here "
        "override it. Each run writes its own to RUN/config.toml",
    )
    homes: Dict[Any, Any] = {
        **{cls: group[name] for cls, name in CLASS_GROUPS.items()},
        **{f: group[n] for f, n in FIELD_GROUPS.items()},
    }
    add_config_flags(t, JOB_CLASSES, CLI_DEFAULTS, groups=homes, aliases=ALIASES)
    model.add_argument(
        "--model",
        "--model-name-or-path",
        default="tiny-gpt",
        help="'tiny-gpt' (built in) or a local Hugging Face model folder (nothing is downloaded)",
    )
    model.add_argument(
        "--lora-r",
        type=_positive_int,
        default=None,
        help="train PEFT LoRA adapters of this rank (base weights frozen); needs a Hugging Face --model",
    )
    model.add_argument(
        "--lora-targets",
        default="q_proj,v_proj",
        help="comma-separated module names LoRA adapts (GPT-2: c_attn), or an expert bank's weights "
        "(experts.gate_up_proj, experts.down_proj)",
    )
    model.add_argument(
        "--export",
        default=None,
        help="after training, write the Hugging Face model (config + safetensors + tokenizer; with --lora-r the "
        "adapter folder, naming its base model by absolute path) to this folder; a folder holding files is refused "
        "without --overwrite",
    )
    model.add_argument(
        "--export-merged",
        default=None,
        metavar="DIR",
        help="with --lora-r: after training, write the whole model with the adapter merged into its weights (config "
        "+ safetensors + tokenizer: loads without peft) to this folder; rank 0 loads the full base model to merge",
    )
    group["privacy"].add_argument(
        "--disable-dp",
        action="store_true",
        help="a non-private baseline: the same pipeline without clipping or noise (epsilon is infinite; no "
        "accountant charge), for utility comparisons",
    )
    rate = optimization.add_mutually_exclusive_group()
    rate.add_argument("--sample-rate", type=_positive_float, default=None, help="Poisson sampling rate q")
    rate.add_argument(
        "--batch-size", type=_positive_int, default=32, help="expected logical batch size in privacy units (q = B / N)"
    )
    data.add_argument(
        "--eval-batch-size",
        "--per-device-eval-batch-size",
        type=_positive_int,
        default=None,
        help="rows per evaluation batch, over the whole pipeline (default --batch-size)",
    )
    pipeline.add_argument("--inprocess", action="store_true", help="run every stage in this one process (debugging)")
    pipeline.add_argument("--threads", type=_positive_int, default=1, help="torch threads per process")
    run.add_argument(
        "--overwrite",
        "--overwrite-output-dir",
        action="store_true",
        help="start afresh in a --checkpoint-dir that holds another run: that run is moved aside to DIR.previous-TIME",
    )
    run.add_argument(
        "--no-checkpoint",
        action="store_true",
        help="save no checkpoints (the run cannot be resumed); the run's config, metrics and plot still go to "
        "--checkpoint-dir",
    )
    data.add_argument(
        "--eval-strategy",
        "--evaluation-strategy",
        choices=STRATEGIES,
        default="steps",
        help="when to evaluate during training: steps (every --eval-every), epoch (every epoch's steps: ceil(1 / q) "
        "Poisson steps), no (only at the end, when there is evaluation data)",
    )
    run.add_argument(
        "--save-strategy",
        choices=STRATEGIES,
        default="steps",
        help="when to checkpoint: steps (every --checkpoint-every), epoch (every epoch's steps), no (as "
        "--no-checkpoint)",
    )
    run.add_argument(
        "--report-to",
        default="none",
        metavar="none|all|LIST",
        help="also log the metrics to trackers: a comma-separated list of tensorboard (RUN/tensorboard), wandb "
        "(WANDB_MODE=offline works offline), mlflow (MLFLOW_TRACKING_URI, default sqlite:///RUN/mlflow.db); all: "
        "every one installed. Each needs its package",
    )
    run.add_argument(
        "--epsilon-every",
        "--logging-steps",
        type=_positive_int,
        default=None,
        help="steps between epsilon evaluations and progress lines (metrics.jsonl gets every step; default: about "
        "20 per run, and always the last step; the prv accountant takes ~0.1 s each)",
    )
    run.add_argument("--no-progress", "--disable-tqdm", action="store_true", help="no progress bars")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="pipedp", description="DP-SGD on micro-batched pipeline-parallel models")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    t = sub.add_parser("train", help="DP training with pipeline stages (default: a tiny GPT on a generated corpus)")
    add_train_flags(t)

    a = sub.add_parser("audit", help="one-run privacy audit: empirical epsilon lower bound vs the accountant")
    a.add_argument(
        "--kind",
        default="whitebox",
        choices=["whitebox", "blackbox"],
        help="whitebox: gradient canaries on their own coordinates; blackbox: canary sequences on the GPT job",
    )
    a.add_argument("--canaries", type=_positive_int, default=1000, help="canaries, each included with probability 1/2")
    a.add_argument("--steps", type=_positive_int, default=None, help="DP steps (default: whitebox 10, blackbox 100)")
    a.add_argument("--sample-rate", type=_positive_float, default=None, help="default: whitebox 0.5, blackbox 0.01")
    a.add_argument("--noise-multiplier", type=float, default=3.0, help="sigma of the audited run")
    a.add_argument("--max-grad-norm", type=_positive_float, default=1.0, help="clipping norm C of the audited run")
    a.add_argument("--lr", type=_positive_float, default=0.1, help="SGD learning rate of the audited run")
    a.add_argument(
        "--delta", type=_positive_float, default=1e-5, help="delta of the accountant's epsilon and of the bound"
    )
    a.add_argument("--confidence", type=_positive_float, default=0.95, help="confidence of the epsilon lower bound")
    a.add_argument("--stages", type=_positive_int, default=2, help="pipeline stages (one process each)")
    a.add_argument("--microbatches", type=_positive_int, default=4, help="micro-batches per step")
    a.add_argument("--seed", type=int, default=0, help="seed of the canaries, the sampling and the noise")
    a.add_argument("--inprocess", action="store_true", help="every stage in this process")
    a.add_argument("--png", default=None, help="draw the score histograms (included vs excluded) here")
    a.add_argument("--json", default=None, help="write the whole result here")

    pl = sub.add_parser("plan", help="predict each stage's peak memory (model built on meta, one pass simulated)")
    add_plan_flags(pl)

    s = sub.add_parser(
        "schedule", help="inspect pipeline schedules: pipedp schedule show NAME --stages S --microbatches M"
    )
    ssub = s.add_subparsers(dest="schedule_command", required=True, parser_class=_Parser)
    show = ssub.add_parser("show", help="per-rank timeline, bubble fraction and peak in-flight micro-batches")
    show.add_argument("name", help="gpipe, 1f1b, dp-zb or dp-zb-2x")
    show.add_argument("--stages", type=_positive_int, required=True)
    show.add_argument("--microbatches", type=_positive_int, required=True)
    show.add_argument("--costs", default="F=1,I=1,W=1", help="relative action costs, e.g. F=1,I=2,W=1")
    show.add_argument("--png", default=None, help="also draw the timeline into this PNG file")
    return parser


def train_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    return parser._subparsers._group_actions[0].choices["train"]  # type: ignore[union-attr,index]


def train_defaults() -> dict:
    """{dest: default} of ``pipedp train``'s flags."""
    return {a.dest: a.default for a in train_parser(build_parser())._actions if a.option_strings}


def parse(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """The parsed command line; for ``train --config FILE``, the file's keys under the command line's flags."""
    argv = normalize(sys.argv[1:] if argv is None else argv)  # (the config file's keys are matched to these)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command != "train":
        return args
    if args.config is not None:
        from .configfile import ConfigFileError, tokens

        at = argv.index("train")
        try:
            from_file = tokens(train_parser(parser), args.config, argv[at + 1 :])
        except ConfigFileError as exc:
            train_parser(parser).error(str(exc))
        argv = argv[: at + 1] + from_file + argv[at + 1 :]
        args = parser.parse_args(argv)
    # the train flags the user set (on the command line or in the file), even to their default value: an explicit
    # ``--max-grad-norm 1.0`` is a choice, not a default left alone
    from .configfile import given_on_command_line

    args.given = frozenset(given_on_command_line(train_parser(parser), argv[argv.index("train") + 1 :]))
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse(argv)
    from .signals import Terminated, exit_code, raising, signal_name

    try:
        with raising():  # SIGTERM stops like SIGINT: through the normal finally paths
            if args.command == "schedule":
                from .schedule_view import show

                print(show(args.name, args.stages, args.microbatches, args.costs, args.png))
                return 0
            if args.command == "plan":
                from .plan import run as run_plan

                return run_plan(args)
            if args.command == "audit":
                from .audit import run as run_audit_command

                return run_audit_command(args)
            from .job import run

            return run(args, train_defaults())
    except (PipeDPError, ValueError, FileNotFoundError, ImportError) as exc:
        print(f"pipedp: error: {message(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        how = signal_name(exc)
        stopped = "stopped" if isinstance(exc, Terminated) else "interrupted"
        print(
            f"pipedp: {stopped} ({how}): the newest complete checkpoint, if any, is kept; continue with --resume",
            file=sys.stderr,
        )
        return exit_code(exc)


def message(exc: BaseException) -> str:
    """The whole message (every line), with a config field named as its flag."""
    text = str(exc).strip() or type(exc).__name__
    if isinstance(exc, ConfigError) and exc.field and text.startswith(exc.field + ":"):
        text = flag_name(exc.field) + text[len(exc.field) :]
    return text


if __name__ == "__main__":
    sys.exit(main())
