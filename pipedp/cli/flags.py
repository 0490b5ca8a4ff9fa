"""Command-line flags generated from the configuration's fields (one list of options).

A field of PipelineConfig / PrivacyConfig marked ``cli`` becomes ``--field-name`` with the
field's help, choices and default; fields of one ``exclusive`` group are mutually
exclusive. ``configs_from_args`` turns the parsed flags back into the two configs.

Imports no torch: ``pipedp schedule show`` stays light.
"""

from __future__ import annotations

import argparse
import typing
from dataclasses import MISSING, Field, fields
from typing import Any, Dict, Tuple, Type

from ..config import PipelineConfig, PrivacyConfig

CONFIG_CLASSES = (PipelineConfig, PrivacyConfig)
DEFAULT_STEPS = 300  # pipedp train without --steps or --epochs


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


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


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    groups: Dict[str, Any] = {}
    flagged = [(cls, f) for cls in CONFIG_CLASSES for f in cli_fields(cls)]
    # the flags of one mutually exclusive group must be adjacent, or argparse cannot print the usage
    flagged.sort(key=lambda cf: cf[1].metadata["exclusive"] or "")
    for cls, f in flagged:
        kind = _scalar_type(cls, f)
        target = parser
        group = f.metadata["exclusive"]
        if group:
            if group not in groups:  # (setdefault would make an empty group every time)
                groups[group] = parser.add_mutually_exclusive_group()
            target = groups[group]
        default = None if f.default is MISSING else f.default
        help_text = f.metadata["help"] + (f" (default {default})" if default not in (None, False) else "")
        if kind is bool:
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


def configs_from_args(args: argparse.Namespace, **extra: Any) -> Tuple[PipelineConfig, PrivacyConfig]:
    """The configs the flags describe; ``extra`` sets fields that are not flags (e.g. sample_rate)."""

    def values(cls: Type) -> Dict[str, Any]:
        names = {f.name for f in fields(cls)}
        out = {f.name: getattr(args, f.name) for f in cli_fields(cls)}
        out.update({k: v for k, v in extra.items() if k in names})
        return out

    return PipelineConfig(**values(PipelineConfig)), PrivacyConfig(**values(PrivacyConfig))
