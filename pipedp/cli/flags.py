"""Command-line flags generated from the configuration's fields (one list of options).

A field of a config dataclass marked ``cli`` becomes ``--field-name`` with the field's help,
choices and default; fields of one ``exclusive`` group are mutually exclusive. The classes are
PipelineConfig / PrivacyConfig (the trainer's), FitConfig (the fit loop's) and DataConfig /
OptimizerConfig (``pipedp train``'s job); ``CLI_DEFAULTS`` gives the command line's own defaults
where they differ from the Python API's. ``config_from_args`` turns the parsed flags back into a
config.

Imports no torch: ``--help`` and flag errors stay fast.
"""

from __future__ import annotations

import argparse
import os
import typing
from dataclasses import MISSING, Field, fields
from typing import Any, Dict, Optional, Sequence, Type, TypeVar

from ..config import DataConfig, FitConfig, OptimizerConfig, PipelineConfig, PrivacyConfig

CONFIG_CLASSES = (PipelineConfig, PrivacyConfig)  # the trainer's options (the default of add_config_flags)
JOB_CLASSES = (PipelineConfig, PrivacyConfig, FitConfig, DataConfig, OptimizerConfig)  # pipedp train's
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
}

C = TypeVar("C")


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def flag_of(f: Field) -> str:
    """The flag a config field generates: ``--name``, or ``--no-name`` for an option on by default."""
    if f.default is True:
        return "--no-" + f.name.replace("_", "-")
    return flag_name(f.name)


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
    groups: Optional[Dict[Type, Any]] = None,
) -> None:
    """One flag per ``cli`` field of ``classes``; ``defaults`` overrides a field's default on the command
    line; ``skip`` names fields the caller defines itself; ``groups`` puts each class's flags in an
    argument group (for --help)."""
    defaults = defaults or {}
    exclusive: Dict[str, Any] = {}
    flagged = [(cls, f) for cls in classes for f in cli_fields(cls) if f.name not in skip]
    # the flags of one mutually exclusive group must be adjacent, or argparse cannot print the usage
    flagged.sort(key=lambda cf: cf[1].metadata["exclusive"] or "")
    for cls, f in flagged:
        kind = _scalar_type(cls, f)
        home = (groups or {}).get(cls, parser)
        target = home
        group = f.metadata["exclusive"]
        if group:
            if group not in exclusive:  # (setdefault would make an empty group every time)
                exclusive[group] = home.add_mutually_exclusive_group()
            target = exclusive[group]
        default = defaults.get(f.name, None if f.default is MISSING else f.default)
        help_text = f.metadata["help"] + HELP_NOTES.get(f.name, "")
        if default not in (None, False):
            help_text += f" (default {default if default != '' else repr('')})"
        if kind is bool and f.default is True:  # on by default: the flag turns it off
            help_text = f.metadata["help"] + " (on by default: this turns it off)"
            target.add_argument(flag_of(f), dest=f.name, action="store_false", help=help_text)
        elif kind is bool:
            target.add_argument(flag_name(f.name), dest=f.name, action="store_true", help=help_text)
        else:
            target.add_argument(
                flag_name(f.name),
                dest=f.name,
                type=kind,
                default=default,
                choices=f.metadata["choices"],
                help=help_text,
            )


def config_from_args(cls: Type[C], args: argparse.Namespace, **extra: Any) -> C:
    """The ``cls`` config the flags describe; ``extra`` sets fields that are not flags (e.g. sample_rate)."""
    names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    values = {f.name: getattr(args, f.name) for f in cli_fields(cls) if hasattr(args, f.name)}
    values.update({k: v for k, v in extra.items() if k in names})
    return cls(**values)
