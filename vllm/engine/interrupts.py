"""Keep Ctrl-C out of the engine's bookkeeping.

A KeyboardInterrupt can land on any bytecode. Inside the scheduler or the output processor it
could leave a request half moved between queues; inside a wait for the pipeline it is harmless
(the engine re-queues what was in flight). `sigint_deferred` holds a SIGINT that arrives during
a short critical section and raises it as KeyboardInterrupt right after, at a safe point.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def sigint_deferred() -> Iterator[None]:
    """Run the block with SIGINT held back; a Ctrl-C during it is raised when it ends.

    Only acts in the main thread while Python's default SIGINT handler is installed (a host
    application's own handler is left alone)."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    received: list[Any] = []
    signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if received:
            raise KeyboardInterrupt
