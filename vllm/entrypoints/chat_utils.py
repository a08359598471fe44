"""Chat helpers with vLLM 0.5's import path: `load_chat_template` (a file path or the
template text itself)."""

from __future__ import annotations

import codecs
from pathlib import Path

from vllm.logger import init_logger

logger = init_logger(__name__)

# A value holding none of these is taken for a file path, never for a template.
_JINJA_CHARS = "{}\n"


def load_chat_template(chat_template: str | Path | None) -> str | None:
    """The chat template text: the file's content when `chat_template` opens as a file, else
    the value itself with its backslash escapes read (vLLM's rule, so `--chat-template
    "{{...}}\\n"` works from a shell). A value that looks like a path but does not open is a
    ValueError naming it."""
    if chat_template is None:
        return None
    try:
        with open(chat_template, encoding="utf-8") as f:
            resolved = f.read()
    except OSError as exc:
        if isinstance(chat_template, Path):
            raise
        if not any(c in chat_template for c in _JINJA_CHARS):
            raise ValueError(
                f"The supplied chat template ({chat_template}) looks like a file path, but it "
                f"failed to be opened. Reason: {exc}"
            ) from exc
        resolved = chat_template
        if resolved.isascii():  # unicode_escape would garble non-ASCII text
            resolved = codecs.decode(resolved, "unicode_escape")
    logger.info("Using supplied chat template:\n%s", resolved)
    return resolved
