"""Every package the code imports is declared, and every module of `vllm/` imports on what is
declared (a fresh interpreter, so nothing a test imported earlier hides a missing package).

A package that happens to be installed -- by hand, or as another package's dependency today
-- is no promise on a fresh machine: `make install` installs `requirements.txt` (and torch,
pinned, from the Makefile) and nothing else."""

from __future__ import annotations

import ast
import importlib.metadata
import pathlib
import re
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]
# Installed by the Makefile before the requirements (pinned: any other spec pulls CUDA wheels).
MAKEFILE_PACKAGES = {"torch"}
# Top-level names that are the project's own (vllm) or the tests' and benchmarks' modules.
LOCAL_ROOTS = ("vllm", "tests", "benchmarks", "examples")


def _declared() -> set[str]:
    text = (REPO / "requirements.txt").read_text()
    names = re.findall(r"^\s*([A-Za-z0-9_.\-]+)", text, re.M)
    return {_normalise(n) for n in names} | MAKEFILE_PACKAGES


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _local_names() -> set[str]:
    names = set(LOCAL_ROOTS) | {"run", "masstest"}
    for root in LOCAL_ROOTS:
        names |= {p.stem for p in (REPO / root).glob("*.py")}
        names |= {p.parent.name for p in (REPO / root).glob("*/__init__.py")}
    return names


def _third_party_imports() -> dict[str, set[str]]:
    """Top-level module name -> files importing it (lazy imports inside functions too)."""
    local = _local_names()
    found: dict[str, set[str]] = {}
    files = [p for root in LOCAL_ROOTS for p in (REPO / root).rglob("*.py")]
    for path in [*files, REPO / "run.py", REPO / "masstest.py", REPO / "setup.py"]:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            else:
                continue
            for module in modules:
                top = module.split(".")[0]
                if top in sys.stdlib_module_names or top in local or top.startswith("_"):
                    continue
                found.setdefault(top, set()).add(str(path.relative_to(REPO)))
    return found


def test_every_third_party_import_is_declared():
    declared = _declared()
    # Which installed distribution provides each import name (e.g. yaml -> PyYAML).
    providers = importlib.metadata.packages_distributions()
    missing = []
    for top, files in sorted(_third_party_imports().items()):
        if top == "setuptools":  # setup.py's build backend, not a runtime package
            continue
        dists = {_normalise(d) for d in providers.get(top, [top])}
        if not dists & declared:
            missing.append(f"{top} (from {', '.join(sorted(dists))}) in {sorted(files)[:3]}")
    assert not missing, "imported but not in requirements.txt: " + "; ".join(missing)


def _vllm_modules() -> list[str]:
    modules = []
    for path in sorted((REPO / "vllm").rglob("*.py")):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules.append(".".join(parts))
    return modules


def test_every_vllm_module_imports_in_a_fresh_interpreter():
    code = (
        "import importlib, sys\n"
        "failed = []\n"
        f"for name in {_vllm_modules()!r}:\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception as exc:\n"
        "        failed.append(f'{name}: {type(exc).__name__}: {exc}')\n"
        "print('\\n'.join(failed))\n"
        "sys.exit(1 if failed else 0)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
