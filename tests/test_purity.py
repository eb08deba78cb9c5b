"""The protocol cores in replication/ stay pure (docs/ARCHITECTURE.md, "Conventions"; replication/__init__.py).

They import no asyncio, aiohttp, lmdb, time, socket or threading: time arrives as arguments,
storage through `StoreReader`. Randomness is an injected `random.Random`; a core module may
name that type in annotations (queue_core.py imports `random` for exactly that, and with
`from __future__ import annotations` the name is never even evaluated), but it never calls
into `random` nor makes a `Random()` of its own. The last test checks what an import really
loads, following the project modules the cores import.
"""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parent.parent
CORE_MODULES = sorted((REPOSITORY / "replication").glob("*.py"))
FORBIDDEN = frozenset({"asyncio", "aiohttp", "lmdb", "time", "socket", "threading", "random", "uvloop",
                       "selectors", "select", "ssl", "subprocess", "concurrent"})
TYPE_ONLY = frozenset({"random"})   # may be imported to name a type in annotations, nothing more


def module_id(path: Path) -> str:
    return path.stem


def parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def type_checking_blocks(tree: ast.Module) -> set[int]:
    """ids of every node under `if TYPE_CHECKING:` (never run)."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            for statement in node.body:
                inside.update(id(child) for child in ast.walk(statement))
    return inside


def imported_modules(tree: ast.Module) -> list[tuple[str, ast.stmt]]:
    found: list[tuple[str, ast.stmt]] = []
    skip = type_checking_blocks(tree)
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found += [(alias.name, node) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module, node))
        elif isinstance(node, ast.Call) and ast.unparse(node.func) in ("__import__", "importlib.import_module"):
            found.append((ast.unparse(node.args[0]) if node.args else "?", node))  # type: ignore[arg-type]
    return found


def annotation_nodes(tree: ast.Module) -> set[int]:
    inside: set[int] = set()
    for node in ast.walk(tree):
        annotations: list[ast.expr | None] = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            arguments = node.args
            every = arguments.posonlyargs + arguments.args + arguments.kwonlyargs
            every += [a for a in (arguments.vararg, arguments.kwarg) if a is not None]
            annotations = [a.annotation for a in every] + [node.returns]
        elif isinstance(node, ast.AnnAssign):
            annotations = [node.annotation]
        for annotation in annotations:
            if annotation is not None:
                inside.update(id(child) for child in ast.walk(annotation))
    return inside


def test_there_are_core_modules_to_check() -> None:
    assert {path.stem for path in CORE_MODULES} >= {"queue_core", "store", "options", "operations"}


@pytest.mark.parametrize("path", CORE_MODULES, ids=module_id)
def test_a_core_module_imports_nothing_that_waits_or_does_io(path: Path) -> None:
    tree = parse(path)
    for name, node in imported_modules(tree):
        top = name.split(".")[0]
        if top not in FORBIDDEN:
            continue
        assert top in TYPE_ONLY and isinstance(node, ast.Import) and node.col_offset == 0, (
            f"{path.name}:{node.lineno} imports {name}")


@pytest.mark.parametrize("path", CORE_MODULES, ids=module_id)
def test_a_core_module_uses_random_only_to_name_the_injected_type(path: Path) -> None:
    tree = parse(path)
    in_annotations = annotation_nodes(tree) | type_checking_blocks(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id in TYPE_ONLY:
            assert id(node) in in_annotations, f"{path.name}:{node.lineno} uses {node.id} outside a type annotation"
        if isinstance(node, ast.Call):
            called = ast.unparse(node.func)
            assert called.split(".")[-1] not in ("Random", "SystemRandom"), (
                f"{path.name}:{node.lineno} makes its own random source: {called}()")


def test_a_core_that_names_random_in_annotations_never_evaluates_them() -> None:
    for path in CORE_MODULES:
        tree = parse(path)
        if any(name == "random" for name, _ in imported_modules(tree)):
            future = [node for node in tree.body if isinstance(node, ast.ImportFrom) and node.module == "__future__"]
            assert any(alias.name == "annotations" for node in future for alias in node.names), path.name


def test_importing_the_cores_loads_no_event_loop_network_or_storage_module() -> None:
    """What `import replication...` really pulls in, through the project modules it imports
    (the error catalog lives in the client package), in a fresh interpreter."""
    modules = ", ".join(f"replication.{path.stem}" for path in CORE_MODULES if path.stem != "__init__")
    program = (
        "import sys, json\n"
        "import dataclasses, heapq, bisect, enum, re, typing, random\n"
        "before = set(sys.modules)\n"
        f"import {modules}\n"
        "print(json.dumps(sorted(set(sys.modules) - before)))\n")
    answer = subprocess.run([sys.executable, "-c", program], cwd=REPOSITORY, capture_output=True, text=True,
                            check=True, timeout=60)
    loaded = json.loads(answer.stdout)
    forbidden = sorted({name.split(".")[0] for name in loaded} & (FORBIDDEN - TYPE_ONLY))
    chain = [name for name in loaded if name.split(".")[0] in ("client", "qserver")]
    assert forbidden == [], f"importing the cores loads {forbidden} (via {chain})"
