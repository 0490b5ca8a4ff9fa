"""``pipedp train --config job.toml``: every flag as a key (``seq-len`` or ``seq_len``, at the top level or in
any one-level table such as ``[privacy]``); flags on the command line override the file. The resolved
flags of a run are written back in the same form (``RUN/config.toml``), so ``--config RUN/config.toml``
runs it again.

The file's values become command-line tokens placed before the real ones, so argparse checks their
types and choices exactly as it checks flags, and a later flag wins. A key whose mutually exclusive
partner is on the command line (``steps`` in the file, ``--epochs`` given) is left out.
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any, Dict, List, Sequence

from .names import close_keys

# Hugging Face's --eval-strategy / --save-strategy and the step flags they replace (cli/preflight.py refuses both
# on one command line; a file's one gives way to the command line's other)
STRATEGY_STEPS = {"eval_strategy": "eval_every", "save_strategy": "checkpoint_every"}
NOT_SAVED = ("config", "checkpoint_key", "resume", "overwrite", "given")  # run control and secrets: never written back


class ConfigFileError(ValueError):
    pass


def _load_toml(path: str) -> Dict[str, Any]:
    try:
        import tomllib  # Python 3.11+
    except ImportError:  # pragma: no cover (Python 3.10)
        try:
            import tomli as tomllib
        except ImportError as exc:
            raise ConfigFileError("--config needs Python 3.11 (tomllib) or the tomli package") from exc
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError as exc:
        raise ConfigFileError(f"--config {path!r}: no such file") from exc
    except OSError as exc:
        raise ConfigFileError(f"--config {path!r}: {exc}") from exc
    data = data.removeprefix(b"\xef\xbb\xbf")  # a byte-order mark, as some editors write, is accepted
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ConfigFileError(
            f"--config {path!r}:{line}: byte {data[exc.start]:#04x} is not UTF-8: save the file as UTF-8"
        ) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigFileError(f"--config {path!r} is not valid TOML: {exc}") from exc


def flatten(path: str, table: Dict[str, Any]) -> Dict[str, Any]:
    """{dest: value} from the file's keys (tables flattened one level)."""
    out: Dict[str, Any] = {}
    for key, value in table.items():
        items = value.items() if isinstance(value, dict) else [(key, value)]
        for name, v in items:
            if isinstance(v, dict):
                raise ConfigFileError(f"--config {path!r}: [{key}.{name}] nests too deep: one level of tables at most")
            dest = name.replace("-", "_")
            if dest in out:
                raise ConfigFileError(f"--config {path!r}: {name!r} is given twice")
            out[dest] = v
    return out


def _actions(parser: argparse.ArgumentParser) -> Dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions if a.option_strings}


def given_on_command_line(parser: argparse.ArgumentParser, argv: Sequence[str]) -> set:
    """The dests of the flags in ``argv`` (abbreviations are off, so a flag is its whole name)."""
    by_flag = parser._option_string_actions
    return {by_flag[t.split("=", 1)[0]].dest for t in argv if t.startswith("--") and t.split("=", 1)[0] in by_flag}


def tokens(parser: argparse.ArgumentParser, path: str, argv: Sequence[str]) -> List[str]:
    """The file's keys as flags for ``parser``, minus those the command line overrides or excludes."""
    values = flatten(path, _load_toml(path))
    actions = _actions(parser)
    given = given_on_command_line(parser, argv)
    partners: Dict[str, set] = {}
    for group in parser._mutually_exclusive_groups:
        dests = {a.dest for a in group._group_actions}
        for d in dests:
            partners[d] = dests - {d}
    for strategy, every in STRATEGY_STEPS.items():  # one says when in steps, the other by Hugging Face's strategy
        partners.setdefault(strategy, set()).add(every)
        partners.setdefault(every, set()).add(strategy)
    out: List[str] = []
    for dest, value in values.items():
        if dest == "config":
            raise ConfigFileError(f"--config {path!r}: a config file cannot name another one ('config' key)")
        action = actions.get(dest) or parser._option_string_actions.get(flag_of_key(dest))  # or an alias's name
        if action is None:
            raise ConfigFileError(f"--config {path!r}: unknown key {dest.replace('_', '-')!r}" + _hint(parser, dest))
        if action.dest != dest and action.dest in values:
            raise ConfigFileError(
                f"--config {path!r}: {dest.replace('_', '-')!r} and {action.option_strings[0][2:]!r} name one flag"
            )
        dest = action.dest
        if dest in given or partners.get(dest, set()) & given:
            continue  # the command line wins
        flag = action.option_strings[0]
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            if not isinstance(value, bool):
                raise ConfigFileError(f"--config {path!r}: {dest!r} is a switch: give true or false, got {value!r}")
            if value != action.default:  # the switch (--x, or --no-x for an option on by default) sets it
                out.append(flag)
            continue
        if isinstance(value, bool):
            raise ConfigFileError(f"--config {path!r}: {dest!r} takes a value, got {value!r}")
        if isinstance(value, list):
            value = ",".join(str(v) for v in value)
        out += [flag, _text(value)]
    return out


def flag_of_key(key: str) -> str:
    return "--" + key.replace("_", "-")


def _hint(parser: argparse.ArgumentParser, dest: str) -> str:
    names = [s[2:] for s in parser._option_string_actions if s.startswith("--")]
    close = close_keys(dest.replace("_", "-"), names)
    return f": did you mean {close}?" if close else " (not a flag of this command)"


def _text(value: Any) -> str:
    if isinstance(value, float):
        return repr(value)
    return str(value)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    return json.dumps(str(value))  # a TOML basic string: JSON's escapes are TOML's


def dumps(sections: Dict[str, Dict[str, Any]]) -> str:
    """TOML text of {section: {dest: value}} (None values left out: TOML has no null)."""
    lines = ["# pipedp train --config this-file (flags on the command line override it)"]
    for section, values in sections.items():
        kept = {k: v for k, v in values.items() if v is not None and k not in NOT_SAVED}
        if not kept:
            continue
        lines.append(f"\n[{section}]")
        lines += [f"{k.replace('_', '-')} = {_toml_value(v)}" for k, v in kept.items()]
    return "\n".join(lines) + "\n"
