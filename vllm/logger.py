"""The "vllm" logger: INFO to stdout in vLLM's format, set up once on import of the package.

Set VLLM_LOGGING_LEVEL (e.g. WARNING) to quieten it, VLLM_CONFIGURE_LOGGING=0 to leave it alone.
"""

from __future__ import annotations

import logging
import sys

from vllm import envs

_FORMAT = "%(levelname)s %(asctime)s %(filename)s:%(lineno)d] %(message)s"
_DATE_FORMAT = "%m-%d %H:%M:%S"


def configure_logging() -> None:
    """Attach one stdout handler to the "vllm" logger (idempotent)."""
    if not envs.get_bool("VLLM_CONFIGURE_LOGGING"):
        return
    root = logging.getLogger("vllm")
    if any(getattr(h, "_vllm_handler", False) for h in root.handlers):
        return
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter(_FORMAT, datefmt=_DATE_FORMAT))
    handler._vllm_handler = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(envs.get_str("VLLM_LOGGING_LEVEL").upper())
    root.propagate = False


def init_logger(name: str) -> logging.Logger:
    """A child of the "vllm" logger (configured on first use)."""
    configure_logging()
    return logging.getLogger(name)
