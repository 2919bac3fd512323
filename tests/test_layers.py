"""The package's layers depend one way, with no import cycles; only ``lake`` touches Delta or S3.

Read from the source with ``ast`` (imports inside functions count too: they still tie modules together),
so a new upward import or cycle fails here before anyone has to draw the picture again.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

PACKAGE = Path(__file__).resolve().parents[1] / "jobs" / "millpond"
#: lower layers first; a module may import its own layer and the ones below it
LAYERS = ("model", "errors", "config", "prerequisites", "lake", "quality", "examples", "runtime",
          "orchestration", "surface")
RANK = {"model": 0, "errors": 0, "config": 1, "prerequisites": 1, "lake": 2, "quality": 3, "examples": 3,
        "runtime": 4, "orchestration": 5, "surface": 6}
#: libraries that reach Delta tables or the object store: only the lake may import them
STORAGE_LIBRARIES = ("deltalake", "boto3", "botocore", "minio", "pyarrow.fs")


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported module) for every import in the file, relative ones resolved."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            assert node.level == 0, f"{path}:{node.lineno}: use absolute imports (from millpond.<layer>...)"
            found += [(node.lineno, node.module)] + [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return found


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "millpond" else None


def test_layers_depend_one_way() -> None:
    upward = []
    for module, path in _modules().items():
        own = _layer(module)
        if own not in RANK:
            continue
        for line, target in _imports(path):
            other = _layer(target)
            if other in RANK and RANK[other] > RANK[own]:
                upward.append(f"{path.relative_to(PACKAGE.parent)}:{line} ({own}) imports {target} ({other})")
    assert not upward, "imports against the layers:\n" + "\n".join(sorted(set(upward)))


def test_every_module_belongs_to_a_layer() -> None:
    loose = [m for m in _modules() if m != "millpond" and _layer(m) not in RANK and m != "millpond.__main__"]
    assert not loose, f"modules outside the layers {LAYERS}: {loose}"


def test_no_import_cycles() -> None:
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for _, target in _imports(path):
            while target and target not in modules:
                target = target.rpartition(".")[0]
            is_own_child = module in target and path.name == "__init__.py"
            if target and target != module and not is_own_child:
                graph[module].add(target)
    cycles = _cycles(graph)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_only_the_lake_touches_delta_or_s3() -> None:
    outside = []
    for module, path in _modules().items():
        if _layer(module) == "lake":
            continue
        for line, target in _imports(path):
            if target.startswith(STORAGE_LIBRARIES):
                outside.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {target}")
    assert not outside, "Delta/S3 libraries used outside millpond.lake:\n" + "\n".join(sorted(set(outside)))


def test_the_model_is_pure() -> None:
    impure = ("millpond.config", "millpond.lake", "pyspark", "yaml", "subprocess", "socket", "requests")
    found = [f"{path.relative_to(PACKAGE.parent)}:{line} imports {target}"
             for module, path in _modules().items() if _layer(module) == "model"
             for line, target in _imports(path) if target.startswith(impure)]
    assert not found, "the model does I/O:\n" + "\n".join(found)


def test_modules_stay_small() -> None:
    big = [f"{p.relative_to(PACKAGE.parent)}: {n} lines" for p in PACKAGE.rglob("*.py")
           if (n := len(p.read_text().splitlines())) > 520]
    assert not big, "split along responsibilities: " + ", ".join(big)


def test_runtime_functions_stay_short() -> None:
    """A batch reads as a sequence of named steps: no function in the runtime grows past ~60 lines."""
    long = [f"{p.relative_to(PACKAGE.parent)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for p in (PACKAGE / "runtime").rglob("*.py") for node in ast.walk(ast.parse(p.read_text()))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno >= 60]
    assert not long, long
