"""Command-line flags generated from the configuration's fields (one list of options).

A field of a config dataclass marked ``cli`` becomes ``--field-name`` with the field's help,
choices and default; fields of one ``exclusive`` group are mutually exclusive. The classes are
PipelineConfig / PrivacyConfig (the trainer's), FitConfig (the fit loop's) and the job's own
(cli/options.py); a field's metadata may also name its ``--help`` group and an argparse ``parse``
and ``metavar``. ``CLI_DEFAULTS`` gives the command line's own defaults where they differ from the
Python API's. ``config_from_args`` turns the parsed flags back into a
config.

Imports no torch: ``--help`` and flag errors stay fast.
"""

from __future__ import annotations

import argparse
import os
import typing
from dataclasses import MISSING, Field, fields
from typing import Any, Dict, Optional, Sequence, Tuple, Type, TypeVar

from ..config import PipelineConfig, PrivacyConfig

CONFIG_CLASSES = (PipelineConfig, PrivacyConfig)  # the trainer's options (the default of add_config_flags)
DEFAULT_STEPS = 300  # pipedp train without --steps or --epochs
DEFAULT_RUNS = os.path.join("runs", "pipedp-train")  # without --checkpoint-dir: DEFAULT_RUNS-TIME, and -latest
CLI_DEFAULTS: Dict[str, Any] = {  # FitConfig's fields as pipedp train sets them
    "checkpoint_every": 50,
    "keep_last": 3,
}
HELP_NOTES: Dict[str, str] = {
    "steps": f" (default {DEFAULT_STEPS} without --epochs)",
    "checkpoint_dir": "; the run folder: config, metrics, plots and the data cache are written there too "
    f"(default: a new {DEFAULT_RUNS}-TIME per run, linked as {DEFAULT_RUNS}-latest, which --resume continues)",
    "checkpoint_key": " (visible to other users in the process list: prefer the PIPEDP_CHECKPOINT_KEY variable)",
    "max_grad_norm": "; the per-sample clipping norm (dp-transformers' per_sample_max_grad_norm), not Hugging Face's "
    "max_grad_norm (a clip of the batch's summed gradient, which DP-SGD does not use)",
    "seed": "; unlike Hugging Face's seed (42 unless given), a seed given here also fixes the DP noise",
}
# Hugging Face TrainingArguments / dp-transformers names that mean what the pipedp flag means (docs/cli.md's table
# lists the differences in default); names whose meaning differs are refused with the difference (main.py)
ALIASES: Dict[str, Tuple[str, ...]] = {
    "lr": ("--learning-rate",),
    "steps": ("--max-steps",),
    "epochs": ("--num-train-epochs",),
    "checkpoint_dir": ("--output-dir",),
    "checkpoint_every": ("--save-steps",),
    "keep_last": ("--save-total-limit",),
    "eval_every": ("--eval-steps",),
    "eval_data": ("--validation-file",),
    "data": ("--train-file",),
    "delta": ("--target-delta",),
    "max_grad_norm": ("--per-sample-max-grad-norm",),
    "lr_schedule": ("--lr-scheduler-type",),
    "activation_checkpointing": ("--gradient-checkpointing",),
    "seq_len": ("--max-seq-length",),
    "model": ("--model-name-or-path",),
    "eval_batch_size": ("--per-device-eval-batch-size",),
    "eval_strategy": ("--evaluation-strategy",),
    "overwrite": ("--overwrite-output-dir",),
    "epsilon_every": ("--logging-steps",),
    "no_progress": ("--disable-tqdm",),
}

C = TypeVar("C")


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def flag_of(f: Field) -> str:
    """The flag a config field generates: ``--name``, or ``--no-name`` for an option on by default."""
    if f.default is True:
        return "--no-" + f.name.replace("_", "-")
    return flag_name(f.name)


def field_default(f: Field, defaults: Dict[str, Any]) -> Any:
    """A field's value when its flag is not given: ``defaults``' (the command line's own), else the field's."""
    return defaults.get(f.name, None if f.default is MISSING else f.default)


def cli_fields(cls: Type) -> list:
    return [f for f in fields(cls) if f.metadata["cli"]]


def _scalar_type(cls: Type, f: Field) -> type:
    """int / float / str / bool from the field's annotation (Optional[X] -> X, Union[X, ...] -> X)."""
    hint = typing.get_type_hints(cls)[f.name]
    while typing.get_origin(hint) is typing.Union:
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if hint not in (int, float, str, bool):
        raise TypeError(f"config field {f.name} of type {hint} cannot be a CLI flag")
    return hint


def add_config_flags(
    parser: argparse.ArgumentParser,
    classes: Sequence[Type] = CONFIG_CLASSES,
    defaults: Optional[Dict[str, Any]] = None,
    skip: Sequence[str] = (),
    groups: Optional[Dict[Any, Any]] = None,
    aliases: Optional[Dict[str, Tuple[str, ...]]] = None,
) -> None:
    """One flag per ``cli`` field of ``classes``; ``defaults`` overrides a field's default on the command
    line; ``skip`` names fields the caller defines itself; ``groups`` puts each field's flag in an argument
    group (for --help), keyed by the group its field names, by field name or else by class; ``aliases``: more
    names of a field's flag."""
    defaults = defaults or {}
    exclusive: Dict[str, Any] = {}
    flagged = [(cls, f) for cls in classes for f in cli_fields(cls) if f.name not in skip]
    # the flags of one mutually exclusive group must be adjacent, or argparse cannot print the usage
    flagged.sort(key=lambda cf: cf[1].metadata["exclusive"] or "")
    for cls, f in flagged:
        kind = _scalar_type(cls, f)
        homes, named = groups or {}, f.metadata.get("group")
        if homes and named is not None and named not in homes and f.name not in homes and cls not in homes:
            raise KeyError(f"{flag_of(f)}: its field names the help group {named!r}, which this parser lacks")
        home = homes.get(named) or homes.get(f.name) or homes.get(cls, parser)
        names = (flag_of(f), *(aliases or {}).get(f.name, ()))
        target = home
        group = f.metadata["exclusive"]
        if group:
            if group not in exclusive:  # (setdefault would make an empty group every time)
                exclusive[group] = home.add_mutually_exclusive_group()
            target = exclusive[group]
        default = field_default(f, defaults)
        help_text = f.metadata["help"] + HELP_NOTES.get(f.name, "")
        if default not in (None, False):
            help_text += f" (default {default if default != '' else repr('')})"
        if kind is bool and f.default is True:  # on by default: the flag turns it off
            help_text = f.metadata["help"] + " (on by default: this turns it off)"
            target.add_argument(*names, dest=f.name, action="store_false", help=help_text)
        elif kind is bool:
            target.add_argument(*names, dest=f.name, action="store_true", help=help_text)
        else:
            target.add_argument(
                *names,
                dest=f.name,
                type=f.metadata.get("parse") or kind,
                default=default,
                choices=f.metadata["choices"],
                metavar=f.metadata.get("metavar"),
                help=help_text,
            )


def config_from_args(cls: Type[C], args: argparse.Namespace, **extra: Any) -> C:
    """The ``cls`` config the flags describe; ``extra`` sets fields that are not flags (e.g. sample_rate)."""
    names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    values = {f.name: getattr(args, f.name) for f in cli_fields(cls) if hasattr(args, f.name)}
    values.update({k: v for k, v in extra.items() if k in names})
    return cls(**values)
