"""The import layers of blockshard (issue 21; docs/design.md, "Layers"): the first-party import graph,
module-level *and* function-level imports alike, has no cycle, no import points up the declared
layers, and no first-party import is deferred into a function body outside the commented
allow-list below. Pure: it parses the sources, imports nothing.
Control: the same checks on a small made-up graph find its cycle, its upward edge and its
deferred import."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Lowest first; a module belongs to the longest prefix that names it. Each layer may import only
# layers listed before it (and itself, without cycles).
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("base", ("blockshard._errors", "blockshard._arith", "blockshard._limits", "blockshard._version")),
    ("semantics", ("blockshard.semantics",)),
    ("planner", ("blockshard.planner",)),
    ("engine core", ("blockshard.runtime.core",)),
    ("quantized weights", ("blockshard.runtime.quantized",)),
    ("checkpoints and state dicts", ("blockshard.runtime.checkpoint",)),
    ("torch routes", ("blockshard.runtime.routes",)),
    ("fully_shard", ("blockshard.runtime",)),  # _api, _arguments, _placement: the composition root
    ("optim", ("blockshard.optim",)),
    ("facade", ("blockshard",)),  # blockshard/__init__.py only
    ("integrations", ("blockshard.integrations",)),
    ("test and demo helpers", ("blockshard._launch", "blockshard._tiny", "blockshard.launch", "blockshard.tiny")),
    ("entry points", ("blockshard.cli", "blockshard.__main__", "blockshard._demo", "blockshard._render")),
)

# Function-level first-party imports that stay deferred, by importing module, with the reason.
DEFERRED_OK: dict[str, str] = {
    "blockshard": "the facade loads the engine (and torch) on first use: `import blockshard` stays light",
    "blockshard.cli": "each subcommand loads what it needs: `blockshard plan` never imports torch",
    "blockshard._demo": "`blockshard demo` runs in spawned ranks; the CLI imports it before torch is needed",
    "blockshard.integrations.accelerate": "Accelerator / Trainer load accelerate and transformers on first use",
    "blockshard.integrations.deepspeed": "the engine hook loads deepspeed (an optional dependency) on first use",
}


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[0] == "integrations":
        parts = ["blockshard", *parts]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _sources() -> dict[str, pathlib.Path]:
    files = [*(ROOT / "blockshard").rglob("*.py"), *(ROOT / "integrations").rglob("*.py")]
    return {_module_name(p): p for p in files}


def _imports(name: str, tree: ast.Module, known: set[str]) -> list[tuple[str, int, bool]]:
    """(imported first-party module, line, deferred into a function) for every import statement
    outside ``if TYPE_CHECKING:``."""
    out: list[tuple[str, int, bool]] = []
    package = name if name in known and _is_package(name, known) else name.rpartition(".")[0]

    def target(dotted: str) -> str | None:
        while dotted and dotted not in known:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue  # never executed
            deferred = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            names: list[str] = []
            if isinstance(child, ast.Import):
                names = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    pkg = package
                    for _ in range(child.level - 1):
                        pkg = pkg.rpartition(".")[0]
                    base = f"{pkg}.{base}" if base else pkg
                names = [f"{base}.{a.name}" for a in child.names]
            for dotted in names:
                t = target(dotted) if dotted.startswith("blockshard") else None
                if t is not None and t != name:
                    out.append((t, child.lineno, in_function))
            visit(child, deferred)

    visit(tree, False)
    return out


def _is_package(name: str, known: set[str]) -> bool:
    return any(k.startswith(name + ".") for k in known)


def _layer(name: str) -> int:
    best: tuple[int, int] | None = None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if name == p or (p != "blockshard" and name.startswith(p + ".")):
                if best is None or len(p) > best[1]:
                    best = (i, len(p))
    assert best is not None, f"{name} is in no layer: add it to LAYERS"
    return best[0]


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    x = stack.pop()
                    on.discard(x)
                    comp.append(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def _violations(graph: dict[str, list[tuple[str, int, bool]]]) -> tuple[list[list[str]], list[str], list[str]]:
    edges = {m: {t for t, _, _ in imps} for m, imps in graph.items()}
    upward = [
        f"{m}:{line} imports {t} ({LAYERS[_layer(t)][0]} is above {LAYERS[_layer(m)][0]})"
        for m, imps in graph.items()
        for t, line, _ in imps
        if _layer(t) > _layer(m)
    ]
    deferred = [
        f"{m}:{line} imports {t} inside a function"
        for m, imps in graph.items()
        for t, line, d in imps
        if d and m not in DEFERRED_OK
    ]
    return _cycles(edges), sorted(upward), sorted(deferred)


def _graph() -> dict[str, list[tuple[str, int, bool]]]:
    sources = _sources()
    known = set(sources)
    return {m: _imports(m, ast.parse(p.read_text(), str(p)), known) for m, p in sorted(sources.items())}


def test_no_cycle_no_upward_import_no_new_deferred_import():
    cycles, upward, deferred = _violations(_graph())
    assert [len(c) for c in cycles] == [], cycles
    assert upward == [], "\n".join(upward)
    assert deferred == [], "\n".join(deferred)


def test_every_module_is_in_a_layer_and_the_allow_list_names_real_modules():
    sources = _sources()
    for m in sources:
        _layer(m)
    assert set(DEFERRED_OK) <= set(sources)


def test_control_a_made_up_graph_shows_each_kind_of_violation():
    graph = {
        "blockshard.runtime.core._a": [("blockshard.runtime.checkpoint._b", 3, False)],  # up
        "blockshard.runtime.checkpoint._b": [("blockshard.runtime.core._a", 5, True)],  # deferred; a cycle
        "blockshard.planner._c": [],
    }
    cycles, upward, deferred = _violations(graph)
    assert cycles == [["blockshard.runtime.checkpoint._b", "blockshard.runtime.core._a"]]
    assert upward == [
        "blockshard.runtime.core._a:3 imports blockshard.runtime.checkpoint._b (checkpoints and state dicts is "
        "above engine core)"
    ]
    assert deferred == ["blockshard.runtime.checkpoint._b:5 imports blockshard.runtime.core._a inside a function"]
