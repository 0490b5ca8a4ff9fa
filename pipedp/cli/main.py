"""The ``pipedp`` command: ``pipedp train``, ``pipedp audit``, ``pipedp plan`` and ``pipedp schedule show``.

Parsing imports no torch (``--help`` and flag errors answer at once); ``train`` loads the
training stack only once its flags are known to be valid.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Dict, List, Optional

from ..config import FitConfig, PipelineConfig, PrivacyConfig
from ..errors import ConfigError, PipeDPError
from .flags import ALIASES, CLI_DEFAULTS, add_config_flags, flag_name
from .names import normalize, unknown_message
from .options import JOB_CLASSES, positive_float, positive_int
from .plan import add_plan_flags

HELP_GROUPS = {  # pipedp train --help's argument groups, in this order
    "model": "the model, LoRA and the export",
    "data": "the records, their rows and evaluation",
    "privacy": "the DP-SGD mechanism and its accounting",
    "optimization": "the optimizer, its schedule, the batch and the run's length",
    "pipeline": "how the model is split and run",
    "run": "the run folder, checkpoints, resuming and logging",
}
CLASS_GROUPS = {PipelineConfig: "pipeline", PrivacyConfig: "privacy", FitConfig: "run"}  # (the job's: on each field)
FIELD_GROUPS = {"steps": "optimization", "epochs": "optimization", "max_logical_batch": "privacy"}


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


def add_train_flags(t: argparse.ArgumentParser) -> None:
    group = {name: t.add_argument_group(f"{name} options", about) for name, about in HELP_GROUPS.items()}
    group["run"].add_argument(
        "--config",
        default=None,
        help="a TOML file with any of these flags as keys (e.g. seq-len = 128, in any [table]); flags given here "
        "override it. Each run writes its own to RUN/config.toml",
    )
    homes: Dict[Any, Any] = {
        **group,
        **{cls: group[name] for cls, name in CLASS_GROUPS.items()},
        **{f: group[n] for f, n in FIELD_GROUPS.items()},
    }
    add_config_flags(t, JOB_CLASSES, CLI_DEFAULTS, groups=homes, aliases=ALIASES)


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
    a.add_argument("--canaries", type=positive_int, default=1000, help="canaries, each included with probability 1/2")
    a.add_argument("--steps", type=positive_int, default=None, help="DP steps (default: whitebox 10, blackbox 100)")
    a.add_argument("--sample-rate", type=positive_float, default=None, help="default: whitebox 0.5, blackbox 0.01")
    a.add_argument("--noise-multiplier", type=float, default=3.0, help="sigma of the audited run")
    a.add_argument("--max-grad-norm", type=positive_float, default=1.0, help="clipping norm C of the audited run")
    a.add_argument("--lr", type=positive_float, default=0.1, help="SGD learning rate of the audited run")
    a.add_argument(
        "--delta", type=positive_float, default=1e-5, help="delta of the accountant's epsilon and of the bound"
    )
    a.add_argument("--confidence", type=positive_float, default=0.95, help="confidence of the epsilon lower bound")
    a.add_argument("--stages", type=positive_int, default=2, help="pipeline stages (one process each)")
    a.add_argument("--microbatches", type=positive_int, default=4, help="micro-batches per step")
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
    show.add_argument("--stages", type=positive_int, required=True)
    show.add_argument("--microbatches", type=positive_int, required=True)
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
