"""`RequestLogger` at vLLM 0.5's import path: what code that builds the OpenAI handlers itself
(`OpenAIServingChat(..., request_logger=RequestLogger(max_log_len=...))`) passes in."""

from __future__ import annotations

from typing import Any

from vllm.logger import init_logger

logger = init_logger("vllm.entrypoints.logger")


class RequestLogger:
    """Logs a request's inputs in vLLM's line, the prompt and its token ids cut to
    `max_log_len` (characters and ids; None: whole)."""

    def __init__(self, *, max_log_len: int | None = None) -> None:
        self.max_log_len = max_log_len

    def log_inputs(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int] | None,
        params: Any,
        lora_request: Any = None,
        prompt_adapter_request: Any = None,
    ) -> None:
        limit = self.max_log_len
        if limit is not None:
            if prompt is not None:
                prompt = prompt[:limit]
            if prompt_token_ids is not None:
                prompt_token_ids = prompt_token_ids[:limit]
        logger.info(
            "Received request %s: prompt: %r, params: %s, prompt_token_ids: %s, "
            "lora_request: %s, prompt_adapter_request: %s.",
            request_id,
            prompt,
            params,
            prompt_token_ids,
            lora_request,
            prompt_adapter_request,
        )
