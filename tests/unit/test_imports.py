"""No import cycle in `proto_server`, nor in the benchmarks (`benchmarks/proto_server_bench`): a
cycle makes a module's meaning depend on which one was imported first, and hides behind a
function-local import until a refactor moves it to the top.

The graph is read from the source with `ast`, so every import that runs counts: top-level and
function-local alike; only an `if TYPE_CHECKING:` block is left out, since it never runs. A
package's `__init__` is a node of its own, imported before any of its modules from outside it;
`from package import name` points at the submodule when `name` is one, and at the package
otherwise.
"""

from __future__ import annotations

import ast
from collections import deque
from collections.abc import Iterable, Iterator
from pathlib import Path

import attrs
import pytest

ROOT = Path(__file__).resolve().parents[2] / "proto_server"
Found = tuple[ast.Import | ast.ImportFrom, bool]


@attrs.frozen
class Edge:
    """One import: where it is written, so a cycle reads as the lines to change."""

    target: str
    line: int
    local: bool  # inside a function: runs when called, not when imported


def module_name(root: Path, path: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports(nodes: Iterable[ast.AST], local: bool = False) -> Iterator[Found]:
    """Every import statement that can run, and whether it runs only when a function is called."""
    for node in nodes:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node, local
        elif isinstance(node, ast.If) and is_type_checking(node.test):
            yield from imports(node.orelse, local)
        else:
            inner = local or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            yield from imports(ast.iter_child_nodes(node), inner)


def graph(root: Path) -> dict[str, list[Edge]]:
    """Each module of the package at `root` (a folder), and what it imports of that package."""
    paths = {module_name(root, path): path for path in root.rglob("*.py")}
    edges: dict[str, list[Edge]] = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = edges.setdefault(name, [])
        for node, local in imports(ast.parse(path.read_text(), str(path)).body):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, *([base] if base else [])])
                targets = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in paths else base
                    for alias in node.names
                ]
            for target in targets:
                # importing a module runs its packages' `__init__` first, bar the importer's own
                while target in paths and not f"{name}.".startswith(f"{target}."):
                    found.append(Edge(target, node.lineno, local))
                    target = target.rpartition(".")[0]
    return edges


def components(edges: dict[str, list[Edge]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(edges[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, pending = work[-1]
            for edge in pending:
                if edge.target not in index:
                    index[edge.target] = low[edge.target] = len(index)
                    stack.append(edge.target)
                    on_stack.add(edge.target)
                    work.append((edge.target, iter(edges[edge.target])))
                    break
                if edge.target in on_stack:
                    low[node] = min(low[node], index[edge.target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    members = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        members.append(member)
                        if member == node:
                            break
                    if len(members) > 1:
                        found.append(sorted(members))
    return found


def shortest_cycle(edges: dict[str, list[Edge]], start: str) -> list[tuple[str, Edge]]:
    """The shortest way from `start` back to itself, as (importer, import) steps."""
    came: dict[str, tuple[str, Edge]] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for edge in edges[node]:
            if edge.target == start:
                steps = [(node, edge)]
                while node != start:
                    node, via = came[node]
                    steps.append((node, via))
                return steps[::-1]
            if edge.target not in came:
                came[edge.target] = (node, edge)
                queue.append(edge.target)
    return []


def describe(steps: list[tuple[str, Edge]]) -> str:
    links = (
        f"{name}:{edge.line}{' (in a function)' if edge.local else ''}" for name, edge in steps
    )
    return " -> ".join([*links, steps[0][0]])


def cycles(edges: dict[str, list[Edge]]) -> list[str]:
    """A shortest cycle through each module that is on one, each cycle once."""
    found: list[str] = []
    for members in components(edges):
        seen: set[frozenset[str]] = set()
        for start in members:
            steps = shortest_cycle(edges, start)
            key = frozenset(name for name, _ in steps)
            if key not in seen:
                seen.add(key)
                found.append(describe(steps))
    return found


def test_the_graph_counts_every_import_that_runs(tmp_path: Path) -> None:
    """The reader itself, on a package made for it: relative and absolute imports, a module
    and a name taken from a package, a package's `__init__`, a function's import; an import
    under `TYPE_CHECKING` is no edge."""
    sources = {
        "__init__.py": "from pkg.a import A\n",
        "a.py": "import typing\nif typing.TYPE_CHECKING:\n    from pkg import b\nA = 1\n",
        "b.py": "from . import a\nfrom .sub import thing\n",
        "sub/__init__.py": "thing = 1\n",
        "sub/c.py": "def f():\n    import pkg.b\n",
        "d.py": "from pkg.sub import c\n",
    }
    for name, text in sources.items():
        (tmp_path / "pkg" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "pkg" / name).write_text(text)
    edges = graph(tmp_path / "pkg")
    targets = {name: {(e.target, e.local) for e in found} for name, found in edges.items()}
    assert targets == {
        "pkg": {("pkg.a", False)},
        "pkg.a": set(),
        "pkg.b": {("pkg.a", False), ("pkg.sub", False)},
        "pkg.sub": set(),
        "pkg.sub.c": {("pkg.b", True)},
        "pkg.d": {("pkg.sub.c", False), ("pkg.sub", False)},
    }
    assert cycles(edges) == []
    (tmp_path / "pkg" / "a.py").write_text("def f():\n    from pkg.sub import c\n")
    (tmp_path / "pkg" / "sub" / "__init__.py").write_text("from pkg.b import *\n")
    assert sorted(cycles(graph(tmp_path / "pkg"))) == [
        "pkg.a:2 (in a function) -> pkg.sub.c:2 (in a function) -> pkg.b:1 -> pkg.a",
        "pkg.b:2 -> pkg.sub:1 -> pkg.b",
    ]


@pytest.mark.parametrize("root", [ROOT, ROOT.parent / "benchmarks" / "proto_server_bench"])
def test_no_import_cycle(root: Path) -> None:
    """In the product, and in the benchmarks (a distribution of their own)."""
    found = cycles(graph(root))
    assert not found, "import cycles (module:line of each import):\n" + "\n".join(found)


#: The layers, lowest first: a module imports its own layer and the ones before it, never one
#: after (docs/architecture.md); the client imports only `wire`, the stream checker only `wire`
#: and `core`. The top-level modules (the command line, the composition root) may import any.
LAYERS = ("wire", "core", "engine", "server")
ALLOWED = {"client": {"wire"}, "testing": {"wire", "core"}}
#: The server's rooms, lowest first; `process` and `store` share a tier (the store logs, and
#: the process's metrics time the store).
ROOMS = ({"process", "store"}, {"transport"}, {"rollouts"}, {"dialects"}, {"listener"})


def place(module: str) -> tuple[str, str | None]:
    """A module's layer (`proto_server.<layer>...`), and its room when it is in the server."""
    parts = module.split(".")
    room = parts[2] if parts[1:2] == ["server"] and len(parts) > 2 else None
    return (parts[1] if len(parts) > 2 else "", room)


def tier(room: str) -> int:
    return next(index for index, rooms in enumerate(ROOMS) if room in rooms)


def upward(edges: dict[str, list[Edge]]) -> list[str]:
    """Every import that goes up a layer, or up a room of the server, as `module:line -> target`."""
    found = []
    for module, imported in sorted(edges.items()):
        (layer, room) = place(module)
        for edge in imported:
            (target_layer, target_room) = place(edge.target)
            if not layer or not target_layer or (target_layer == layer and room == target_room):
                continue
            if layer in ALLOWED:
                wrong = target_layer != layer and target_layer not in ALLOWED[layer]
            elif layer in LAYERS and target_layer in LAYERS and target_layer != layer:
                wrong = LAYERS.index(target_layer) > LAYERS.index(layer)
            elif layer == "server" and room and target_room:
                wrong = tier(target_room) > tier(room)
            else:
                wrong = target_layer not in LAYERS or layer not in LAYERS
            if wrong:
                found.append(f"{module}:{edge.line} -> {edge.target}")
    return found


def test_no_import_goes_up_a_layer_or_up_a_room_of_the_server() -> None:
    found = upward(graph(ROOT))
    assert not found, "imports that go up (module:line -> what it imports):\n" + "\n".join(found)


def test_an_import_up_a_layer_or_a_room_is_found() -> None:
    edges = {
        "proto_server.core.a": [Edge("proto_server.engine.b", 3, True)],
        "proto_server.server.transport.c": [Edge("proto_server.server.rollouts.d", 4, False)],
        "proto_server.server.store.e": [Edge("proto_server.server.process.f", 5, False)],
        "proto_server.client.g": [Edge("proto_server.core.h", 6, False)],
    }
    assert upward(edges) == [
        "proto_server.client.g:6 -> proto_server.core.h",
        "proto_server.core.a:3 -> proto_server.engine.b",
        "proto_server.server.transport.c:4 -> proto_server.server.rollouts.d",
    ]
