"""The layering of the package, read from the source with ``ast``: no import cycle, and no
module imports a layer above its own. Imports inside functions count (they are still
dependencies); imports under ``if TYPE_CHECKING:`` do not (they never run)."""

import ast
import os
from typing import Dict, List, Optional, Set

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGES = ("pipedp", "schedules")

# the layer of each part; a module may import only parts of its own layer or below
LAYERS = {
    "schedules": 0,
    "pipedp.errors": 0,
    "pipedp.config": 0,
    "pipedp.models": 0,
    "pipedp.data": 0,
    "pipedp.shards": 0,
    "pipedp.rounding": 0,
    "pipedp.wire": 0,  # where tensors cross torch.distributed: the runtime and the tensor-parallel layers
    "pipedp.privacy": 1,
    "pipedp.split": 2,
    "pipedp.parallel": 2,  # the tensor-parallel layers and their split: beside split, which it applies to
    "pipedp.runtime": 3,
    "pipedp.train": 4,
    "pipedp.audit": 5,
    "pipedp.planner": 5,  # the memory planner: above the trainer and the runtime, which it prepares and runs
    "pipedp.cli": 6,
    "pipedp": 7,  # the package's __init__ / __main__ (the public surface)
}


def module_files() -> Dict[str, str]:
    out = {}
    for package in PACKAGES:
        for folder, _, files in os.walk(os.path.join(ROOT, package)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    parts = os.path.relpath(path, ROOT)[:-3].split(os.sep)
                    if parts[-1] == "__init__":
                        parts = parts[:-1]
                    out[".".join(parts)] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_nodes(tree: ast.AST):
    """Every node except those under `if TYPE_CHECKING:`."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                stack.extend(child.orelse)
                continue
            stack.append(child)


def imports_of(module: str, path: str, known: Set[str]) -> Set[str]:
    is_package = path.endswith("__init__.py")
    base = module.split(".") if is_package else module.split(".")[:-1]
    found: Set[str] = set()
    tree = ast.parse(open(path).read())
    for node in _runtime_nodes(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                prefix = base[: len(base) - node.level + 1]
                target = ".".join(prefix + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [f"{target}.{alias.name}" if f"{target}.{alias.name}" in known else target for alias in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:  # `import torch.nn` or a name inside a module
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


def graph() -> Dict[str, Set[str]]:
    files = module_files()
    return {m: imports_of(m, p, set(files)) for m, p in files.items()}


def layer_of(module: str) -> int:
    best: Optional[str] = None
    for part in LAYERS:
        if (module == part or module.startswith(part + ".")) and (best is None or len(part) > len(best)):
            best = part
    assert best is not None, f"{module} is in no layer: add it to LAYERS"
    return LAYERS[best]


def find_cycle(edges: Dict[str, Set[str]]) -> Optional[List[str]]:
    state: Dict[str, int] = {}  # 1 on the stack, 2 done
    path: List[str] = []

    def visit(m: str) -> Optional[List[str]]:
        state[m] = 1
        path.append(m)
        for n in sorted(edges.get(m, ())):
            if state.get(n) == 1:
                return path[path.index(n) :] + [n]
            if n not in state:
                cycle = visit(n)
                if cycle:
                    return cycle
        path.pop()
        state[m] = 2
        return None

    for m in sorted(edges):
        if m not in state:
            cycle = visit(m)
            if cycle:
                return cycle
    return None


def test_no_import_cycle():
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_every_import_respects_the_layer_order():
    wrong = [
        f"{m} (layer {layer_of(m)}) imports {n} (layer {layer_of(n)})"
        for m, targets in graph().items()
        for n in sorted(targets)
        if layer_of(n) > layer_of(m)
    ]
    assert not wrong, "imports against the layer order:\n  " + "\n  ".join(wrong)


def test_the_checks_see_what_they_should():
    """The checker itself: a made-up cycle is found, and the real graph is not empty."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    edges = graph()
    assert "pipedp.runtime.stage" in edges["pipedp.runtime.executor"]
    assert "pipedp.privacy.clipping" in edges["pipedp.runtime.stage"]
    assert "schedules" in edges["pipedp.runtime.executor"]
    assert "pipedp.train.trainer" not in edges["pipedp.train.loop"]  # only under TYPE_CHECKING


def test_the_command_line_loads_no_torch_to_show_a_schedule():
    import subprocess
    import sys

    code = "import sys, pipedp.cli; from pipedp.cli.main import main; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


# imports that may stay inside functions: optional dependencies (pipedp installs without them), and torch's
# pipelining, which loads (and registers its ops) only for a model that is captured
OPTIONAL = (
    "transformers",
    "safetensors",
    "peft",
    "datasets",
    "pyarrow",
    "matplotlib",
    "tqdm",
    "wandb",
    "mlflow",
    "torch.utils.tensorboard",
    "tomllib",
    "tomli",
    "importlib",  # the packages' lazy attributes (pipedp/__init__.py, pipedp/data/__init__.py)
    "torch.distributed.pipelining",
)
# modules whose imports stay lazy on purpose, each saying why in its docstring: the command line checks its flags
# before torch loads (main, plan's flags, job, preflight, record); process groups are made only for a distributed
# runtime
LAZY = (
    "pipedp.cli.main",
    "pipedp.cli.plan",
    "pipedp.cli.job",
    "pipedp.cli.preflight",
    "pipedp.cli.record",
    "pipedp.runtime.create",
)


def local_imports(source: str) -> List[str]:
    """The modules a source imports inside its functions, other than optional dependencies."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for inner in ast.walk(node):
                if isinstance(inner, ast.Import):
                    names = [alias.name for alias in inner.names]
                elif isinstance(inner, ast.ImportFrom):
                    names = ["." * inner.level + (inner.module or "")]
                else:
                    continue
                found += [n for n in names if not any(n == o or n.startswith(o + ".") for o in OPTIONAL)]
    return found


def test_imports_are_at_the_top_but_optional_ones_and_the_lazy_modules():
    planted = "def f():\n    from ..runtime import stage\n    import transformers\n    return stage\n"
    assert local_imports(planted) == ["..runtime"]  # the checker catches an internal import inside a function
    wrong = [
        f"{m}: {name}"
        for m, path in module_files().items()
        if m not in LAZY
        for name in local_imports(open(path).read())
    ]
    assert not wrong, "function-local imports (move them to the top, or say why the module is lazy):\n  " + "\n  ".join(
        wrong
    )
