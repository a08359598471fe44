"""The server's CPU work on client input, bounded and off the event loop.

Tokenizing a prompt and rendering a chat template take time proportional to what the client
sent (or, for a template, to anything it asks for: nested loops). Run on the event loop they
froze every stream and `/health`; run on the engine thread they stalled every running
request. Here they run in a small thread pool of their own, with limits checked first:

- a prompt longer than `max_prompt_chars` is refused without tokenizing it: no tokenizer
  covers more than `max_token_chars` characters with one token, so such a prompt cannot fit in
  the context (see `prompt_char_cap`);
- a chat template renders under a deadline (a trace function in the rendering thread raises
  once it passes) and its output under the same character cap;
- text must be valid Unicode (a lone surrogate from JSON's "\\ud800" is a 400, not a 500).
"""

from __future__ import annotations

import asyncio
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from vllm.entrypoints.openai.protocol import ParameterError

T = TypeVar("T")

# The default character budget per context token (see prompt_char_cap); a safety factor over
# the longest vocabulary entry covers normalisers that merge characters.
_CHARS_SAFETY_FACTOR = 4


@dataclass
class ServerLimits:
    """What one request may ask of the API process (flags of `vllm serve`)."""

    # --max-request-body-bytes: a larger body is refused with 413 before it is read whole.
    max_request_body_bytes: int = 32 << 20
    # --max-prompts-per-request: prompts in one /v1/completions request.
    max_prompts_per_request: int = 256
    # --trust-request-chat-template: allow a `chat_template` in the request (vLLM's flag).
    trust_request_chat_template: bool = False
    # --chat-template-timeout: seconds one chat template may take to render.
    chat_template_timeout_s: float = 5.0
    # --shutdown-timeout: seconds in-flight requests get after SIGTERM/SIGINT.
    shutdown_timeout_s: float = 20.0
    # --allow-unauthenticated-metrics: /metrics without the API key.
    allow_unauthenticated_metrics: bool = False


def max_token_chars(tokenizer: Any) -> int:
    """The longest vocabulary entry in characters (byte-level BPE shows a byte as one char)."""
    try:
        vocab = tokenizer.get_vocab()
    except Exception:  # a tokenizer without a vocabulary listing: assume long tokens
        return 256
    return max(16, max((len(token) for token in vocab), default=16))


def prompt_char_cap(tokenizer: Any, max_model_len: int) -> int:
    """More characters than this cannot tokenize to `max_model_len` tokens or fewer."""
    return max_model_len * max_token_chars(tokenizer) * _CHARS_SAFETY_FACTOR


def check_unicode(text: str, param: str) -> None:
    """Refuse a string that cannot be UTF-8 encoded (a lone surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ParameterError(
            f"{param} is not valid Unicode: {exc.reason} at position {exc.start}.", param
        ) from exc


class _Deadline:
    """A trace function that raises TimeoutError in its thread once `deadline` has passed.
    Every Python call made by the traced code checks it: a compiled Jinja template's loops
    call into the runtime, so even a template that outputs nothing is stopped."""

    def __init__(self, seconds: float, what: str) -> None:
        self.deadline = time.monotonic() + seconds
        self.seconds = seconds
        self.what = what

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call" and time.monotonic() > self.deadline:
            raise TimeoutError(f"{self.what} took longer than {self.seconds:g} s")
        return None  # no per-line tracing: only calls are checked


def run_with_deadline(fn: Callable[[], T], seconds: float, what: str) -> T:
    """Run `fn` in this thread, raising TimeoutError if it is still running after `seconds`."""
    old = sys.gettrace()
    sys.settrace(_Deadline(seconds, what))
    try:
        return fn()
    finally:
        sys.settrace(old)


class BoundedWork:
    """Tokenization and template rendering for the request handlers, in a thread pool."""

    def __init__(self, tokenizer: Any, max_model_len: int, limits: ServerLimits) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        self.max_prompt_chars = prompt_char_cap(tokenizer, max_model_len) if tokenizer else 0
        self.max_model_len = max_model_len
        # Two threads: one large request cannot hold up every other one's tokenization, and
        # the GIL makes more useless on the 2-core machines this serves from.
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="vllm-tokenize")

    async def run(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    def check_prompt_chars(self, text: str, param: str) -> None:
        if len(text) > self.max_prompt_chars:
            raise ParameterError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"the {param} is {len(text)} characters long, more than the {self.max_prompt_chars}"
                f" characters that many tokens can hold. Please reduce the length of the {param}.",
                param,
            )

    def encode_sync(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        if self.tokenizer is None:
            raise ParameterError("this server has no tokenizer (skip_tokenizer_init).", param)
        self.check_prompt_chars(text, param)
        check_unicode(text, param)
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    async def encode(
        self, text: str, add_special_tokens: bool = True, param: str = "prompt"
    ) -> Any:
        """Token ids of `text` (ParameterError when it is too long or not valid Unicode)."""
        self.check_prompt_chars(text, param)  # before queueing a hopeless job
        return await self.run(lambda: self.encode_sync(text, add_special_tokens, param))

    def render_sync(self, render: Callable[[], str]) -> str:
        """Render a chat template under the time budget and the prompt character cap."""
        try:
            text = run_with_deadline(
                render, self.limits.chat_template_timeout_s, "rendering the chat template"
            )
        except TimeoutError as exc:
            raise ParameterError(f"cannot apply the chat template: {exc}.", "messages") from exc
        self.check_prompt_chars(text, "messages")
        return text

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
