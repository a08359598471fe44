"""EmbeddingPredictor: Ray Data's `map_batches` class for the embedding task (ray.data.llm's
`task_type="embed"`): a column of texts in, a column of vectors out, one `LLM` (a pooling
runner, PP x TP as configured) per actor.

Each output row holds the input columns, then `prompt`, `embeddings` (the vector, float32),
`num_prompt_tokens` and `error` ("" when the row succeeded). Failures are per row, as for
generation (LLMPredictor): a refused row gets its message, an engine that died fails its
batch and the next batch builds a new `LLM`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from vllm.batch.predictor import EngineInput, LLMPredictor, _plain

EMBED_OUTPUT_COLUMNS = ("prompt", "embeddings", "num_prompt_tokens", "error")


class EmbeddingPredictor(LLMPredictor):
    """Embed Ray Data batches (`batch_format="numpy"` or `"pandas"`).

    Args:
        model: what `LLM(model=...)` takes.
        pooling_params: a PoolingParams or a dict of its fields (`normalize`, `dimensions`,
            `truncate_prompt_tokens`) for every row; a row's own `pooling_params` column (a
            dict) overrides fields for that row.
        prompt_column: the column holding the text to embed.
        engine_kwargs: the other `LLM` arguments; `runner="pooling"` and `convert="embed"`
            are set unless given.
    """

    def __init__(
        self,
        model: str,
        pooling_params: Any = None,
        prompt_column: str = "prompt",
        engine_kwargs: Mapping[str, Any] | None = None,
        **_: Any,
    ) -> None:
        engine_kwargs = dict(engine_kwargs or {})
        engine_kwargs.setdefault("runner", "pooling")
        engine_kwargs.setdefault("convert", "embed")
        from vllm.pooling_params import PoolingParams

        self.default_pooling = _as_pooling_params(pooling_params, PoolingParams())
        super().__init__(model, prompt_column=prompt_column, engine_kwargs=engine_kwargs)

    def preprocess(self, row: dict[str, Any]) -> tuple[EngineInput, Any]:
        """One row -> (engine input, its PoolingParams)."""
        params = _as_pooling_params(_plain(row.get("pooling_params")), self.default_pooling)
        prompt = _plain(row.get(self.prompt_column))
        if not isinstance(prompt, str):
            raise ValueError(
                f"row has no text in column {self.prompt_column!r} (got {type(prompt).__name__})"
            )
        return {"prompt": prompt}, params

    def run_engine(self, inputs: list[EngineInput], params: list[Any], loras: Any) -> list[Any]:
        return self.llm.embed(inputs, pooling_params=params, use_tqdm=False, lora_request=loras)

    def postprocess(
        self,
        columns: dict[str, Any],
        num_rows: int,
        inputs: list[EngineInput | None],
        outputs: dict[int, Any],
        errors: list[str],
    ) -> dict[str, Any]:
        out: dict[str, list[Any]] = {name: [] for name in EMBED_OUTPUT_COLUMNS}
        for i in range(num_rows):
            result = outputs.get(i)
            prompt = (inputs[i] or {}).get("prompt")
            if prompt is None:
                raw = _plain(columns.get(self.prompt_column, [None] * num_rows)[i])
                prompt = raw if isinstance(raw, str) else ""
            error = errors[i] or ("" if result is not None else "no output from the engine")
            vector = (
                np.asarray(result.outputs.embedding, dtype=np.float32)
                if result is not None and not error
                else np.zeros(0, dtype=np.float32)
            )
            out["prompt"].append(prompt)
            out["embeddings"].append(vector)
            out["num_prompt_tokens"].append(len(result.prompt_token_ids) if result else 0)
            out["error"].append(error)
        passthrough = {k: v for k, v in columns.items() if k not in out}
        result_columns: dict[str, Any] = {
            k: np.asarray(v) for k, v in out.items() if k != "embeddings"
        }
        # One vector per row (rows that failed have none): an object column of arrays.
        vectors: np.ndarray = np.empty(num_rows, dtype=object)
        for i, vector in enumerate(out["embeddings"]):
            vectors[i] = vector
        result_columns["embeddings"] = vectors
        return {**passthrough, **result_columns}


def _as_pooling_params(value: Any, base: Any) -> Any:
    """PoolingParams from an object or a dict of fields laid over `base` (None fields, as
    Arrow fills them for keys other rows have, are skipped)."""
    from vllm.pooling_params import PoolingParams

    if value is None:
        return base
    if isinstance(value, PoolingParams):
        return value
    if not isinstance(value, Mapping):
        raise TypeError(f"pooling_params must be a dict, got {type(value).__name__}")
    fields = {k: v for k, v in value.items() if v is not None}
    return dataclasses.replace(base, **fields) if fields else base
