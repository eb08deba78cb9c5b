"""The rooms of the code and what each may import (docs/ARCHITECTURE.md, "Rooms").

Read from the source (imports outside `if TYPE_CHECKING:`, at module level or inside a function:
a lazy import is still a dependency): every module of wire/, client/, replication/ and qserver/
lies in one room, a room imports only the rooms its rule allows, no two modules import each other
even through others (no cycles), and no module is over 800 lines.
"""
from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parent.parent
PACKAGES = ("wire", "client", "replication", "qserver")
LINES_MAX = 800

# Room -> the rooms it may import besides itself. A room is the longest prefix listed here.
# Shared leaves every server room may use: qserver.config (settings), qserver.metrics, and
# qserver.http_errors (the error envelope of every HTTP surface), qserver.sealing (secrets the
# map keeps, sealed with the cluster secret).
SERVER_LEAVES = ("qserver.config", "qserver.metrics", "qserver.http_errors", "qserver.sealing", "qserver.tracing")
ALLOWED: dict[str, tuple[str, ...]] = {
    "wire": (),
    "replication": ("wire",),
    "client": ("wire", "replication"),        # queue option names and their defaults
    "qserver.storage": ("replication", "wire", *SERVER_LEAVES),
    "qserver.core": ("qserver.storage", "replication", "wire", *SERVER_LEAVES),
    "qserver.transport": ("replication", "wire", "qserver.core.failstop", *SERVER_LEAVES),
    "qserver.cluster": ("qserver.core", "qserver.storage", "qserver.transport", "replication", "wire", *SERVER_LEAVES),
    "qserver.api": ("qserver.core", "qserver.cluster", "qserver.storage", "qserver.services", "replication", "wire",
                    *SERVER_LEAVES),
    # Features reach the node through the services door only: its commands, never the engine's
    # insides, the pairs, the coordinator or the storage.
    "qserver.features": ("qserver.services", "qserver.core.commands", "qserver.api.auth", "qserver.api.http_common",
                         "replication", "wire", "client", *SERVER_LEAVES),
    # The console acts as its signed-in client, through the client library (delegated calls),
    # and reads the node's own state only through the services door.
    "qserver.console": ("qserver.services", "qserver.core.grants", "qserver.api.auth", "qserver.features.delegated",
                        "replication", "wire", "client", *SERVER_LEAVES),
    "qserver.services": ("qserver.core", "qserver.cluster", "qserver.storage", "qserver.api.auth", "replication",
                         "wire", *SERVER_LEAVES),
    "qserver.config": ("replication", "wire"),
    "qserver.metrics": (),
    "qserver.http_errors": ("wire",),
    "qserver.sealing": (),          # secrets at rest in the map (access keys, forwards' credentials)
    "qserver.tracing": ("replication",),     # the node's spans (docs/TRACING.md): the batch's operations
}
# The top of the node: these wire the rooms together and may import anything.
ANYTHING = ("qserver.node", "qserver.assembly", "qserver.cli", "qserver.__main__", "qserver.dev", "qserver")


def modules() -> Iterator[tuple[str, Path]]:
    for package in PACKAGES:
        for path in sorted((REPOSITORY / package).rglob("*.py")):
            parts = path.relative_to(REPOSITORY).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            yield ".".join(parts), path


def under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def room_of(module: str) -> str | None:
    rooms = [room for room in (*ALLOWED, *ANYTHING) if under(module, room)]
    return max(rooms, key=len) if rooms else None


def imports_of(path: Path, known: set[str]) -> set[str]:
    """The project modules `path` imports at run time."""
    tree = ast.parse(path.read_text(), filename=str(path))
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            for statement in node.body:
                skip.update(id(child) for child in ast.walk(statement))
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from a.b import c` is a dependency on a.b.c when that is a module, else on a.b.
            names = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in known else node.module
                     for alias in node.names]
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def graph() -> dict[str, set[str]]:
    paths = dict(modules())
    known = set(paths)
    return {module: imports_of(path, known) - {module} for module, path in paths.items()}


def test_every_module_lies_in_a_room() -> None:
    assert [module for module, _ in modules() if room_of(module) is None] == []


def test_each_room_imports_only_what_its_rule_allows() -> None:
    wrong = []
    for module, imported in sorted(graph().items()):
        room = room_of(module)
        if room is None or room in ANYTHING:
            continue
        allowed = (room, *ALLOWED[room])
        # A package's __init__ may import its own modules; a module may import its package.
        wrong += [f"{module} imports {name}" for name in sorted(imported)
                  if not any(under(name, prefix) for prefix in allowed) and not under(module, name)]
    assert wrong == []


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_module_imports_itself_back_through_others() -> None:
    # A package importing its own modules (its __init__) is not a cycle of design: leave out
    # the edges from a module to the package that contains it.
    edges = {module: {name for name in imported if not under(module, name)} for module, imported in graph().items()}
    assert cycles(edges) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_is_over_the_line_limit() -> None:
    long = {module: count for module, path in modules()
            if (count := len(path.read_text().splitlines())) > LINES_MAX}
    assert long == {}
