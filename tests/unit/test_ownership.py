"""Ownership rules that can be read off the code (docs/ARCHITECTURE.md, "Ownership rules"); no
module is imported, the sources are parsed (well under a second).

- No module reaches into the engine's or the recovery's private names: an attribute access
  `x._name` where `x` is not `self` / `cls`, `_name` is not defined in the module itself, and
  a module of `vllm/engine/` or `vllm/resilience/` defines it (`engine._fail(...)`,
  `engine._pending_outputs`). The recovery reaches the engine through the public methods of
  `EngineControl` instead.
- No import circle at all, `TYPE_CHECKING` imports included (`test_import_layers.py` checks
  run-time circles and packages; here every module-level edge counts): a helper that needs the
  engine takes a protocol, not the engine's class.
"""

from __future__ import annotations

import ast
import pathlib
from collections import defaultdict

import pytest

from tests.unit.test_import_layers import MODULES, _cycles, imports, tree_of

pytestmark = pytest.mark.fast

REPO = pathlib.Path(__file__).resolve().parents[2]

# The packages whose private names no other module may use.
GUARDED = ("vllm/engine/", "vllm/resilience/")

# Circles other work removes (the scheduler and its two policies, each typed against the
# whole scheduler: issue 39, one writer per scheduler queue). Once one is gone, delete it here.
KNOWN_CYCLES: list[frozenset[str]] = []


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def scan(tree: ast.AST) -> tuple[set[str], list[ast.Attribute]]:
    """(every name a module defines or binds: functions, classes and methods, assignments to
    names and to `self.` / `cls.` attributes, imports, parameters; its reads of a private
    attribute of anything but `self` / `cls`), in one walk."""
    names: set[str] = set()
    reaches: list[ast.Attribute] = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and _private(node.attr)
            and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
        ):
            reaches.append(node)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id in ("self", "cls")
        ):
            names.add(node.attr)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
    return names, reaches


def private_reaches(trees: dict[str, ast.AST], guarded: tuple[str, ...] = GUARDED) -> list[str]:
    """`path:line: expression` for each access to another module's guarded private name
    (`trees`: each module's parsed source by path)."""
    scanned = {path: scan(tree) for path, tree in trees.items()}
    owned: dict[str, set[str]] = defaultdict(set)  # private name -> guarded modules defining it
    for path, (names, _) in scanned.items():
        if path.startswith(guarded):
            for name in filter(_private, names):
                owned[name].add(path)
    found = []
    for path, (names, reaches) in scanned.items():
        for node in reaches:
            if node.attr in names or not owned.get(node.attr):
                continue
            found.append(
                f"{path}:{node.lineno}: {ast.unparse(node)} (private to "
                f"{', '.join(sorted(owned[node.attr]))})"
            )
    return found


def test_no_module_uses_the_engines_private_names() -> None:
    trees = {str(path.relative_to(REPO)): tree_of(module) for module, path in MODULES.items()}
    found = private_reaches(trees)
    assert not found, "use a public method of the owner instead:\n" + "\n".join(found)


def test_the_check_sees_a_private_reach() -> None:
    engine = "class LLMEngine:\n    def _fail(self):\n        self._pending = []\n"
    helper = (
        "def recover(engine, other):\n"
        "    engine._fail()\n"  # another module's private method
        "    other.engine._pending.clear()\n"  # another module's private attribute
        "    engine._local = 1\n"  # defined here: its own
        "    engine.fail()\n"
    )
    found = private_reaches(
        {
            "vllm/engine/llm_engine.py": ast.parse(engine),
            "vllm/resilience/coordinator.py": ast.parse(helper),
        },
        guarded=("vllm/engine/",),
    )
    assert [f.split(": ")[1].split(" (")[0] for f in found] == [
        "engine._fail",
        "other.engine._pending",
    ], found


def test_no_import_circle_even_for_types() -> None:
    graph: dict[str, set[str]] = defaultdict(set)
    for module in MODULES:
        graph[module].update(target for target, _, _ in imports(module))
    cycles = [frozenset(c) for c in _cycles(graph)]
    new = [sorted(c) for c in cycles if c not in KNOWN_CYCLES]
    assert not new, f"import circles (TYPE_CHECKING imports included): {new}"
    gone = [sorted(c) for c in KNOWN_CYCLES if c not in cycles]
    assert not gone, f"no longer a circle: delete it from KNOWN_CYCLES: {gone}"
