"""Every package the code imports is declared where its users get it, the pins agree with the
package's ranges, and every module of `vllm/` imports on what is declared (a fresh
interpreter, so nothing a test imported earlier hides a missing package).

Two declarations, checked against each other:
- setup.py: `INSTALL_REQUIRES` (what `pip install .` brings: everything `vllm/` imports) and
  the extras `[test]` / `[dev]`, as ranges;
- requirements/{runtime,test,dev}.txt: the same names pinned, which `make install` installs
  (requirements.txt includes them all) after torch, pinned by the Makefile.
A package that happens to be installed -- by hand, or as another package's dependency today
-- is no promise on a fresh machine."""

from __future__ import annotations

import ast
import importlib.metadata
import pathlib
import re
import subprocess
import sys

from packaging.requirements import Requirement
from packaging.version import Version

REPO = pathlib.Path(__file__).resolve().parents[2]
REQUIREMENTS = REPO / "requirements"
# Top-level names that are the project's own (vllm) or the tests' and benchmarks' modules.
LOCAL_ROOTS = ("vllm", "tests", "benchmarks", "examples")
# The files outside those roots that import packages.
ROOT_SCRIPTS = ("run.py", "masstest.py")


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _setup_lists() -> dict[str, list[str]]:
    """setup.py's INSTALL_REQUIRES, TEST_REQUIRES and DEV_REQUIRES, read without running it."""
    tree = ast.parse((REPO / "setup.py").read_text())
    lists: dict[str, list[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            if isinstance(target, ast.Name) and target.id.endswith("_REQUIRES"):
                items: list[str] = []
                assert isinstance(node.value, ast.List), f"{target.id} must be a list literal"
                for elt in node.value.elts:
                    if isinstance(elt, ast.Starred):  # [*TEST_REQUIRES, ...]
                        assert isinstance(elt.value, ast.Name)
                        items += lists[elt.value.id]
                    else:
                        items.append(ast.literal_eval(elt))
                lists[target.id] = items
    assert {"INSTALL_REQUIRES", "TEST_REQUIRES", "DEV_REQUIRES"} <= set(lists), sorted(lists)
    return lists


def _names(specs: list[str]) -> set[str]:
    return {_normalise(Requirement(spec).name) for spec in specs}


def _pinned(path: pathlib.Path) -> dict[str, Requirement]:
    """The requirements a requirements file lists itself (its `-r` includes not followed)."""
    found = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line and not line.startswith("-"):
            requirement = Requirement(line)
            found[_normalise(requirement.name)] = requirement
    return found


def _includes(path: pathlib.Path) -> list[pathlib.Path]:
    return [
        (path.parent / line.split(None, 1)[1]).resolve()
        for line in path.read_text().splitlines()
        if line.strip().startswith("-r ")
    ]


def _makefile_torch() -> str:
    match = re.search(r"install -q torch==([0-9.]+)", (REPO / "Makefile").read_text())
    assert match, "the Makefile no longer installs a pinned torch first"
    return match.group(1)


def _local_names() -> set[str]:
    names = set(LOCAL_ROOTS) | {pathlib.Path(s).stem for s in ROOT_SCRIPTS}
    for root in LOCAL_ROOTS:
        names |= {p.stem for p in (REPO / root).glob("*.py")}
        names |= {p.parent.name for p in (REPO / root).glob("*/__init__.py")}
    return names


def _third_party_imports(paths: list[pathlib.Path]) -> dict[str, set[str]]:
    """Top-level module name -> files importing it (lazy imports inside functions too)."""
    local = _local_names()
    found: dict[str, set[str]] = {}
    for path in paths:
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


def _undeclared(paths: list[pathlib.Path], declared: set[str]) -> list[str]:
    # Which installed distribution provides each import name (e.g. yaml -> PyYAML).
    providers = importlib.metadata.packages_distributions()
    missing = []
    for top, files in sorted(_third_party_imports(paths).items()):
        dists = {_normalise(d) for d in providers.get(top, [top])}
        if not dists & declared:
            missing.append(f"{top} (from {', '.join(sorted(dists))}) in {sorted(files)[:3]}")
    return missing


def test_the_runtime_imports_only_install_requires():
    """What `pip install .` brings is enough for every module of vllm/ (the test extras are
    not installed for a user)."""
    declared = _names(_setup_lists()["INSTALL_REQUIRES"])
    missing = _undeclared(sorted((REPO / "vllm").rglob("*.py")), declared)
    assert not missing, "vllm/ imports what setup.py's INSTALL_REQUIRES lacks: " + "; ".join(
        missing
    )


def test_tests_and_benchmarks_import_only_what_is_declared():
    lists = _setup_lists()
    declared = _names(lists["INSTALL_REQUIRES"] + lists["DEV_REQUIRES"])
    paths = [p for root in LOCAL_ROOTS[1:] for p in (REPO / root).rglob("*.py")]
    paths += [REPO / s for s in ROOT_SCRIPTS]
    missing = _undeclared(paths, declared)
    assert not missing, "imported but in neither INSTALL_REQUIRES nor an extra: " + "; ".join(
        missing
    )


def test_pins_are_the_declared_packages_within_their_ranges():
    """requirements/runtime.txt pins exactly INSTALL_REQUIRES (torch: the Makefile), test.txt
    the [test] extra, dev.txt what [dev] adds; each pinned version is inside setup.py's range;
    requirements.txt (make install) includes them all."""
    lists = _setup_lists()
    files = {
        "runtime.txt": lists["INSTALL_REQUIRES"],
        "test.txt": lists["TEST_REQUIRES"],
        "dev.txt": [s for s in lists["DEV_REQUIRES"] if s not in lists["TEST_REQUIRES"]],
    }
    ranges = {
        _normalise(Requirement(s).name): Requirement(s)
        for s in lists["INSTALL_REQUIRES"] + lists["DEV_REQUIRES"]
    }
    for name, specs in files.items():
        pinned = _pinned(REQUIREMENTS / name)
        expected = _names(specs) - {"torch"}  # torch: installed first by the Makefile
        assert set(pinned) == expected, (
            f"requirements/{name} lists {sorted(set(pinned) - expected)} beyond setup.py and "
            f"lacks {sorted(expected - set(pinned))}"
        )
        for key, requirement in pinned.items():
            exact = [s.version for s in requirement.specifier if s.operator == "=="]
            if exact:
                assert ranges[key].specifier.contains(Version(exact[0]), prereleases=True), (
                    f"requirements/{name} pins {requirement}, outside setup.py's {ranges[key]}"
                )
    torch = _makefile_torch()
    assert ranges["torch"].specifier.contains(Version(torch)), (torch, str(ranges["torch"]))
    assert ranges["torch"].specifier.contains(Version(torch + "+cpu"))  # the local build
    # make install: requirements.txt reaches every file above through its includes.
    reached, todo = set(), [REPO / "requirements.txt"]
    while todo:
        path = todo.pop()
        reached.add(path.name)
        todo += _includes(path)
    assert set(files) <= reached, sorted(reached)


def test_every_vllm_module_imports_in_a_fresh_interpreter():
    modules = []
    for path in sorted((REPO / "vllm").rglob("*.py")):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules.append(".".join(parts))
    code = (
        "import importlib, sys\n"
        "failed = []\n"
        f"for name in {modules!r}:\n"
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
