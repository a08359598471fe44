"""vllm/envs.py is the one registry of environment variables (torch-free, milliseconds).

A static scan of vllm/ fails on any direct `os.environ` / `os.getenv` read of a `VLLM_*`
variable outside envs.py, on any `"VLLM_"` prefix scan, and on any `envs.get_*("NAME")` call
naming an unregistered variable.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

from vllm import envs

pytestmark = pytest.mark.fast

VLLM_DIR = pathlib.Path(__file__).resolve().parents[2] / "vllm"


def _sources() -> list[pathlib.Path]:
    return sorted(p for p in VLLM_DIR.rglob("*.py") if p.name != "envs.py" or p.parent != VLLM_DIR)


def _module_strings(tree: ast.Module) -> dict[str, str]:
    """Module-level `NAME = "string"` constants (a key may be read through one)."""
    found = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            if isinstance(node.value.value, str):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        found[target.id] = node.value.value
    return found


def _is_os_environ(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "environ"
        and isinstance(node.value, ast.Name)
        and node.value.id == "os"
    )


def _key(node: ast.AST, constants: dict[str, str]) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Name):
        return constants.get(node.id)
    return None


def _direct_reads(path: pathlib.Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    constants = _module_strings(tree)
    bad = []
    for node in ast.walk(tree):
        key = None
        if isinstance(node, ast.Subscript) and _is_os_environ(node.value):
            key = _key(node.slice, constants)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            func = node.func
            if func.attr in ("get", "setdefault", "pop") and _is_os_environ(func.value):
                key = _key(node.args[0], constants)
            elif (
                func.attr == "getenv" and isinstance(func.value, ast.Name) and func.value.id == "os"
            ):
                key = _key(node.args[0], constants)
            elif func.attr == "startswith" and _key(node.args[0], constants) == "VLLM_":
                bad.append(f"{path.name}:{node.lineno} prefix scan for VLLM_")
        if key is not None and key.startswith("VLLM_"):
            bad.append(f"{path.relative_to(VLLM_DIR.parent)}:{node.lineno} reads {key}")
    return bad


def test_no_vllm_variable_is_read_outside_envs() -> None:
    bad = [entry for path in _sources() for entry in _direct_reads(path)]
    assert not bad, "read these through vllm.envs (and register them there):\n" + "\n".join(bad)


def test_every_envs_accessor_call_names_a_registered_variable() -> None:
    unknown = []
    for path in _sources():
        tree = ast.parse(path.read_text(), str(path))
        constants = _module_strings(tree)
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "envs"
                and node.func.attr.startswith("get_")
                and node.args
            ):
                key = _key(node.args[0], constants)
                if key is None or key not in envs.ENV_VARS:
                    unknown.append(f"{path.name}:{node.lineno} {key!r}")
    assert not unknown, unknown


def test_every_registered_variable_has_a_doc_type_and_parsable_default() -> None:
    assert envs.ENV_VARS
    for name, var in envs.ENV_VARS.items():
        assert name == var.name and name.startswith("VLLM_")
        assert var.doc.strip() and "\n" not in var.doc, name
        assert var.type in (str, int, float, bool), name
        getter = {str: envs.get_str, int: envs.get_int, float: envs.get_float, bool: envs.get_bool}
        getter[var.type](name)  # the default parses as the declared type
    for name, doc in envs.OTHER_VARS.items():
        assert not name.startswith("VLLM_") and doc.strip(), name


def test_accessors_read_at_call_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_PP_STEP_TIMEOUT_S", raising=False)
    assert envs.get_float("VLLM_PP_STEP_TIMEOUT_S") == 60.0
    monkeypatch.setenv("VLLM_PP_STEP_TIMEOUT_S", " 2.5 ")
    assert envs.get_float("VLLM_PP_STEP_TIMEOUT_S") == 2.5
    monkeypatch.setenv("VLLM_PP_STEP_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="VLLM_PP_STEP_TIMEOUT_S"):
        envs.get_float("VLLM_PP_STEP_TIMEOUT_S")
    monkeypatch.setenv("VLLM_CPU_MALLOC_TUNING", "0")
    assert envs.get_bool("VLLM_CPU_MALLOC_TUNING") is False
    monkeypatch.setenv("VLLM_CPU_MALLOC_TUNING", "maybe")
    with pytest.raises(ValueError, match="VLLM_CPU_MALLOC_TUNING"):
        envs.get_bool("VLLM_CPU_MALLOC_TUNING")
    monkeypatch.setenv("VLLM_CPU_THREADS_PER_STAGE", "")
    assert envs.get_int("VLLM_CPU_THREADS_PER_STAGE") == 0  # empty means the default
    with pytest.raises(KeyError):
        envs.get_str("VLLM_NOT_REGISTERED")


def test_environment_to_forward_is_exactly_the_set_registered_variables(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in envs.ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "2,2")
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "WARNING")
    monkeypatch.setenv("VLLM_API_KEY", "secret")  # registered, but not for the stages
    monkeypatch.setenv("VLLM_SOMETHING_UNREGISTERED", "1")
    assert envs.environment_to_forward() == {
        "VLLM_PP_LAYER_PARTITION": "2,2",
        "VLLM_LOGGING_LEVEL": "WARNING",
    }
