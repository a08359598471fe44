"""The pooling half of `LLM` (vLLM's offline API for pooling models): `encode`, `embed`,
`classify`, `reward` and `score` (1:1, 1:N and N:N), outputs in input order.

Each prompt runs through every pipeline stage once; the last stage pools (see
`vllm.model_executor.layers.pooler`). `score` pairs its inputs as vLLM does: an embedding
model embeds both sides and returns their cosine similarity, a cross-encoder (a classifier with
one label) reads each pair as one input (the tokenizer's text pair, with token_type_ids for an
encoder) and returns its sigmoid score.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC
from typing import Any

from vllm.inputs import is_token_list
from vllm.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from vllm.pooling_params import PoolingParams

_UNSUPPORTED = {
    "embed": "Embedding API is not supported by this model. Try converting the model using "
    "`--convert embed`.",
    "classify": "Classification API is not supported by this model. Try converting the model "
    "using `--convert classify`.",
    "score": "Score API is not supported by this model. Try converting the model using "
    "`--convert embed` or `--convert classify`.",
    "encode": "LLM.encode() is only supported for pooling models. Try passing `--runner "
    "pooling` to use the model as a pooling model.",
}


class PoolingMixin:
    """`LLM`'s pooling methods; the class provides `llm_engine`, `request_counter` and
    `_run_engine`."""

    llm_engine: Any
    request_counter: Any

    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list[Any]:
        raise NotImplementedError

    def encode(
        self,
        prompts: Any,
        pooling_params: PoolingParams | SequenceABC[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        lora_request: Any = None,
        pooling_task: str | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> list[PoolingRequestOutput[Any]]:
        """Pool every prompt (`pooling_task`: "encode" by default: every token's output for
        ALL pooling, else the pooled vector), in input order."""
        if tokenization_kwargs:
            raise ValueError("tokenization_kwargs are not supported by this engine.")
        return self._pool(
            prompts,
            pooling_params,
            pooling_task or "encode",
            truncate_prompt_tokens,
            use_tqdm,
            lora_request,
        )

    def embed(
        self,
        prompts: Any,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | SequenceABC[PoolingParams] | None = None,
        lora_request: Any = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding vector per prompt, in input order."""
        outputs = self._pool(
            prompts, pooling_params, "embed", truncate_prompt_tokens, use_tqdm, lora_request
        )
        return [EmbeddingRequestOutput.from_base(o) for o in outputs]

    def classify(
        self,
        prompts: Any,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | SequenceABC[PoolingParams] | None = None,
        lora_request: Any = None,
    ) -> list[ClassificationRequestOutput]:
        """The class probabilities of each prompt, in input order."""
        outputs = self._pool(
            prompts, pooling_params, "classify", truncate_prompt_tokens, use_tqdm, lora_request
        )
        return [ClassificationRequestOutput.from_base(o) for o in outputs]

    def reward(
        self,
        prompts: Any,
        /,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | SequenceABC[PoolingParams] | None = None,
        lora_request: Any = None,
    ) -> list[PoolingRequestOutput[Any]]:
        """A reward model's outputs for each prompt (every token's, or at its step tags)."""
        return self._pool(
            prompts, pooling_params, "encode", truncate_prompt_tokens, use_tqdm, lora_request
        )

    def score(
        self,
        data_1: Any,
        data_2: Any,
        /,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | None = None,
        lora_request: Any = None,
    ) -> list[ScoringRequestOutput]:
        """Similarity scores of pairs: one text against one (1:1), one against many (1:N) or
        pairwise (N:N), in the order of `data_2`."""
        config = self.llm_engine.model_config
        if "score" not in config.supported_tasks:
            raise ValueError(_UNSUPPORTED["score"])
        if isinstance(pooling_params, (list, tuple)):
            raise ValueError("score takes one PoolingParams for every pair.")
        left, right = _score_inputs(data_1), _score_inputs(data_2)
        if len(left) == 1:
            left = left * len(right)
        if len(left) != len(right):
            raise ValueError(
                "The lengths of data_1 and data_2 must be either 1:1, 1:N or N:N (got "
                f"{len(left)} and {len(right)})."
            )
        if not right:
            raise ValueError("score needs at least one pair (data_2 is empty).")
        if config.convert_type == "embed":
            return self._cosine_scores(
                left, right, truncate_prompt_tokens, use_tqdm, pooling_params, lora_request
            )
        tokenizer = self.llm_engine.get_tokenizer()
        if tokenizer is None:
            raise ValueError("score needs a tokenizer (skip_tokenizer_init=True was set).")
        prompts = [
            score_pair_prompt(tokenizer, a, b, config.is_encoder_only) for a, b in zip(left, right)
        ]
        outputs = self._pool(
            prompts, pooling_params, "score", truncate_prompt_tokens, use_tqdm, lora_request
        )
        return [ScoringRequestOutput.from_base(o) for o in outputs]

    def _cosine_scores(
        self,
        left: list[str],
        right: list[str],
        truncate_prompt_tokens: int | None,
        use_tqdm: bool,
        pooling_params: PoolingParams | None,
        lora_request: Any,
    ) -> list[ScoringRequestOutput]:
        """A bi-encoder's scores: each distinct text embedded once, then cosine similarity."""
        texts = list(dict.fromkeys([*left, *right]))
        embedded = self._pool(
            texts, pooling_params, "embed", truncate_prompt_tokens, use_tqdm, lora_request
        )
        by_text = dict(zip(texts, embedded))
        results = []
        for a, b in zip(left, right):
            first, second = by_text[a], by_text[b]
            results.append(
                ScoringRequestOutput(
                    request_id=f"{first.request_id}_{second.request_id}",
                    outputs=ScoringOutput(_cosine(first.outputs.data, second.outputs.data)),
                    prompt_token_ids=first.prompt_token_ids + second.prompt_token_ids,
                    finished=True,
                )
            )
        return results

    def _pool(
        self,
        prompts: Any,
        pooling_params: Any,
        task: str,
        truncate_prompt_tokens: int | None,
        use_tqdm: bool,
        lora_request: Any,
    ) -> list[PoolingRequestOutput[Any]]:
        """Queue every prompt with its parameters (task set), run them, outputs in order."""
        config = self.llm_engine.model_config
        if task not in config.supported_tasks:
            if not config.is_pooling_model:
                raise ValueError(_UNSUPPORTED["encode"])
            raise ValueError(_UNSUPPORTED.get(task, f"pooling_task {task!r} is not supported."))
        if isinstance(prompts, (str, dict)) or is_token_list(prompts):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise TypeError(
                f"prompts must be a prompt or a list of prompts, got {type(prompts).__name__}."
            )
        params_list = _params_for(pooling_params, len(prompts), task, truncate_prompt_tokens)
        loras = (
            list(lora_request)
            if isinstance(lora_request, (list, tuple))
            else [lora_request] * len(prompts)
        )
        if len(loras) != len(prompts):
            raise ValueError("The lengths of prompts and lora_request must be the same.")
        request_ids: list[str] = []
        try:
            for prompt, params, lora in zip(prompts, params_list, loras):
                request_id = str(next(self.request_counter))
                self.llm_engine.add_request(request_id, prompt, params, lora_request=lora)
                request_ids.append(request_id)
        except Exception:
            self.llm_engine.abort_request(request_ids)
            raise
        outputs = self._run_engine(request_ids, use_tqdm)
        if len(outputs) != len(request_ids):
            raise RuntimeError(
                f"{len(request_ids) - len(outputs)} pooling requests did not finish (aborted)"
            )
        return outputs


def _params_for(
    pooling_params: Any, count: int, task: str, truncate_prompt_tokens: int | None
) -> list[PoolingParams]:
    """One PoolingParams per prompt (the caller's are copied, never changed), with `task` and
    `truncate_prompt_tokens` set."""
    if pooling_params is None:
        given = [PoolingParams()] * count
    elif isinstance(pooling_params, PoolingParams):
        given = [pooling_params] * count
    elif isinstance(pooling_params, (list, tuple)):
        if len(pooling_params) != count:
            raise ValueError("The lengths of prompts and pooling_params must be the same.")
        given = list(pooling_params)
    else:
        raise TypeError(
            "pooling_params must be a PoolingParams or a list of them, got "
            f"{type(pooling_params).__name__}."
        )
    result = []
    for params in given:
        if not isinstance(params, PoolingParams):
            raise TypeError(f"pooling_params must be PoolingParams, got {type(params).__name__}.")
        copy = params.clone()
        if copy.task is None:
            copy.task = task
        elif copy.task != task:
            raise ValueError(f"You cannot overwrite self.task={copy.task!r} with task={task!r}!")
        if truncate_prompt_tokens is not None:
            copy.truncate_prompt_tokens = truncate_prompt_tokens
            copy.__post_init__()  # checks the value
        result.append(copy)
    return result


def _score_inputs(data: Any) -> list[str]:
    """One side of `score`: a text or a list of texts (TextPrompt dicts read as their text)."""
    items = [data] if isinstance(data, (str, dict)) else data
    if not isinstance(items, (list, tuple)):
        raise TypeError(f"score inputs must be str or a list of str, got {type(data).__name__}.")
    texts = []
    for item in items:
        if isinstance(item, dict) and isinstance(item.get("prompt"), str):
            item = item["prompt"]
        if not isinstance(item, str):
            raise TypeError(f"score inputs must be str or a list of str, got {item!r}.")
        texts.append(item)
    return texts


def score_pair_prompt(tokenizer: Any, text_1: str, text_2: str, encoder_only: bool) -> Any:
    """A cross-encoder's input for one pair: the tokenizer's text pair (as HF builds it:
    [CLS] a [SEP] b [SEP] for BERT), with its token_type_ids for an encoder."""
    encoded = tokenizer(text=text_1, text_pair=text_2)
    prompt: dict[str, Any] = {"prompt_token_ids": list(encoded["input_ids"])}
    type_ids = encoded.get("token_type_ids")
    if encoder_only and type_ids is not None:
        prompt["token_type_ids"] = list(type_ids)
    return prompt


def _cosine(a: Any, b: Any) -> float:
    """Cosine similarity of two vectors (torch's: the norms' product clamped at 1e-8)."""
    a, b = a.float(), b.float()
    return float((a * b).sum()) / max(float(a.norm() * b.norm()), 1e-8)
