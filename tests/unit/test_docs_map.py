"""docs/ARCHITECTURE.md is a true map: every module under vllm/ is named there (as
`vllm/<path>.py` in backticks), and it points at nothing outside the repository."""

from __future__ import annotations

import pathlib
import re

import pytest

pytestmark = pytest.mark.fast

REPO = pathlib.Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "ARCHITECTURE.md"


def _modules() -> list[str]:
    return sorted(
        p.relative_to(REPO).as_posix()
        for p in (REPO / "vllm").rglob("*.py")
        if p.name != "__init__.py"
    )


def _named(text: str) -> set[str]:
    """Every backticked span of the document."""
    return set(re.findall(r"`([^`\n]+)`", text))


def test_every_module_is_on_the_map() -> None:
    named = _named(DOC.read_text())
    missing = [module for module in _modules() if module not in named]
    assert not missing, f"add a line for each to {DOC.relative_to(REPO)}: {missing}"


def test_the_map_points_inside_the_repository() -> None:
    text = DOC.read_text()
    assert "../" not in text and "DESIGN.md" not in text
    # Every `vllm/...py` path named exists, except modules announced before they land.
    for name in _named(text):
        if name.startswith("vllm/") and name.endswith(".py"):
            assert (REPO / name).exists(), name


def test_the_check_notices_a_missing_module() -> None:
    assert "vllm/sequence.py" not in _named("`vllm/sequence.pyc` and vllm/sequence.py bare")
