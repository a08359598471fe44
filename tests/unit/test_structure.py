"""Static and torch-free checks that keep one place for each thing (milliseconds).

- Every `tcp://` rendezvous URL is built by `get_distributed_init_method`, which brackets
  IPv6 literals; a hand-built one would break IPv6 clusters.
- The beam-search score has one definition (`vllm.sequence.beam_search_score`), used by
  `Sequence.get_beam_search_score` and therefore by beam search and by `RequestOutput`.
- No issue numbers in the product (code, docs, benchmarks).
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

from vllm.sequence import Logprob, Sequence, beam_search_score

pytestmark = pytest.mark.fast

REPO = pathlib.Path(__file__).resolve().parents[2]


def _python_files() -> list[pathlib.Path]:
    roots = [REPO / "vllm", REPO / "tests", REPO / "benchmarks", REPO / "examples"]
    files = [p for root in roots for p in root.rglob("*.py")]
    return files + [REPO / "run.py", REPO / "masstest.py"]


def _url_literals(tree: ast.AST) -> list[int]:
    """Line numbers of string literals holding a TCP URL, outside docstrings, asserts and
    `get_distributed_init_method` itself."""
    marker = "tcp" + "://"  # split so this file's own literal does not count
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assert) or (
            isinstance(node, ast.FunctionDef) and node.name == "get_distributed_init_method"
        ):
            skip.update(id(n) for n in ast.walk(node))
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            skip.add(id(node.value))  # a docstring or a bare string
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and marker in node.value
        and id(node) not in skip
    ]


def test_rendezvous_urls_come_from_the_helper() -> None:
    offenders = [
        f"{path.relative_to(REPO)}:{lineno}"
        for path in _python_files()
        for lineno in _url_literals(ast.parse(path.read_text(), str(path)))
    ]
    assert not offenders, f"build rendezvous URLs with get_distributed_init_method: {offenders}"


def test_the_url_scan_finds_a_hand_built_url() -> None:
    bad = 'init(f"tcp' + '://{ip}:{port}")\n'
    assert _url_literals(ast.parse(bad)) == [1]


def _seq(logprobs: list[float]) -> Sequence:
    seq = Sequence(0, None, [1, 2, 3], block_size=4)
    for i, lp in enumerate(logprobs):
        seq.append_token_id(10 + i, {10 + i: Logprob(lp)})
    return seq


def test_beam_score_is_one_definition_counting_generated_tokens_only() -> None:
    seq = _seq([-1.0, -2.0, -3.0])
    # HF: cumulative logprob / (generated length ** length_penalty); the prompt does not count.
    assert seq.get_beam_search_score(1.0) == pytest.approx(-6.0 / 3)
    assert seq.get_beam_search_score(2.0) == pytest.approx(-6.0 / 9)
    assert seq.get_beam_search_score(0.0) == pytest.approx(-6.0)
    assert beam_search_score(-6.0, 3, 1.0) == seq.get_beam_search_score(1.0)
    assert beam_search_score(-1.0, 0, 1.0) == -1.0  # no generated token yet: length 1


_ISSUE_NUMBER = re.compile(r"\bissues?\s*#?\d+|(?<![\w/&#])#\d{1,4}\b", re.IGNORECASE)


def _product_files() -> list[pathlib.Path]:
    files = [REPO / name for name in ("README.md", "run.py", "masstest.py", "Makefile", "setup.py")]
    files += sorted((REPO / "docs").glob("*.md"))
    for folder in ("vllm", "benchmarks", "csrc", "examples"):
        files += [
            p
            for p in sorted((REPO / folder).rglob("*"))
            if p.suffix in (".py", ".cpp", ".h", ".md", ".txt")
        ]
    return [p for p in files if p.exists()]


def test_no_issue_numbers_in_the_product() -> None:
    """The product (code, docs, benchmark output) speaks for itself: no "issue 14", no "#13"."""
    found = [
        f"{path.relative_to(REPO)}:{lineno}: {line.strip()}"
        for path in _product_files()
        for lineno, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if _ISSUE_NUMBER.search(line)
    ]
    assert not found, found


def test_the_issue_number_pattern() -> None:
    for text in ("see issue 14", "(#13)", "Issues #7 and", "fixes #2"):
        assert _ISSUE_NUMBER.search(text), text
    for text in ("color #ff0000", "a&#39;b", "x#1y", "tissue 3 layers"):
        assert not _ISSUE_NUMBER.search(text), text
