"""Checks a request before it reaches the scheduler, so a bad one is refused alone (ValueError
or TypeError naming the parameter) and never disturbs the requests already running."""

from __future__ import annotations

from typing import Any

from vllm.config import ModelConfig
from vllm.sampling_params import SamplingParams


def validate_request(
    request_id: Any,
    prompt: str | None,
    sampling_params: Any,
    prompt_token_ids: list[int] | None,
    tokenizer: Any,
    model_config: ModelConfig,
) -> list[int]:
    """Validate and return the prompt's token ids (tokenizing `prompt` if needed)."""
    if not isinstance(request_id, (str, int)):
        raise TypeError(f"request_id must be a str, got {type(request_id).__name__}.")
    if not isinstance(sampling_params, SamplingParams):
        raise TypeError(
            f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}."
        )
    max_logprobs = model_config.max_logprobs
    if sampling_params.logprobs is not None and sampling_params.logprobs > max_logprobs:
        raise ValueError(
            f"Requested sample logprobs of {sampling_params.logprobs}, which is greater than "
            f"max allowed: {max_logprobs}"
        )
    if (
        sampling_params.prompt_logprobs is not None
        and sampling_params.prompt_logprobs > max_logprobs
    ):
        raise ValueError(
            f"Requested prompt logprobs of {sampling_params.prompt_logprobs}, which is greater "
            f"than max allowed: {max_logprobs}"
        )
    if prompt_token_ids is None:
        if prompt is None:
            raise ValueError("Either prompt or prompt_token_ids must be provided.")
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be a str, got {type(prompt).__name__}.")
        if tokenizer is None:
            raise ValueError(
                "prompts must be None if skip_tokenizer_init is True (pass prompt_token_ids)."
            )
        prompt_token_ids = tokenizer.encode(prompt)
    else:
        if not isinstance(prompt_token_ids, (list, tuple)) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt_token_ids
        ):
            raise TypeError("prompt_token_ids must be a list of ints.")
        prompt_token_ids = list(prompt_token_ids)
    if not prompt_token_ids:
        raise ValueError("Prompt cannot be empty")
    vocab = model_config.get_vocab_size()
    bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
    if bad:
        # vLLM's wording first (scripts match on "out of vocabulary").
        raise ValueError(
            f"Token id {max(bad)} is out of vocabulary (prompt_token_ids contains "
            f"out-of-vocabulary token ids {bad[:5]}; vocab_size is {vocab})."
        )
    check_token_constraints(sampling_params, vocab)
    if sampling_params.detokenize and tokenizer is None and sampling_params.stop:
        raise ValueError("stop strings need a tokenizer (skip_tokenizer_init=True was set).")
    truncate = sampling_params.truncate_prompt_tokens
    if truncate is not None:
        prompt_token_ids = prompt_token_ids[-truncate:]
    return prompt_token_ids


def check_token_constraints(sampling_params: SamplingParams, vocab_size: int) -> None:
    """`logit_bias` and `allowed_token_ids` name only token ids of the model's vocabulary
    (vLLM's messages, the parameter's name first)."""
    bias = sampling_params.logit_bias or {}
    bad = sorted(t for t in bias if not 0 <= t < vocab_size)
    if bad:
        raise ValueError(
            f"logit_bias: token_id(s) {bad[:5]} in logit_bias contain out-of-vocab token ids. "
            f"Vocabulary size: {vocab_size}"
        )
    allowed = sampling_params.allowed_token_ids
    if allowed is not None and not all(0 <= t < vocab_size for t in allowed):
        raise ValueError(
            f"allowed_token_ids contains out-of-vocab token id! Vocabulary size: {vocab_size}"
        )


def check_sendable(sampling_params: SamplingParams) -> None:
    """Refuse parameters the engine could not send to stage processes (TypeError naming the
    field): a logits processor that neither pickle nor cloudpickle can serialise (one holding
    a lock, an open file, a generator...). Checked at `add_request`, so a step holding the
    request can never fail to serialise half-way through the pipeline."""
    from vllm.distributed.serialization import MessageNotSerializableError, dumps_message

    for index, processor in enumerate(sampling_params.logits_processors or ()):
        try:
            dumps_message(processor)
        except MessageNotSerializableError as exc:
            raise TypeError(
                f"logits_processors[{index}] ({processor!r}) {exc}. The pipeline stages run in "
                "processes of their own: a logits processor must be picklable (cloudpickle is "
                "used for closures and lambdas)."
            ) from exc
    try:
        dumps_message(sampling_params)
    except MessageNotSerializableError as exc:
        raise TypeError(f"sampling_params {exc}.") from exc
