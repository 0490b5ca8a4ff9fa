"""The docs stay true: README.md and docs/*.md are checked against the code.

- every ```python block runs: each file's blocks in order, in one namespace, in a fresh temporary working
  directory, in a subprocess with a time limit (``PIPEDP_DOCS_TIMEOUT`` seconds per file, default 90);
- every ``pipedp ...`` / ``python3 -m pipedp ...`` line of a ```bash / ```sh / ```shell / ```console block is
  parsed by the real parser (``build_parser().parse_args``), not run: a removed or misspelled flag fails;
  ``python -m bench.X`` names an existing module, and its flags parse where the module exposes a parser
  (``build_parser()`` or ``parse_args(argv)``); ``torchrun ... script.py`` / ``torchrun ... -m module`` is
  parsed by torchrun's own parser and names an existing script or module; ``python script.py`` and
  ``pytest path`` name existing files; other ``python -m pipedp.* / tests.* / schedules.*`` modules exist;
- docs/cli-reference.md equals ``pipedp.cli.reference.render()``, and README.md's support table (if it has
  the markers) equals ``tests/support_table.py``'s.

Directives, as HTML comments on the lines just before a fence (invisible when rendered):

    <!-- no-run: why -->            the block is not run or parsed (a reason is required)
    <!-- run-with: OLD => NEW -->   the block runs with OLD replaced by NEW (OLD must occur in it), e.g.
                                    <!-- run-with: steps=1000 => steps=3 -->

In a shell block, ``[--flag value]`` (an optional part, as in a usage line) is parsed as if given, ``...``
is dropped, ``NAME=value`` prefixes, ``# comments``, redirections and ``&&`` / ``|`` / ``;`` chains are
understood; in a ```console block with ``$ `` prompts, only the prompt lines are commands.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import importlib
import importlib.util
import io
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence, Tuple

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT = float(os.environ.get("PIPEDP_DOCS_TIMEOUT", "90"))
SHELL = {"bash", "sh", "shell", "console", "zsh", "shell-session"}
PYTHON = {"python", "py", "python3"}
LOCAL_PACKAGES = ("pipedp", "bench", "tests", "schedules", "examples")


def doc_files() -> List[str]:
    """README.md and docs/*.md, relative to the repository root (whichever exist)."""
    found = ["README.md"] if os.path.exists(os.path.join(ROOT, "README.md")) else []
    return found + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))


# ---- markdown ------------------------------------------------------------------------------------
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`]*?)[ \t]*$")
DIRECTIVE = re.compile(r"^\s*<!--\s*(?P<kind>no-run|run-with)\b\s*(?::\s*(?P<arg>.*?))?\s*-->\s*$")


@dataclass
class Block:
    path: str
    lang: str
    line: int  # the 1-based line of the block's first content line
    lines: List[str]
    directives: List[Tuple[str, Optional[str], int]] = field(default_factory=list)  # (kind, argument, line)

    @property
    def code(self) -> str:
        return "".join(line + "\n" for line in self.lines)

    @property
    def skipped(self) -> bool:
        return any(kind == "no-run" for kind, _, _ in self.directives)


def blocks(text: str, path: str) -> List[Block]:
    """The fenced code blocks of a markdown text, with the directives on the lines before each."""
    lines = text.splitlines()
    found: List[Block] = []
    i = 0
    while i < len(lines):
        opened = FENCE.match(lines[i])
        if not opened:
            i += 1
            continue
        indent, fence = len(opened["indent"]), opened["fence"]
        lang = (opened["info"].split() or [""])[0].strip("{}.").lower()
        directives = []
        j = i - 1
        while j >= 0 and (not lines[j].strip() or DIRECTIVE.match(lines[j])):
            d = DIRECTIVE.match(lines[j])
            if d:
                directives.insert(0, (d["kind"], d["arg"], j + 1))
            j -= 1
        body, k = [], i + 1
        closing = re.compile(r"^[ \t]*" + re.escape(fence[0]) + "{" + str(len(fence)) + r",}[ \t]*$")
        while k < len(lines) and not closing.match(lines[k]):
            line = lines[k]
            strip = len(line) - len(line.lstrip(" \t"))
            body.append(line[min(indent, strip) :])
            k += 1
        found.append(Block(path, lang, i + 2, body, directives))
        i = k + 1
    return found


def directive_errors(block: Block) -> List[str]:
    errors = []
    for kind, arg, line in block.directives:
        if kind == "no-run" and not arg:
            errors.append(f"{block.path}:{line}: <!-- no-run --> needs a reason: <!-- no-run: why -->")
        if kind == "run-with":
            old, sep, _ = (arg or "").partition("=>")
            if not sep or not old.strip():
                errors.append(f"{block.path}:{line}: write <!-- run-with: OLD => NEW -->")
            elif old.strip() not in block.code:
                errors.append(f"{block.path}:{line}: run-with: {old.strip()!r} is not in the block below")
    return errors


def runnable_code(block: Block) -> str:
    code = block.code
    for kind, arg, _ in block.directives:
        if kind == "run-with" and arg and "=>" in arg:
            old, _, new = arg.partition("=>")
            code = code.replace(old.strip(), new.strip())
    return code


# ---- python blocks -------------------------------------------------------------------------------
RUNNER = textwrap.dedent(
    """
    import json, sys, traceback
    ns = {"__name__": "__main__"}
    for block in json.load(open(sys.argv[1])):
        where = block["path"] + ":" + str(block["line"])
        print("@@block " + where, file=sys.stderr, flush=True)
        try:  # line numbers (and traceback source lines) are the markdown file's own
            exec(compile("\\n" * (block["line"] - 1) + block["code"], block["file"], "exec"), ns)
        except BaseException:
            kind, error, tb = sys.exc_info()
            traceback.print_exception(kind, error, tb.tb_next)  # from the block's frame on
            print("@@failed " + where, file=sys.stderr, flush=True)
            sys.exit(1)
    """
)


def run_python_blocks(path: str, text: str, workdir: str, timeout: float = TIMEOUT, root: str = ROOT) -> List[str]:
    """Run the file's python blocks in order in one namespace; the failures, each naming file:line."""
    chosen = [b for b in blocks(text, path) if b.lang in PYTHON]
    errors = [e for b in chosen for e in directive_errors(b)]
    if errors:
        return errors
    todo = [
        {"path": path, "file": os.path.join(root, path), "line": b.line, "code": runnable_code(b)}
        for b in chosen
        if not b.skipped
    ]
    if not todo:
        return []
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, ".blocks.json"), "w") as f:
        json.dump(todo, f)
    with open(os.path.join(workdir, ".runner.py"), "w") as f:
        f.write(RUNNER)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), MPLBACKEND="Agg")
    log = os.path.join(workdir, ".stderr")
    with open(log, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, ".runner.py", ".blocks.json"],
            cwd=workdir,
            stdout=subprocess.DEVNULL,
            stderr=err,
            env=env,
            start_new_session=True,  # its own process group: a block's child processes go with it
        )
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    with open(log) as f:
        output = f.read()
    started = re.findall(r"^@@block (\S+)$", output, re.M)
    where = started[-1] if started else path
    tail = "\n".join(line for line in output.splitlines() if not line.startswith("@@"))[-3000:]
    if code is None:
        return [
            f"{where}: python block still running after {timeout:g} s: shorten it with "
            f"<!-- run-with: OLD => NEW --> or exclude it with <!-- no-run: why -->\n{tail}"
        ]
    if code != 0:
        return [f"{where}: python block failed (exit code {code}):\n{tail}"]
    return []


# ---- shell blocks --------------------------------------------------------------------------------
def _strip_comment(text: str) -> str:
    """``text`` without a shell comment (a # starting a word, outside quotes)."""
    quote = None
    for i, ch in enumerate(text):
        if quote:
            if ch == quote:
                quote = None
            elif ch == "\\" and quote == '"':
                continue
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or text[i - 1].isspace()):
            return text[:i]
    return text


def shell_lines(block: Block) -> List[Tuple[int, str]]:
    """(line, command text) for each command line of a shell block: continuations joined, prompts removed."""
    prompted = block.lang in ("console", "shell-session") and any(
        line.lstrip().startswith("$ ") for line in block.lines
    )
    out: List[Tuple[int, str]] = []
    pending: Optional[Tuple[int, str]] = None
    for n, raw in enumerate(block.lines):
        line_no = block.line + n
        if pending is not None:
            text = pending[1] + " " + raw.strip()
            line_no = pending[0]
            pending = None
        else:
            text = raw.strip()
            if prompted and not text.startswith("$ "):
                continue  # output
            text = text[2:] if text.startswith("$ ") else text
        if text.endswith("\\"):
            pending = (line_no, text[:-1])
            continue
        out.append((line_no, text))
    if pending is not None:
        out.append(pending)
    return out


REDIRECT = re.compile(r"^(\d*>>?|<|&>)$")
PLACEHOLDER = re.compile(r"^<[^<>]+>$")


def simple_commands(text: str) -> List[List[str]]:
    """The argument lists of a command line's simple commands (split at ; && || |, redirections dropped)."""
    text = re.sub(r"\s\d*>&\d+", " ", _strip_comment(text))  # 2>&1
    lexer = shlex.shlex(text, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    lexer.commenters = ""
    commands: List[List[str]] = [[]]
    tokens = list(lexer)
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if token and set(token) <= set(";&|"):
            commands.append([])
        elif REDIRECT.match(token):
            i += 1  # and its target
        elif token[:1] in "<>" and not PLACEHOLDER.match(token):
            pass  # >file
        else:
            token = token.lstrip("[").rstrip("]") if token not in ("[", "]") else ""
            if token and token not in ("...", "…"):
                commands[-1].append(token)
        i += 1
    return [c for c in commands if c]


@contextlib.contextmanager
def _captured():
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        yield out


def _parse(parse: Callable[[], object], what: str) -> Optional[str]:
    """None if ``parse()`` accepts the arguments (or prints --help), else the parser's message."""
    with _captured() as out:
        try:
            parse()
        except SystemExit as exc:
            if exc.code not in (0, None):
                said = out.getvalue().strip().splitlines()
                return f"`{what}` does not parse: {said[-1] if said else exc.code}"
    return None


def check_pipedp(args: Sequence[str]) -> Optional[str]:
    from pipedp.cli.main import build_parser

    return _parse(lambda: build_parser().parse_args(list(args)), "pipedp " + " ".join(args))


def _module_file(module: str) -> Optional[str]:
    """The repository file ``python -m module`` runs, if it is a repository module."""
    base = os.path.join(ROOT, *module.split("."))
    for candidate in (base + ".py", os.path.join(base, "__main__.py")):
        if os.path.isfile(candidate):
            return candidate
    return None


PARSER_FUNCTIONS = ("build_parser", "make_parser", "get_parser", "get_args_parser", "parser")


def check_bench(module: str, args: Sequence[str]) -> Optional[str]:
    if _module_file(module) is None:
        return f"`python -m {module}`: no module {module} in the repository"
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    mod = importlib.import_module(module)
    what = f"python -m {module} " + " ".join(args)
    for name in PARSER_FUNCTIONS:
        build = getattr(mod, name, None)
        if callable(build):
            parser = build()
            if isinstance(parser, argparse.ArgumentParser):
                return _parse(lambda p=parser: p.parse_args(list(args)), what)
    parse_args = getattr(mod, "parse_args", None)
    if callable(parse_args):
        return _parse(lambda: parse_args(list(args)), what)
    return None  # the module exists; its parser is built inside main(): its flags cannot be checked


def check_module(module: str, args: Sequence[str]) -> Optional[str]:
    if module in ("pipedp", "pipedp.cli", "pipedp.__main__", "pipedp.cli.main"):
        return check_pipedp(args)
    if module == "pytest":
        return check_pytest(args)
    if module == "torch.distributed.run":
        return check_torchrun(args)
    if module.split(".")[0] == "bench":
        return check_bench(module, args)
    if module.split(".")[0] in LOCAL_PACKAGES:
        return None if _module_file(module) else f"`python -m {module}`: no module {module} in the repository"
    return None  # pip, venv, ...: not ours


def check_script(script: str, what: str) -> Optional[str]:
    path = script if os.path.isabs(script) else os.path.join(ROOT, script)
    return None if os.path.isfile(path) else f"`{what}`: no file {script}"


def check_torchrun(args: Sequence[str]) -> Optional[str]:
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    what = "torchrun " + " ".join(args)
    error = _parse(lambda: parser.parse_args(list(args)), what)
    if error:
        return error
    with _captured():
        parsed = parser.parse_args(list(args))
    if parsed.module:
        return check_module(parsed.training_script, parsed.training_script_args)
    if parsed.no_python:
        return None
    return check_script(parsed.training_script, what)


def check_pytest(args: Sequence[str]) -> Optional[str]:
    for arg in args:
        target = arg.split("::")[0]
        if not arg.startswith("-") and ("/" in target or target.endswith(".py")):
            if not os.path.exists(os.path.join(ROOT, target)):
                return f"`pytest {' '.join(args)}`: no file {target}"
    return None


def check_command(argv: Sequence[str]) -> Optional[str]:
    """None, or why the command line is wrong; commands that are not pipedp's, bench's, python's, pytest's or
    torchrun's are not checked."""
    argv = list(argv)
    while argv and (re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", argv[0]) or argv[0] in ("env", "time", "sudo", "nohup")):
        argv.pop(0)
    if not argv:
        return None
    prog, args = os.path.basename(argv[0]), argv[1:]
    if prog == "pipedp":
        return check_pipedp(args)
    if prog == "torchrun":
        return check_torchrun(args)
    if prog in ("pytest", "py.test"):
        return check_pytest(args)
    if re.fullmatch(r"python(3(\.\d+)?)?", prog):
        while args and args[0].startswith("-") and args[0] not in ("-m", "-c"):
            args = args[1:]  # -u, -O, -X...
        if not args or args[0] == "-c":
            return None
        if args[0] == "-m":
            return check_module(args[1], args[2:]) if len(args) > 1 else "`python -m` without a module"
        if args[0].endswith(".py"):
            return check_script(args[0], " ".join(argv))
    return None


def check_shell_blocks(path: str, text: str) -> List[str]:
    """The failures of the file's shell blocks' command lines, each naming file:line."""
    errors = []
    for block in blocks(text, path):
        if block.lang not in SHELL:
            continue
        errors += directive_errors(block)
        if block.skipped:
            continue
        for line, command in shell_lines(block):
            try:
                commands = simple_commands(command)
            except ValueError as exc:  # unbalanced quotes
                if re.search(r"\b(pipedp|bench|torchrun|python3?)\b", command):
                    errors.append(f"{path}:{line}: cannot split {command!r}: {exc}")
                continue
            for argv in commands:
                error = check_command(argv)
                if error:
                    errors.append(f"{path}:{line}: {error}")
    return errors


def _read(path: str) -> str:
    with open(os.path.join(ROOT, path)) as f:
        return f.read()


# ---- the checks of the repository's docs ---------------------------------------------------------
@pytest.mark.parametrize("path", doc_files())
def test_shell_commands_parse(path):
    errors = check_shell_blocks(path, _read(path))
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("path", [p for p in doc_files() if any(b.lang in PYTHON for b in blocks(_read(p), p))])
def test_python_blocks_run(path, tmp_path):
    errors = run_python_blocks(path, _read(path), str(tmp_path / "work"))
    assert not errors, "\n".join(errors)


def test_cli_reference_is_generated_from_the_parser():
    from pipedp.cli.reference import COMMAND, render

    path = os.path.join(ROOT, "docs", "cli-reference.md")
    assert os.path.exists(path), f"docs/cli-reference.md is missing: run `{COMMAND}`"
    assert _read(path) == render(), f"docs/cli-reference.md is not the parser's: run `{COMMAND}`"


def test_readme_support_table_is_the_rendered_one():
    import support_table

    text = _read("README.md") if os.path.exists(os.path.join(ROOT, "README.md")) else ""
    if support_table.START not in text:
        pytest.skip("README.md has no support-table markers")
    assert text.count(support_table.START) == 1, "README.md: more than one support-table marker"
    start, end = support_table.section(text)
    line = text[:start].count("\n") + 1
    assert text[start:end] == "\n" + support_table.render() + "\n", (
        f"README.md:{line}: the support table is not the rendered one: run `python -m tests.support_table --write`"
    )


# ---- the machinery itself, on fixture markdown ---------------------------------------------------
FIXTURE = """# fixture

```python
x = 1
```

<!-- no-run: it raises on purpose -->
```python
raise RuntimeError("not run")
```

<!-- run-with: steps=1000 => steps=2 -->
```python
steps=1000
assert steps == 2 and x == 1
```

- in a list:

  ~~~bash
  pipedp train --stages 2 \\
      --microbatches 4   # a comment, with an apostrophe's
  ~~~

```console
$ pipedp schedule show 1f1b --stages 2 --microbatches 2 [--png timeline.png]
pipedp: not a command, output
```
"""


def test_blocks_finds_languages_lines_directives_and_indented_fences():
    found = blocks(FIXTURE, "fixture.md")
    assert [(b.lang, b.line) for b in found] == [
        ("python", 4),
        ("python", 9),
        ("python", 14),
        ("bash", 21),
        ("console", 26),
    ]
    assert found[1].skipped and found[1].directives == [("no-run", "it raises on purpose", 7)]
    assert runnable_code(found[2]).startswith("steps=2")
    assert found[3].lines[0] == "pipedp train --stages 2 \\"
    assert shell_lines(found[3]) == [
        (21, "pipedp train --stages 2  --microbatches 4   # a comment, with an apostrophe's")
    ]
    assert shell_lines(found[4]) == [(26, "pipedp schedule show 1f1b --stages 2 --microbatches 2 [--png timeline.png]")]
    assert check_shell_blocks("fixture.md", FIXTURE) == []


def test_simple_commands_split_chains_and_drop_redirections_env_and_usage_marks():
    line = "A=1 pipedp audit [--png scores.png] ... && python3 -m bench.qps > out.txt 2>&1 | tee x  # note"
    assert simple_commands(line) == [
        ["A=1", "pipedp", "audit", "--png", "scores.png"],
        ["python3", "-m", "bench.qps"],
        ["tee", "x"],
    ]
    assert simple_commands("pipedp train --model <folder>") == [["pipedp", "train", "--model", "<folder>"]]


@pytest.mark.parametrize(
    "line, wrong",
    [
        ("pipedp train --stages 2 --grad-mode ghost", None),
        ("PIPEDP_CHECKPOINT_KEY=k pipedp train --resume && pipedp train --help", None),
        ("pipedp train --no-such-flag", "unrecognized arguments: --no-such-flag"),
        ("pipedp train --grad-mode sparse", "invalid choice: 'sparse'"),
        ("python3 -m pipedp audit --kind whitebox", None),
        ("python -m pipedp schedul show", "invalid choice: 'schedul'"),
        ("python3 -m bench.qps --preset tiny --quick", None),
        ("python3 -m bench.qps --no-such-flag", "unrecognized arguments"),
        ("python3 -m bench.cpu_time --anything", None),  # exists; its parser is built inside main()
        ("python3 -m bench.no_such_module", "no module bench.no_such_module"),
        ("python -m pipedp.cli.reference > docs/cli-reference.md", None),
        ("python -m pipedp.no_such", "no module pipedp.no_such"),
        ("torchrun --nproc_per_node 2 examples/train_tiny_gpt.py --steps 100", None),
        ("torchrun --nproc_per_node 2 examples/no_such.py", "no file examples/no_such.py"),
        ("torchrun --nproc_per_node 2 -m pipedp train --stages 2", None),
        ("torchrun --nproc_per_node 2 -m pipedp train --stagez 2", "unrecognized arguments: --stagez"),
        ("python tests/hf_families.py", None),
        ("pytest bench/test_bench_norms.py --benchmark-enable", None),
        ("python3 -m pytest -q tests/no_such_test.py::test_x", "no file tests/no_such_test.py"),
        ("python3 -m pip install -e '.[dev]'", None),
        ("ls -la", None),
    ],
)
def test_command_lines_are_checked_by_the_real_parsers(line, wrong):
    errors = check_shell_blocks("fixture.md", f"text\n\n```bash\n{line}\n```\n")
    if wrong is None:
        assert errors == []
    else:
        assert len(errors) == 1 and errors[0].startswith("fixture.md:4: ") and wrong in errors[0], errors


def test_a_no_run_needs_a_reason_and_run_with_must_match():
    text = "<!-- no-run -->\n```python\n1\n```\n\n<!-- run-with: absent => present -->\n```python\n2\n```\n"
    errors = run_python_blocks("fixture.md", text, "unused")
    assert errors == [
        "fixture.md:1: <!-- no-run --> needs a reason: <!-- no-run: why -->",
        "fixture.md:6: run-with: 'absent' is not in the block below",
    ]


def test_python_blocks_run_in_order_in_one_namespace(tmp_path):
    (tmp_path / "fixture.md").write_text(FIXTURE)
    assert run_python_blocks("fixture.md", FIXTURE, str(tmp_path / "work"), root=str(tmp_path)) == []


def test_a_failing_python_block_names_its_file_and_line(tmp_path):
    text = "# t\n\n```python\nx = 1\n```\n\n```python\ny = 2\nassert x == 2, 'x is not 2'\n```\n"
    (tmp_path / "fixture.md").write_text(text)
    errors = run_python_blocks("fixture.md", text, str(tmp_path / "work"), root=str(tmp_path))
    assert len(errors) == 1 and errors[0].startswith("fixture.md:8: python block failed")
    assert "line 9" in errors[0] and "x is not 2" in errors[0] and "assert x == 2" in errors[0]


def test_a_python_block_past_the_time_limit_is_named(tmp_path):
    text = "```python\nimport time\n```\n\n```python\ntime.sleep(30)\n```\n"
    errors = run_python_blocks("fixture.md", text, str(tmp_path / "work"), timeout=2, root=str(tmp_path))
    assert len(errors) == 1 and errors[0].startswith("fixture.md:6: python block still running after 2 s")


def test_the_python_blocks_start_in_a_fresh_working_directory(tmp_path):
    text = (
        "```python\nimport os\nassert not [f for f in os.listdir('.') if not f.startswith('.')], os.listdir('.')\n```\n"
    )
    assert run_python_blocks("fixture.md", text, str(tmp_path / "work"), root=str(tmp_path)) == []


def test_the_support_table_section_is_rewritten_between_its_markers_only():
    import support_table

    text = f"before\n{support_table.START}\nold table\n{support_table.END}\nafter\n"
    new = support_table.rewritten(text)
    assert new == f"before\n{support_table.START}\n{support_table.render()}\n{support_table.END}\nafter\n"
    assert support_table.rewritten(new) == new
    assert "| Hugging Face decoder families |" in new and "| Schedules |" in new


def test_the_support_table_reads_adapter_status_off_the_tests():
    import support_table as st

    def t(name, source=""):
        return st.TestFunction("tests/x.py", name, source)

    assert st.adapter_status([]) == "not tested"
    assert st.adapter_status([t("test_dora_is_refused_by_name")]) == "refused at construction, by name"
    assert st.adapter_status([t("test_lora_x", "want = loop_clipped_sum(m)")]) == "exact vs the loop oracle"
    rows = {row[1]: row[2] for row in st.adapter_rows([t("test_lora_on_an_embedding_is_refused_by_name")])}
    assert rows["PEFT LoRA on embeddings"] == "refused at construction, by name"
    assert rows["PEFT IA3"] == "not tested"
