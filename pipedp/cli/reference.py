"""The command-line reference (docs/cli-reference.md), rendered from the ``pipedp`` parser itself.

Every subcommand (``pipedp train``, ``pipedp audit``, ``pipedp schedule show``, ...) with every
flag: its value, default, choices, mutually exclusive partners and help text, as argparse holds
them, so the reference cannot drift from the parser. ``tests/test_docs.py`` checks that the file
equals ``render()``; after changing a flag, regenerate it:

    python -m pipedp.cli.reference > docs/cli-reference.md

Imports no torch (only the parser's modules).
"""

from __future__ import annotations

import argparse
import sys
from typing import Dict, List, Optional

from .main import build_parser

COMMAND = "python -m pipedp.cli.reference > docs/cli-reference.md"
HEADER = (
    "# `pipedp` command-line reference\n\n"
    f"<!-- generated from the parser by `{COMMAND}`; do not edit (tests/test_docs.py checks it) -->\n\n"
    "Every subcommand and flag, as `pipedp ... --help` knows them. Every flag of `pipedp train` but `--config` is "
    "generated from a config field (the trainer's in `pipedp/config.py`, the job's own in "
    "`pipedp/cli/options.py`); any of them may also be a key of the `--config` TOML file."
)
ARGPARSE_GROUPS = {"positional arguments": "arguments", "options": "options", "optional arguments": "options"}


def _cell(text: str) -> str:
    """One markdown table cell: no newlines, pipes escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _code(text: str) -> str:
    return f"`{text}`" if text else ""


def _help(action: argparse.Action, prog: str) -> str:
    text = action.help or ""
    if "%" in text:  # argparse's own %(default)s etc.
        params = dict(vars(action), prog=prog)
        params["choices"] = ", ".join(map(str, action.choices)) if action.choices else ""
        text = text % params
    return text


def _value(action: argparse.Action) -> str:
    """What the flag takes: a switch, one of its choices, or its type."""
    if action.nargs == 0:
        return "switch"
    if action.choices:
        return " | ".join(_code(str(c)) for c in action.choices)
    kind = action.type
    if kind is None or kind is str:
        name = "text"
    elif kind in (int, float):
        name = kind.__name__
    else:  # a converter: positive_int -> "positive int", parse_bytes -> "bytes"
        name = getattr(kind, "__name__", type(kind).__name__).strip("_")
        name = name.removeprefix("parse_").replace("_", " ")
    if action.nargs not in (None, 1):
        name += f" (nargs {action.nargs})"
    return name


def _default(action: argparse.Action) -> str:
    if action.required:
        return "required"
    if isinstance(action, argparse._StoreTrueAction):
        return "off"
    if isinstance(action, argparse._StoreFalseAction):
        return "on (the flag turns it off)"
    if action.default is None or action.default == argparse.SUPPRESS:
        return ""
    return _code(repr(action.default) if action.default == "" else str(action.default))


def _exclusive(parser: argparse.ArgumentParser) -> Dict[argparse.Action, List[str]]:
    others: Dict[argparse.Action, List[str]] = {}
    for group in parser._mutually_exclusive_groups:
        for action in group._group_actions:
            others[action] = [_name(a) for a in group._group_actions if a is not action]
    return others


def _name(action: argparse.Action) -> str:
    if action.option_strings:
        return ", ".join(action.option_strings)
    return " ".join(action.metavar) if isinstance(action.metavar, tuple) else (action.metavar or action.dest)


def _subcommands(parser: argparse.ArgumentParser) -> Optional[argparse._SubParsersAction]:
    return next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)


def _table(parser: argparse.ArgumentParser, actions: List[argparse.Action], prog: str) -> List[str]:
    exclusive = _exclusive(parser)
    rows = ["| flag | value | default | description |", "| --- | --- | --- | --- |"]
    for action in actions:
        text = _help(action, prog)
        if action in exclusive:
            partners = ", ".join(f"`{n}`" for n in exclusive[action])
            text = (text + "; " if text else "") + f"not with {partners}"
        cells = [_code(_name(action)), _value(action), _default(action), text]
        rows.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return rows


def _section(parser: argparse.ArgumentParser, prog: str, summary: str, level: int) -> List[str]:
    lines = ["#" * level + f" `{prog}`", ""]
    about = parser.description or summary
    if about:
        lines += [about, ""]
    sub = _subcommands(parser)
    if sub is not None:
        helps = {a.dest: a.help or "" for a in sub._choices_actions}
        lines += ["| subcommand | what it does |", "| --- | --- |"]
        lines += [f"| `{prog} {name}` | {_cell(helps.get(name, ''))} |" for name in sub.choices]
        lines.append("")
    for group in parser._action_groups:
        actions = [
            a
            for a in group._group_actions
            if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)) and a.help != argparse.SUPPRESS
        ]
        if not actions:
            continue
        title = ARGPARSE_GROUPS.get(group.title or "", group.title or "options")
        lines += [f"**{title}**", "", *_table(parser, actions, prog), ""]
    if sub is not None:
        helps = {a.dest: a.help or "" for a in sub._choices_actions}
        for name, child in sub.choices.items():
            lines += _section(child, f"{prog} {name}", helps.get(name, ""), min(level + 1, 6))
    return lines


def render() -> str:
    """The whole reference, as docs/cli-reference.md holds it (ends with one newline)."""
    parser = build_parser()
    body = _section(parser, parser.prog, "", 2)
    return HEADER + "\n\n" + "\n".join(body).rstrip() + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
