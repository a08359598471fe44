"""Drafts from a smaller (or quantized) model sharing the target's tokenizer: an engine of its
own, one rank in a process of its own (`mp`), driven by the target engine's scheduler.

Each step's proposals are one batch of requests to the draft engine: the sequence's tokens as
the prompt, greedy, `k` new tokens. The draft engine keeps prefix caching on, so a sequence's
earlier blocks are found in its cache and only the tokens since its last full block (those
the target accepted last step included) are prefilled again; rejected drafts leave nothing
behind to roll back (their blocks are freed with the request, and never cached). Its KV cache
is its own, sized by `kv_cache_space` like a stage's. A greedy draft is a deterministic
proposal, so the target's acceptance rule stays exact (`vllm.spec_decode.verify`).
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any, Protocol

from vllm.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from vllm.config import EngineConfig


class DraftEngine(Protocol):
    """What the proposer needs of the draft model's engine (an `LLMEngine`, built by the
    target engine from `draft_engine_kwargs`)."""

    def add_request(self, request_id: str, prompt: Any, sampling_params: Any) -> None: ...

    def step(self) -> list[Any]: ...

    def has_unfinished_requests(self) -> bool: ...

    def shutdown(self) -> None: ...


def draft_engine_kwargs(engine_config: EngineConfig) -> dict[str, Any]:
    """`EngineArgs` of the draft model's engine: one rank of its own (`mp`), token ids only,
    prefix caching on, the target's context, block size, seed and per-stage KV budget."""
    spec = engine_config.speculative_config
    assert spec is not None and spec.model is not None
    target = engine_config.model_config
    return dict(
        model=spec.model,
        quantization=spec.quantization,
        skip_tokenizer_init=True,
        seed=target.seed,
        max_model_len=target.max_model_len,
        block_size=engine_config.cache_config.block_size,
        kv_cache_space=engine_config.cache_config.kv_cache_space,
        enable_prefix_caching=True,
        distributed_executor_backend="mp",
        disable_log_stats=True,
    )


class DraftModelProposer:
    """Proposes drafts with a draft model's engine (see the module docstring)."""

    cheap = False

    def __init__(self, engine: DraftEngine) -> None:
        self.engine = engine
        self._ids = itertools.count()

    def propose(self, requests: list[tuple[list[int], int]]) -> list[list[int]]:
        """Run every (token ids, k) through the draft engine as one batch."""
        engine = self.engine
        ids: list[str] = []
        for token_ids, k in requests:
            request_id = f"draft-{next(self._ids)}"
            params = SamplingParams(
                temperature=0.0,
                max_tokens=k,
                ignore_eos=True,
                detokenize=False,
                output_kind=RequestOutputKind.FINAL_ONLY,
            )
            engine.add_request(request_id, {"prompt_token_ids": token_ids}, params)
            ids.append(request_id)
        found: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    found[output.request_id] = list(output.outputs[0].token_ids)
        return [found.get(request_id, []) for request_id in ids]

    def shutdown(self) -> None:
        """Stop the draft engine's rank."""
        self.engine.shutdown()
