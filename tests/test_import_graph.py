"""The package's import graph has no circle: every `import` and `from ... import` of a colibri_format module, at
module level or inside a function, read with `ast` (no module is imported), is an edge; a strongly connected
component of more than one module is a circle. `from pkg import name` is an edge to `pkg.name` when that is a
module, else to `pkg` (importing a submodule runs its package's __init__, which is fine: a package may re-export
its children, and a child must then not import its package's __init__ names)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "colibri_format"


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def edges(name: str, path: Path, known: set[str]) -> set[str]:
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                target = f"{base}.{alias.name}"
                found.add(target if target in known else base)
    return {m for m in found if m in known and m != name}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of size > 1 (iterative: no recursion limit)."""
    index, low, stack, on_stack, result, counter = {}, {}, [], set(), [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    component.append(m)
                    if m == node:
                        break
                if len(component) > 1:
                    result.append(sorted(component))
    return result


def test_no_import_circle_in_the_package():
    mods = modules()
    graph = {name: edges(name, path, set(mods)) for name, path in mods.items()}
    assert sum(len(e) for e in graph.values()) > 100          # the reader sees the real graph
    assert circles(graph) == []


def test_the_detector_sees_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_library_module_imports_the_cli():
    mods = modules()
    for name, path in mods.items():
        if not name.startswith("colibri_format.cli") and name != "colibri_format.__main__":   # the entry point
            assert not any(e.startswith("colibri_format.cli") for e in edges(name, path, set(mods))), name
