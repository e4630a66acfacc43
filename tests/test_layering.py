"""The package's layers, read from the source with ``ast`` (no import, no GPU, no Triton).

``kernels/`` (installed as ``dgemma_sampler.kernels``) sits at the bottom: it imports torch,
triton and its own modules, never the package that calls it (shared types and constants live in
``kernels/contract.py``). And no two modules import each other, directly or through others:
every import counts, at the top of a module, inside a function or under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "dgemma_sampler"
KERNELS = f"{PACKAGE}.kernels"


def module_files() -> dict[str, Path]:
    """Module name -> source file, over ``dgemma_sampler/`` and ``kernels/`` (as
    ``dgemma_sampler.kernels``); a package is named by its ``__init__.py``."""
    found = {}
    for top, name in ((ROOT / PACKAGE, PACKAGE), (ROOT / "kernels", KERNELS)):
        for path in sorted(top.rglob("*.py")):
            rel = path.relative_to(top).with_suffix("").parts
            if top.name == PACKAGE and rel[0] == "kernels":
                continue  # the development symlink to kernels/
            parts = rel[:-1] if rel[-1] == "__init__" else rel
            found[".".join((name, *parts))] = path
    return found


def imports(module: str, path: Path) -> list[tuple[str, list[str]]]:
    """Every import statement of ``module``: (module named, names taken from it), relative
    imports resolved; ``import a.b`` gives ``("a.b", [])``."""
    is_package = path.name == "__init__.py"
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = node.module
            if node.level:
                package = module.split(".")[:None if is_package else -1]
                up = node.level - 1
                if up >= len(package):
                    found.append(("<above the top package>", []))
                    continue
                source = ".".join(package[:len(package) - up] + ([node.module] if node.module else []))
            found.append((source, [alias.name for alias in node.names]))
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports: for ``from X import y`` the submodule ``X.y``
    where there is one, else ``X``."""
    files = module_files()
    graph = {}
    for module, path in files.items():
        edges = set()
        for source, names in imports(module, path):
            subs = [f"{source}.{n}" for n in names if f"{source}.{n}" in files]
            edges.update(subs)
            if source in files and (not names or len(subs) < len(names)):
                edges.add(source)
        graph[module] = (edges & set(files)) - {module}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (its modules, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_kernels_import_nothing_from_the_package():
    files = module_files()
    inside = lambda name, pkg: name == pkg or name.startswith(pkg + ".")  # noqa: E731
    offenders = {}
    for module, path in files.items():
        if not inside(module, KERNELS):
            continue
        bad = sorted(source for source, _ in imports(module, path)
                     if source.startswith("<") or (inside(source, PACKAGE) and not inside(source, KERNELS)))
        if bad:
            offenders[str(path.relative_to(ROOT))] = bad
    assert not offenders, f"kernels/ must not import dgemma_sampler: {offenders}"


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_graph_sees_the_imports_it_checks():
    """The checks above are not vacuous: the graph holds edges of every kind they rely on
    (absolute, relative, inside a function, package-level re-export)."""
    graph = import_graph()
    assert f"{KERNELS}.contract" in graph[f"{PACKAGE}.ops"]
    assert f"{KERNELS}.row_stats" in graph[f"{PACKAGE}.backend"]  # imported inside kernels()
    assert f"{KERNELS}.tile_schedule" in graph[f"{KERNELS}.soft_embedding_wgmma"]
    assert f"{PACKAGE}.update_graph" in graph[f"{PACKAGE}.runner"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
