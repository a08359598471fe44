"""One writer per scheduler queue, checked by reading the source (no module is imported).

`waiting`, `running`, `swapped` and the in-flight index (`in_flight`) are written only in
`vllm/core/scheduler.py`: the policies and a stage rollback decide, and the scheduler's
methods apply their decisions. Outside that module no code assigns, augments, deletes or
calls a mutating method on an attribute of those names. The scheduler and the modules it
hands its queues to never import each other, not even for type checking.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

pytestmark = pytest.mark.fast

REPO = pathlib.Path(__file__).resolve().parents[2]
OWNER = pathlib.Path("vllm/core/scheduler.py")
QUEUES = frozenset({"waiting", "running", "swapped", "in_flight"})
# deque, list and dict methods that change the container.
MUTATORS = frozenset(
    {
        "append",
        "appendleft",
        "extend",
        "extendleft",
        "insert",
        "remove",
        "pop",
        "popleft",
        "popitem",
        "clear",
        "sort",
        "reverse",
        "rotate",
        "update",
        "setdefault",
    }
)


def _queue_attribute(node: ast.expr) -> str | None:
    """The queue name when `node` is `x.<queue>` or `x.<queue>[...]`, else None."""
    if isinstance(node, ast.Subscript):
        node = node.value
    if isinstance(node, ast.Attribute) and node.attr in QUEUES:
        return node.attr
    return None


def queue_writes(source: str, filename: str) -> list[str]:
    """`line: what` for every write to a queue-named attribute in `source`."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = list(node.targets)
        for target in targets:
            elements = target.elts if isinstance(target, (ast.Tuple, ast.List)) else [target]
            for element in elements:
                if (name := _queue_attribute(element)) is not None:
                    found.append(f"{node.lineno}: {type(node).__name__.lower()} of .{name}")
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in MUTATORS
            and (name := _queue_attribute(node.func.value)) is not None
        ):
            found.append(f"{node.lineno}: .{name}.{node.func.attr}()")
    return found


def test_the_check_sees_each_kind_of_write() -> None:
    source = "\n".join(
        [
            "s.running = []",
            "s.waiting += [g]",
            "s.in_flight[k] = g",
            "del s.in_flight[k]",
            "a, s.swapped = 1, []",
            "s.swapped.append(g)",
            "s.running.clear()",
            "s.waiting.popleft()",
            "s.in_flight.pop(k)",
            "n = len(s.running) + sum(1 for g in s.waiting)",  # reads are fine
            "s.running_total = 0",
        ]
    )
    assert [w.split(":")[0] for w in queue_writes(source, "<case>")] == [
        str(i) for i in range(1, 10)
    ]


def test_scheduler_queues_are_written_only_by_the_scheduler() -> None:
    offenders = []
    for path in sorted((REPO / "vllm").rglob("*.py")):
        relative = path.relative_to(REPO)
        if relative == OWNER:
            continue
        source = path.read_text()
        if not any(f".{name}" in source for name in QUEUES):
            continue  # parsing only the files that name a queue keeps this test fast
        for write in queue_writes(source, str(relative)):
            offenders.append(f"{relative}:{write}")
    assert not offenders, (
        "only vllm/core/scheduler.py writes waiting/running/swapped/in_flight; call a public "
        f"Scheduler method instead: {offenders}"
    )


def _imports(path: pathlib.Path) -> set[str]:
    """Every `vllm.core` module `path` imports, `TYPE_CHECKING` blocks included."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return {name for name in names if name.startswith("vllm.core.")}


def test_no_import_circle_in_core() -> None:
    modules = {
        f"vllm.core.{path.stem}": path
        for path in (REPO / "vllm/core").glob("*.py")
        if path.stem != "__init__"
    }
    graph = {name: _imports(path) & modules.keys() for name, path in modules.items()}

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for nxt in graph[start]:
            if nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt})):
                return True
        return False

    circles = sorted(name for name in graph if reaches(name, name, {name}))
    assert not circles, f"vllm.core modules in an import circle (TYPE_CHECKING counted): {circles}"
