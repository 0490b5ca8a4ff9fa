"""The README's support table, rendered from the code and the tests: what is supported, and how it is tested.

Every entry comes from a source, never from a hand-typed list: the Hugging Face family rows of
tests/hf_families.py (counted), the adapter tests found in tests/ by name (their status read off the
tests: compared with the loop oracle, or expecting a refusal), the layer-rule registry and its
fallbacks, ``schedules.BUILDERS`` and the option tuples of ``pipedp/config.py`` (each with the config
field and flag that take it).

    python -m tests.support_table           # print the table
    python -m tests.support_table --write   # rewrite README.md between the two markers

README.md holds it between ``START`` and ``END``; tests/test_docs.py checks that the section equals
``render()``.
"""

from __future__ import annotations

import ast
import os
import re
import sys
from collections import Counter
from dataclasses import dataclass, fields
from typing import Dict, List, Optional, Sequence, Tuple

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
for _path in (TESTS, ROOT):  # as `python -m tests.support_table` and under pytest alike
    if _path not in sys.path:
        sys.path.insert(0, _path)

import hf_families  # noqa: E402

START = "<!-- support table: python -m tests.support_table -->"
END = "<!-- end support table -->"
README = os.path.join(ROOT, "README.md")

# the adapters the table reports, each as a pattern over test function names (the tests name what they test)
ADAPTERS: Tuple[Tuple[str, str], ...] = (
    ("PEFT LoRA on linear layers", r"^(?!.*embedding).*(lora|peft).*matches_the_loop_oracle"),
    ("PEFT LoRA on embeddings", r"lora.*embedding"),
    ("PEFT IA3", r"ia3"),
    ("PEFT DoRA", r"dora"),
    ("PEFT LoRA on tensor-parallel split layers", r"lora.*(split_projection|cannot_split)"),
)


@dataclass(frozen=True)
class TestFunction:
    path: str  # relative to the repository root
    name: str
    source: str


def test_functions(root: str = TESTS) -> List[TestFunction]:
    """Every ``test_*`` function of every ``test_*.py`` under ``root``, with its source."""
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__")))
        for file in sorted(files):
            if not (file.startswith("test_") and file.endswith(".py")):
                continue
            path = os.path.join(folder, file)
            with open(path) as f:
                text = f.read()
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test_"):
                    source = ast.get_source_segment(text, node) or ""
                    found.append(TestFunction(os.path.relpath(path, ROOT), node.name, source))
    return found


def adapter_status(tests: Sequence[TestFunction]) -> str:
    """What the tests show: exact vs the loop oracle, refused by name, or not tested."""
    if not tests:
        return "not tested"
    exact = [t for t in tests if "loop_oracle" in t.name or "loop_clipped_sum" in t.source]
    refused = [t for t in tests if "refused" in t.name or "pytest.raises(" in t.source]
    if exact and refused:
        return "exact vs the loop oracle; some configurations refused at construction, by name"
    if exact:
        return "exact vs the loop oracle"
    if refused:
        return "refused at construction, by name"
    return "tested"


def _sources(tests: Sequence[TestFunction]) -> str:
    counts = Counter(t.path for t in tests)
    return ", ".join(f"`{path}` ({n} test function{'s' * (n > 1)})" for path, n in counts.items()) or "—"


def family_rows() -> List[List[str]]:
    exact = [f for f in hf_families.FAMILIES if f.exact]
    refused = [f for f in hf_families.FAMILIES if not f.exact]
    classifiers = sum(f.classification for f in exact)
    source = "`tests/hf_families.py` (table: `docs/models.md`)"
    reasons = Counter(f.status.removeprefix("refused: ") for f in refused)
    why = "; ".join(f"{reason} ({n})" for reason, n in reasons.items())
    return [
        [
            "Hugging Face decoder families",
            f"{len(exact)} family rows (causal LM, tied and untied head, untied only where the config cannot tie: "
            f"{sum(not f.ties for f in exact)}; sequence classification: {classifiers})",
            "exact vs the loop oracle",
            source,
        ],
        [
            "Hugging Face decoder families",
            f"{len(refused)} family rows: {why}",
            "refused at construction, by name",
            source,
        ],
    ]


def adapter_rows(tests: Optional[Sequence[TestFunction]] = None) -> List[List[str]]:
    tests = test_functions() if tests is None else tests
    rows = []
    for label, pattern in ADAPTERS:
        matched = [t for t in tests if re.search(pattern, t.name, re.I)]
        rows.append(["Adapters", label, adapter_status(matched), _sources(matched)])
    return rows


def _predicate(accepts) -> str:
    doc = (accepts.__doc__ or "").strip().split("\n")[0].rstrip(".")
    return f"`{accepts.__name__}`" + (f" ({doc})" if doc else "")


def rule_rows() -> List[List[str]]:
    import pipedp.parallel.rules  # noqa: F401  (the tensor-parallel layers' rules register when it is imported)
    from pipedp.privacy.rules import generic
    from pipedp.privacy.rules.registry import PREDICATES, RULES

    def layer_name(layer: type) -> str:
        return f"`nn.{layer.__name__}`" if layer.__module__.startswith("torch.nn") else f"`{layer.__qualname__}`"

    from pipedp.privacy.rules import EXPERTS, ROUTER
    from pipedp.privacy.rules.dense_experts import DENSE_EXPERTS, SCORING_ROUTER
    from pipedp.privacy.rules.sliced_experts import SLICED_EXPERTS

    per_class = (
        (ROUTER, "a mixture of experts' router"),
        (EXPERTS, "a fused expert bank"),
        (SCORING_ROUTER, "a router scoring every expert (Llama-4's)"),
        (DENSE_EXPERTS, "an expert bank every token passes through (Llama-4's)"),
        (SLICED_EXPERTS, "an expert bank stored as row slices of [E h, d] matrices (DBRX's)"),
        (generic.LOOPED, "a mixture-of-experts block with no closed-form rule (JetMoE's, ZAYA's), replayed per sample"),
    )
    layers: Dict[str, List[str]] = {}  # rule name -> the layer types and predicates it is registered for
    for layer, rule in RULES.items():
        if any(rule is r for r, _ in per_class):  # registered per class as models are checked: listed once, below
            continue
        layers.setdefault(rule.name, []).append(layer_name(layer))
    for accepts, rule in PREDICATES:
        layers.setdefault(rule.name, []).append(_predicate(accepts))
    tests = test_functions()

    def source(rule) -> str:
        """The rule's module, and its tests (tests/unit/rules/test_<module>.py) where they exist."""
        module = rule.grads.__module__
        where = f"`{module.replace('.', '/')}.py`"
        test_file = os.path.join("tests", "unit", "rules", f"test_{module.rsplit('.', 1)[-1]}.py")
        tested = [t for t in tests if t.path == test_file]
        return where + (f", {_sources(tested)}" if tested else ", no rule tests")

    rules = {rule.name: rule for rule in [*RULES.values(), *(r for _, r in PREDICATES), *(r for r, _ in per_class)]}
    rows = [
        ["Layer rules", f"`{name}`: " + ", ".join(of), "registered (exact type or predicate)", source(rules[name])]
        for name, of in layers.items()
    ]
    rows += [
        [
            "Layer rules",
            f"`{rule.name}`: {what}, registered for each class split/hf_experts.py checks",
            "registered per checked class",
            source(rule),
        ]
        for rule, what in per_class
    ]
    opacus = sorted(t.__name__ for t in generic.GRAD_SAMPLERS if t not in RULES)
    rows.append(
        [
            "Layer rules",
            f"`{generic.OPACUS.name}` fallback: " + ", ".join(f"`{n}`" for n in opacus),
            "fallback: Opacus's grad sampler for the layer type",
            source(generic.OPACUS),
        ]
    )
    rows.append(
        [
            "Layer rules",
            f"`{generic.FUNCTORCH.name}` fallback: any other layer, and a layer with trainable children",
            "fallback: vmap of the layer's gradient, one sample at a time",
            source(generic.FUNCTORCH),
        ]
    )
    return rows


def _takers(values: Sequence[str]) -> str:
    """The config fields (and their flags) whose choices are exactly ``values``."""
    from pipedp.cli.flags import flag_of
    from pipedp.cli.options import JOB_CLASSES

    takers = []
    for cls in JOB_CLASSES:
        for f in fields(cls):
            if set(f.metadata.get("choices") or ()) == set(values):
                flag = f" / `{flag_of(f)}`" if f.metadata["cli"] else ""
                default = "unset" if f.default is None else f"`{f.default}`"
                takers.append(f"`{cls.__name__}.{f.name}`{flag} (default {default})")
    return ", ".join(takers) or "—"


def option_rows() -> List[List[str]]:
    import schedules
    from pipedp import config
    from pipedp.cli import options
    from schedules.registry import COST_AWARE

    def names(values: Sequence[str]) -> str:
        return ", ".join(f"`{v}`" for v in values)

    cost_aware = f"; cost-aware: {names(sorted(COST_AWARE))}" if COST_AWARE else ""
    options = [
        ("Schedules", tuple(schedules.BUILDERS), "`schedules.BUILDERS`", cost_aware),
        ("Grad modes", config.GRAD_MODES, "`pipedp.config.GRAD_MODES`", ""),
        ("Clipping modes", config.CLIPPING_MODES, "`pipedp.config.CLIPPING_MODES`", ""),
        ("Precisions", config.PRECISIONS, "`pipedp.config.PRECISIONS`", ""),
        ("Sampling declarations", config.SAMPLINGS, "`pipedp.config.SAMPLINGS`", ""),
        ("Accountants", config.ACCOUNTANTS, "`pipedp.config.ACCOUNTANTS`", ""),
        ("Privacy units", options.PRIVACY_UNITS, "`pipedp.cli.options.PRIVACY_UNITS`", ""),
    ]
    rows = []
    for what, values, source, note in options:
        rows.append([what, names(values), f"choices of {_takers(values)}{note}", source])
    return rows


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def render() -> str:
    """The markdown table (no trailing newline)."""
    rows = family_rows() + adapter_rows() + rule_rows() + option_rows()
    lines = ["| what | supported | status | from |", "| --- | --- | --- | --- |"]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def section(text: str) -> Optional[Tuple[int, int]]:
    """The span between the markers (None if the text has no START marker)."""
    if START not in text:
        return None
    start = text.index(START) + len(START)
    end = text.find(END, start)
    if end < 0:
        raise ValueError(f"README.md has {START!r} but no {END!r} after it")
    return start, end


def rewritten(text: str) -> str:
    """``text`` with the section between the markers replaced by the rendered table."""
    span = section(text)
    if span is None:
        raise ValueError(f"no {START!r} marker")
    return text[: span[0]] + "\n" + render() + "\n" + text[span[1] :]


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--write"]:
        with open(README) as f:
            text = f.read()
        try:
            new = rewritten(text)
        except ValueError as exc:
            print(f"support_table: README.md: {exc}", file=sys.stderr)
            return 1
        if new != text:
            with open(README, "w") as f:
                f.write(new)
        print("README.md: support table " + ("rewritten" if new != text else "already up to date"))
        return 0
    if argv:
        print("usage: python -m tests.support_table [--write]", file=sys.stderr)
        return 2
    print(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
