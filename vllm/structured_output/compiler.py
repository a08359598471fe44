"""The grammar compile cache (xgrammar): one compiled grammar per spec, per process.

The engine compiles a request's spec at `add_request` (a spec the backend refuses is a
ValueError there, a 400 on the server); the last stage compiles it again in a background thread
as soon as the request reaches it, overlapping the step's forward pass, and waits for it only
when it samples (`matcher.py`). Both hit this cache, so a schema is compiled once per process
however many requests use it. Thread-safe: concurrent requests for one spec share one future.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from vllm.logger import init_logger
from vllm.structured_output.params import GrammarSpec

logger = init_logger(__name__)

# Distinct specs kept compiled; a server fed ever-new schemas must not grow without bound.
_MAX_CACHED = 256
# The field a user set, named in the error of a spec the backend refuses.
_FIELD_OF_KIND = {
    "json": "json schema",
    "json_object": "json_object",
    "regex": "regex",
    "grammar": "grammar",
    "structural_tag": "structural_tag",
}


def stop_token_ids(tokenizer: Any, hf_config: Any) -> list[int]:
    """The ids that end a sequence: the tokenizer's EOS and the model config's EOS id(s). The
    matcher allows them exactly when the grammar may end."""
    ids: set[int] = set()
    for eos in (getattr(tokenizer, "eos_token_id", None), getattr(hf_config, "eos_token_id", None)):
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(e for e in eos if isinstance(e, int))
    return sorted(ids)


class GrammarCompileCache:
    """Compiles `GrammarSpec`s for one tokenizer and vocabulary, each once.

    `tokenizer_factory` is called (once, in the first compile) to get the HF tokenizer; building
    xgrammar's vocabulary view of it takes ~0.5 s, so it is deferred until a request needs it."""

    def __init__(
        self,
        tokenizer_factory: Callable[[], Any],
        vocab_size: int,
        stop_ids: Callable[[Any], list[int]],
    ) -> None:
        self._tokenizer_factory = tokenizer_factory
        self.vocab_size = vocab_size
        self._stop_ids = stop_ids
        self._lock = threading.Lock()
        self._compiler: Any = None
        self._tokenizer_info: Any = None
        self._cache: OrderedDict[GrammarSpec, Future[Any]] = OrderedDict()
        self._pool: ThreadPoolExecutor | None = None

    @property
    def tokenizer_info(self) -> Any:
        """xgrammar's view of the vocabulary (built on first use)."""
        self._ensure_compiler()
        return self._tokenizer_info

    def _ensure_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                tokenizer = self._tokenizer_factory()
                info = xgr.TokenizerInfo.from_huggingface(
                    tokenizer,
                    vocab_size=self.vocab_size,
                    stop_token_ids=self._stop_ids(tokenizer) or None,
                )
                self._tokenizer_info = info
                # One thread: the engine and the stages share the machine's cores.
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def _compile_now(self, spec: GrammarSpec) -> Any:
        compiler = self._ensure_compiler()
        try:
            if spec.kind == "json":
                return compiler.compile_json_schema(spec.text, any_whitespace=spec.any_whitespace)
            if spec.kind == "json_object":
                return compiler.compile_builtin_json_grammar()
            if spec.kind == "regex":
                return compiler.compile_regex(spec.text)
            if spec.kind == "grammar":
                return compiler.compile_grammar(spec.text)
            if spec.kind == "structural_tag":
                return compiler.compile_structural_tag(spec.text)
        except RuntimeError as exc:
            # xgrammar reports "[time] file.cc:line: message": keep the message.
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
            message = message.split(": ", 1)[-1] if "] " in message else message
            raise ValueError(
                f"Invalid {_FIELD_OF_KIND[spec.kind]} for structured outputs: {message}"
            ) from None
        raise ValueError(f"unknown structured output kind {spec.kind!r}")

    def _future(self, spec: GrammarSpec) -> tuple[Future[Any], bool]:
        """The spec's future, and whether the caller must compute it."""
        with self._lock:
            future = self._cache.get(spec)
            if future is not None:
                self._cache.move_to_end(spec)
                return future, False
            future = Future()
            self._cache[spec] = future
            while len(self._cache) > _MAX_CACHED:
                self._cache.popitem(last=False)
            return future, True

    def _fill(self, spec: GrammarSpec, future: Future[Any]) -> None:
        try:
            future.set_result(self._compile_now(spec))
        except BaseException as exc:
            future.set_exception(exc)

    def compile(self, spec: GrammarSpec) -> Any:
        """The compiled grammar, compiling it in this thread on a miss; ValueError when the
        backend refuses the spec."""
        future, mine = self._future(spec)
        if mine:
            self._fill(spec, future)
        return future.result()

    def compile_async(self, spec: GrammarSpec) -> Future[Any]:
        """A future of the compiled grammar, compiled in a background thread on a miss."""
        future, mine = self._future(spec)
        if mine:
            with self._lock:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
                pool = self._pool
            pool.submit(self._fill, spec, future)
        return future


def load_tokenizer(model_config: Any) -> Any:
    """The model's HF tokenizer, loaded as the engine loads it (a stage process has none)."""
    if model_config.is_gguf and model_config.tokenizer == model_config.model:
        from vllm.transformers_utils.gguf_config import load_gguf_tokenizer

        return load_gguf_tokenizer(model_config.model)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        model_config.tokenizer, trust_remote_code=model_config.trust_remote_code
    )


def compile_cache_for(model_config: Any, tokenizer: Any = None) -> GrammarCompileCache:
    """A compile cache for this model's vocabulary; the tokenizer is loaded on first use unless
    given (the engine passes its own)."""
    hf_config = model_config.hf_config
    return GrammarCompileCache(
        (lambda: tokenizer) if tokenizer is not None else (lambda: load_tokenizer(model_config)),
        model_config.get_vocab_size(),
        lambda tok: stop_token_ids(tok, hf_config),
    )
