"""The package layout holds: no import cycles, and no import from a lower layer up to a higher one.

The import graph is read with `ast` from every module of streamllm/ and feeds/: imports at the top
of a file and inside functions alike (an import inside a function is still an arrow; it only hides
it until run time). Imports under `if TYPE_CHECKING:` are left out: they never run.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("streamllm", "feeds")

# Low to high. A module may import its own layer and the layers below it, never one above.
# feeds/ (venue parsers, recorded sources) knows nothing of streamllm; the model knows nothing of
# markets; nothing below the engine imports the service.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("feeds",),
    ("streamllm.config",),
    ("streamllm.model",),
    ("streamllm.engine",),
    ("streamllm.feeding", "streamllm.durability"),
    ("streamllm.evaluation", "streamllm.tuning"),
    ("streamllm.client",),
    ("streamllm.service",),
    ("streamllm.scale",),
    ("streamllm.cli", "streamllm.demo", "streamllm"),  # streamllm/__init__.py: the public names, lazily
)

# Known arrows that break the rules today, each with its owner's plan. Empty it, never grow it.
ALLOWED_UPWARD: set[tuple[str, str]] = set()
ALLOWED_CYCLES: list[set[str]] = []  # none left; a new cycle is a bug

# Imports of our own modules inside functions: only where something optional or heavy must stay
# unloaded until used. Everything else imports at the top of its file.
ALLOWED_LATE_IMPORTS: dict[str, set[str]] = {
    # `import streamllm` and the thin client must not load torch: the engine's names resolve lazily.
    "streamllm/__init__.py": {"streamllm.engine.api", "streamllm.engine.outputs"},
    # `serve --ray` only: streamllm.scale imports Ray (the ray extra).
    "streamllm/cli/serve.py": {"streamllm.scale.cluster", "streamllm.scale.replica"},
    # Databento's native decoder is loaded when a DBN file is read, not for every recorded source.
    "feeds/sources.py": {"feeds.dbn"},
}


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _type_checking_only(tree: ast.AST) -> set[int]:
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def _imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        here = module.split(".") if is_package else module.split(".")[:-1]
        here = here[: len(here) - node.level + 1]
        base = ".".join(here + ([node.module] if node.module else []))
    # `from pkg import name` imports pkg.name when that is a module, else pkg
    return [f"{base}.{alias.name}" for alias in node.names] + [base]


def import_graph(late: dict[str, dict[str, int]] | None = None) -> tuple[dict[str, Path], dict[str, dict[str, int]]]:
    """(module -> file, module -> {imported module -> first line}) over streamllm/ and feeds/; `late`, when
    given, gets the imports made inside functions the same way."""
    modules = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, int]] = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        skip = _type_checking_only(tree)
        in_functions = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
                        for n in ast.walk(f)}
        edges = graph.setdefault(module, {})
        for node in ast.walk(tree):
            if not isinstance(node, ast.Import | ast.ImportFrom) or id(node) in skip:
                continue
            names = _imported(node, module, path.name == "__init__.py")
            if isinstance(node, ast.ImportFrom):  # the module itself, or the names that are modules
                named = [n for n in names[:-1] if n in modules]
                names = named or names[-1:]
            for name in names:
                target = resolve(name)
                if target is None or target == module:
                    continue
                edges.setdefault(target, node.lineno)
                if late is not None and id(node) in in_functions:
                    late.setdefault(module, {}).setdefault(target, node.lineno)
    return modules, graph


def _layer(module: str) -> int:
    best, rank = -1, None
    for i, layer in enumerate(LAYERS):
        for prefix in layer:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, rank = len(prefix), i
    assert rank is not None, f"{module}: in no layer; add its package to LAYERS in tests/test_layers.py"
    return rank


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each as one cycle through it."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return components


def _cycle_path(component: list[str], graph: dict[str, dict[str, int]]) -> list[str]:
    """One cycle inside a component, start -> ... -> start (breadth-first back to the start)."""
    inside = set(component)
    start = component[0]
    came: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in graph[v]:
                if w not in inside:
                    continue
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(came[path[-1]])
                    return [start, *reversed(path[:-1]), start] if len(path) > 1 else [start, v, start]
                if w not in came:
                    came[w] = v
                    nxt.append(w)
        frontier = nxt
    return component


def _where(modules: dict[str, Path], graph: dict[str, dict[str, int]], a: str, b: str) -> str:
    return f"{modules[a].relative_to(ROOT)}:{graph[a][b]}"


def test_no_import_cycles():
    modules, graph = import_graph()
    found = []
    for component in _cycles(graph):
        if any(set(component) <= allowed for allowed in ALLOWED_CYCLES):
            continue
        path = _cycle_path(component, graph)
        arrows = [f"{a} -> {b} ({_where(modules, graph, a, b)})" for a, b in zip(path, path[1:], strict=False)]
        found.append(f"cycle through {len(component)} modules {component}:\n    " + "\n    ".join(arrows))
    assert not found, "import cycles:\n" + "\n".join(found)


def test_no_import_from_a_lower_layer_to_a_higher_one():
    modules, graph = import_graph()
    upward = []
    for a, targets in sorted(graph.items()):
        for b in targets:
            if _layer(b) > _layer(a) and (a, b) not in ALLOWED_UPWARD:
                upward.append(f"{_where(modules, graph, a, b)}: {a} imports {b} "
                              f"(layer {_layer(a)} {LAYERS[_layer(a)]} < layer {_layer(b)} {LAYERS[_layer(b)]})")
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(upward)


def test_imports_sit_at_the_top_of_files_unless_loaded_late_on_purpose():
    late: dict[str, dict[str, int]] = {}
    modules, _ = import_graph(late)
    found = []
    for module, targets in sorted(late.items()):
        where = str(modules[module].relative_to(ROOT))
        for target, line in sorted(targets.items()):
            if target not in ALLOWED_LATE_IMPORTS.get(where, set()):
                found.append(f"{where}:{line}: imports {target} inside a function; import it at the top "
                             "(or, for an optional extra, add it to ALLOWED_LATE_IMPORTS with the reason)")
    assert not found, "\n".join(found)


def test_the_allow_lists_hold_only_arrows_that_still_exist():
    late: dict[str, dict[str, int]] = {}
    modules, graph = import_graph(late)
    gone = [f"{a} -> {b}" for a, b in sorted(ALLOWED_UPWARD) if b not in graph.get(a, {})]
    by_file = {str(path.relative_to(ROOT)): late.get(module, {}) for module, path in modules.items()}
    gone += [f"late {f}: {t}" for f, targets in sorted(ALLOWED_LATE_IMPORTS.items()) for t in sorted(targets)
             if t not in by_file.get(f, {})]
    components = [set(c) for c in _cycles(graph)]
    gone += [f"cycle {sorted(c)}" for c in ALLOWED_CYCLES if not any(c <= comp for comp in components)]
    assert not gone, "fixed: remove from the allow-lists in tests/test_layers.py: " + ", ".join(gone)


def test_the_checker_sees_cycles_and_upward_arrows():
    graph = {"a.x": {"a.y": 1}, "a.y": {"a.z": 2}, "a.z": {"a.x": 3}, "a.w": {"a.x": 4}}
    assert _cycles(graph) == [["a.x", "a.y", "a.z"]]
    assert _cycle_path(["a.x", "a.y", "a.z"], graph) == ["a.x", "a.y", "a.z", "a.x"]
    assert _layer("streamllm.engine.core") < _layer("streamllm.service.server")
    assert _layer("streamllm.scale.cluster") > _layer("streamllm.service.server")
    assert _layer("streamllm.cli.serve") > _layer("streamllm.scale.cluster")
    assert _layer("feeds.binance") < _layer("streamllm.config.labels")


def test_bench_is_not_in_the_wheel_and_the_cli_says_where_it_is(tmp_path):
    import tomllib

    found = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    assert not any(p.startswith("bench") for p in found["include"])
    # Away from a checkout (and with bench/ not importable), `streamllm bench` names the fix.
    script = ("import sys, importlib.abc\n"
              "class NoBench(importlib.abc.MetaPathFinder):\n"
              "    def find_spec(self, name, path=None, target=None):\n"
              "        if name == 'bench' or name.startswith('bench.'):\n"
              "            raise ImportError(name)\n"
              "sys.meta_path.insert(0, NoBench())\n"
              f"sys.path.insert(0, {str(ROOT)!r})\n"
              "from streamllm.cli import main\n"
              "sys.exit(main(['bench', 'prepos', '--help']))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "bench/ of a source checkout" in out.stderr and "not installed" in out.stderr
