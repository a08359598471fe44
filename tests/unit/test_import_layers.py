"""The package's layers, kept by reading its imports (no module is imported; milliseconds).

From the bottom: shared helpers, torch-free tables and the stage-failure errors; the request
records; the config; the distributed layer; the model code, the scheduler, the grammar engine
and the LoRA layers; the worker; the executors; the recovery from stage failures; the engine;
the entry points; the Ray Data batch layer and the CLI on top. A module imports only from its
own layer or below (a `TYPE_CHECKING` import included: a type that points up is a dependency
that points up), and no two modules import each other at run time, through any chain (a cycle
makes the import order matter and hides which piece owns what).
"""

from __future__ import annotations

import ast
import functools
import pathlib
from collections import defaultdict
from collections.abc import Iterator

import pytest

pytestmark = pytest.mark.fast

REPO = pathlib.Path(__file__).resolve().parents[2]

# Lowest first. A module belongs to the entry with the longest prefix that names it.
LAYERS: list[tuple[str, ...]] = [
    (
        "vllm",  # the package root: its public names (LLM, ...) load lazily, on first use
        "vllm.envs",
        "vllm.logger",
        "vllm.utils",
        "vllm._C",
        "vllm._custom_ops",
        "vllm.request_failure",
        "vllm.resilience.errors",  # raised by the executors, caught by the engine and server
        "vllm.model_registry",
        "vllm.distributed.net_utils",
        "vllm.distributed.layer_split",
    ),
    (
        "vllm.structured_output.params",
        "vllm.lora.request",
        "vllm.lora.peft_config",
        "vllm.structured_output.lark_to_ebnf",
        "vllm.sampling_params",
        "vllm.pooling_params",
        "vllm.inputs",
        "vllm.sequence",
        "vllm.spec_decode.config",
        "vllm.spec_decode.ngram",
        "vllm.step_records",
        "vllm.outputs",
        "vllm.transformers_utils",
    ),
    ("vllm.config",),
    ("vllm.distributed",),
    ("vllm.model_executor", "vllm.core", "vllm.structured_output", "vllm.lora", "vllm.spec_decode"),
    ("vllm.worker",),
    ("vllm.executor",),
    ("vllm.resilience",),  # what happens when a stage fails: reaches the engine by a protocol
    ("vllm.engine",),
    ("vllm.entrypoints",),
    ("vllm.batch", "vllm.scripts"),
]


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in (REPO / "vllm").rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _place(module: str) -> tuple[int, str]:
    """(layer, the LAYERS entry that names the module)."""
    best, level = "", -1
    for i, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > len(best):
                best, level = prefix, i
    assert level >= 0, f"{module} is in no layer: add it to LAYERS"
    return level, best


def layer_of(module: str) -> int:
    return _place(module)[0]


def unit_of(module: str) -> str:
    """The piece a module belongs to: its LAYERS entry, or its top package under the root."""
    prefix = _place(module)[1]
    return ".".join(module.split(".")[:2]) if prefix == "vllm" else prefix


def _resolve(name: str) -> str | None:
    """The module an imported name lives in (`vllm.a.b.Name` -> `vllm.a.b`)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            inside.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return inside


@functools.cache
def tree_of(module: str) -> ast.Module:
    """The parsed source of `module` (parsed once per test session: several checks read it)."""
    path = MODULES[module]
    return ast.parse(path.read_text(), str(path))


def imports(module: str) -> Iterator[tuple[str, int, bool]]:
    """(imported module, line, at run time) for every vllm import in `module`."""
    path = MODULES[module]
    tree = tree_of(module)
    typing_only = _type_checking_nodes(tree)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        targets = {_resolve(n) for n in names if n == "vllm" or n.startswith("vllm.")}
        # `from vllm import envs` names vllm.envs; the bare package counts only if nothing finer.
        if len(targets - {"vllm"}) > 0:
            targets.discard("vllm")
        for target in targets - {None, module}:
            assert target is not None
            yield target, node.lineno, id(node) not in typing_only


def test_every_module_has_a_layer() -> None:
    for module in MODULES:
        layer_of(module)


def test_no_import_points_up_a_layer() -> None:
    upward = [
        f"{MODULES[m].relative_to(REPO)}:{line} imports {t} (layer {layer_of(m)} -> {layer_of(t)})"
        for m in MODULES
        for t, line, _ in imports(m)
        if layer_of(t) > layer_of(m)
    ]
    assert not upward, "\n".join(upward)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
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
                found.append(sorted(component))

    for v in list(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_at_run_time() -> None:
    graph: dict[str, set[str]] = defaultdict(set)
    for module in MODULES:
        graph[module].update(t for t, _, runtime in imports(module) if runtime)
    assert not _cycles(graph)


def test_no_two_packages_depend_on_each_other() -> None:
    """Between packages (LAYERS entries) even a typing-only import counts; inside one, a
    policy may name the scheduler it is typed against."""
    graph: dict[str, set[str]] = defaultdict(set)
    for module in MODULES:
        for target, _, _ in imports(module):
            a, b = unit_of(module), unit_of(target)
            if a != b:
                graph[a].add(b)
    assert not _cycles(graph)


def test_the_checks_see_a_cycle_and_an_upward_import() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c"]]
    assert layer_of("vllm.worker.worker") > layer_of("vllm.distributed.parallel_state")
    assert layer_of("vllm.structured_output.params") < layer_of("vllm.structured_output.matcher")
    # sampling_params imports the structured-output params (same layer), not the matcher
    found = {t for t, _, _ in imports("vllm.sampling_params")}
    assert "vllm.structured_output.params" in found
