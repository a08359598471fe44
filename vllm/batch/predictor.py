"""LLMPredictor: the callable class Ray Data's `map_batches` runs, one `LLM` per actor.

Each batch goes through three steps:
  preprocess   a row -> the engine's input: the raw prompt, or the tokenizer's chat template
               applied to a `messages` column (or to the prompt as one user message);
  generate     one `LLM.generate` call for every valid row of the batch;
  postprocess  one output row per input row: the input columns, then `prompt`,
               `generated_text`, `num_prompt_tokens`, `num_generated_tokens`, `finish_reason`
               and `error` ("" when the row succeeded).

A row's `lora_request` column (a LoRARequest, or a dict of its fields: lora_name, lora_int_id,
lora_path) runs that row with the adapter (the engine needs `enable_lora=True` in
engine_kwargs); rows of one batch may name different adapters.

A failure is reported per row and the job goes on: a row that cannot be preprocessed or that
the engine refuses (bad sampling parameters, a prompt longer than the context) gets its
message in `error`; a failure of the whole engine is written into every row of that batch and
the next batch builds a new `LLM`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from vllm.lora.request import LoRARequest
from vllm.sampling_params import SamplingParams

OUTPUT_COLUMNS = (
    "prompt",
    "generated_text",
    "num_prompt_tokens",
    "num_generated_tokens",
    "finish_reason",
    "error",
)

EngineInput = dict[str, Any]


class LLMPredictor:
    """Generate text for Ray Data batches (`batch_format="numpy"` or `"pandas"`).

    Args:
        model: what `LLM(model=...)` takes (a HF directory, a .gguf, `smollm2`).
        sampling_params: a SamplingParams or a dict of its fields, used for every row; a row's
            own `sampling_params` column (a dict) overrides fields for that row.
        prompt_column: the column holding the raw prompt text.
        messages_column: a column of chat conversations ([{"role", "content"}, ...]); used
            (through the chat template) when the row has one.
        apply_chat_template: wrap a raw prompt as one user message and apply the template.
        engine_kwargs: the other `LLM` arguments (pipeline_parallel_size, kv_cache_space...).
    """

    def __init__(
        self,
        model: str,
        sampling_params: SamplingParams | Mapping[str, Any] | None = None,
        prompt_column: str = "prompt",
        messages_column: str = "messages",
        apply_chat_template: bool = False,
        engine_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        self.model = model
        self.engine_kwargs = dict(engine_kwargs or {})
        self.default_params = _as_params(sampling_params, SamplingParams())
        if self.default_params.n != 1:
            raise ValueError("LLMPredictor writes one completion per row: n must be 1.")
        self.prompt_column = prompt_column
        self.messages_column = messages_column
        self.apply_chat_template = apply_chat_template
        self.llm: Any = None
        self._build_llm()

    # -- engine -------------------------------------------------------------------------------

    def _build_llm(self) -> None:
        from vllm import LLM

        self.llm = LLM(model=self.model, **self.engine_kwargs)
        self.max_model_len = self.llm.llm_engine.model_config.max_model_len

    def _drop_llm(self) -> None:
        llm, self.llm = self.llm, None
        if llm is not None:
            try:
                llm.shutdown()
            except Exception:  # a dead engine may fail to shut down cleanly
                pass

    def shutdown(self) -> None:
        self._drop_llm()

    # -- Ray Data entry point -------------------------------------------------------------------

    def __call__(self, batch: Any) -> dict[str, Any]:
        columns = _columns(batch)
        num_rows = len(next(iter(columns.values()))) if columns else 0
        errors: list[str] = [""] * num_rows
        inputs: list[EngineInput | None] = [None] * num_rows
        params: list[SamplingParams | None] = [None] * num_rows
        loras: list[LoRARequest | None] = [None] * num_rows
        for i in range(num_rows):
            try:
                row = {k: v[i] for k, v in columns.items()}
                inputs[i], params[i] = self.preprocess(row)
                loras[i] = _as_lora(row.get("lora_request"))
            except Exception as error:  # a bad row must not fail the batch
                errors[i] = _describe(error)
        outputs: dict[int, Any] = {}
        valid = [i for i in range(num_rows) if not errors[i]]
        if valid:
            if self.llm is None:
                try:
                    self._build_llm()
                except Exception as error:
                    for i in valid:
                        errors[i] = f"engine could not be built: {_describe(error)}"
                    valid = []
            self._generate(valid, inputs, params, outputs, errors, loras)
        return self.postprocess(columns, num_rows, inputs, outputs, errors)

    # -- steps ----------------------------------------------------------------------------------

    def preprocess(self, row: dict[str, Any]) -> tuple[EngineInput, SamplingParams]:
        """One row -> (engine input dict, its SamplingParams)."""
        params = _as_params(_plain(row.get("sampling_params")), self.default_params)
        messages = _plain(row.get(self.messages_column))
        if messages is not None and len(messages) > 0:
            return self._templated(list(messages)), params
        prompt = _plain(row.get(self.prompt_column))
        if not isinstance(prompt, str):
            raise ValueError(
                f"row has no text in column {self.prompt_column!r} "
                f"(got {type(prompt).__name__}) and no {self.messages_column!r} conversation"
            )
        if self.apply_chat_template:
            return self._templated([{"role": "user", "content": prompt}]), params
        return {"prompt": prompt}, params

    def _templated(self, messages: list[Any]) -> EngineInput:
        tokenizer = self.llm.get_tokenizer() if self.llm is not None else None
        if tokenizer is None:
            raise ValueError("a chat template needs the model's tokenizer")
        conversation = [{"role": str(m["role"]), "content": str(m["content"])} for m in messages]
        text = tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=True
        )
        # As LLM.chat: the template already holds the BOS token where the model wants one.
        ids = tokenizer.encode(text, add_special_tokens=False)
        return {"prompt": text, "prompt_token_ids": ids}

    def _generate(
        self,
        rows: list[int],
        inputs: list[EngineInput | None],
        params: list[SamplingParams | None],
        outputs: dict[int, Any],
        errors: list[str],
        loras: list[LoRARequest | None],
    ) -> None:
        """Generate `rows` in one call (each with its row's adapter, if any); if the engine
        refuses the call, split it in halves so the rows it refuses are found and the others
        still run (batched)."""
        if not rows:
            return
        from vllm.resilience.errors import EngineDeadError

        try:
            results = self.run_engine(
                [inputs[i] for i in rows],
                [params[i] for i in rows],
                [loras[i] for i in rows] if any(loras[i] for i in rows) else None,
            )
        except EngineDeadError as error:
            # The whole engine is gone: every row of the batch fails; the next batch builds
            # a new LLM (the stages were released when the engine died).
            self._drop_llm()
            for i in rows:
                errors[i] = f"engine failed: {_describe(error)}"
            return
        except Exception as error:
            if len(rows) == 1 or self.llm is None or self.llm.llm_engine.is_dead:
                for i in rows:
                    errors[i] = _describe(error)
                if self.llm is not None and self.llm.llm_engine.is_dead:
                    self._drop_llm()
                return
            half = len(rows) // 2
            self._generate(rows[:half], inputs, params, outputs, errors, loras)
            if self.llm is not None:
                self._generate(rows[half:], inputs, params, outputs, errors, loras)
            else:
                for i in rows[half:]:
                    errors[i] = f"engine failed: {_describe(error)}"
            return
        for i, result in zip(rows, results):
            outputs[i] = result

    def run_engine(self, inputs: list[EngineInput], params: list[Any], loras: Any) -> list[Any]:
        """One engine call for some rows (their outputs in order)."""
        return self.llm.generate(inputs, params, use_tqdm=False, lora_request=loras)

    def postprocess(
        self,
        columns: dict[str, Any],
        num_rows: int,
        inputs: list[EngineInput | None],
        outputs: dict[int, Any],
        errors: list[str],
    ) -> dict[str, Any]:
        out: dict[str, list[Any]] = {name: [] for name in OUTPUT_COLUMNS}
        for i in range(num_rows):
            result = outputs.get(i)
            completion = result.outputs[0] if result is not None and result.outputs else None
            prompt = (inputs[i] or {}).get("prompt")
            if prompt is None:
                raw = _plain(columns.get(self.prompt_column, [None] * num_rows)[i])
                prompt = raw if isinstance(raw, str) else ""
            num_prompt = len(result.prompt_token_ids) if result is not None else 0
            num_generated = len(completion.token_ids) if completion is not None else 0
            finish = (completion.finish_reason or "") if completion is not None else ""
            error = errors[i]
            if not error and result is None:
                error = "no output from the engine"
            if (
                not error
                and finish == "length"
                and num_generated == 0
                and (num_prompt >= self.max_model_len)
            ):
                error = (
                    f"prompt of {num_prompt} tokens is too long: the context is "
                    f"{self.max_model_len} tokens (max_model_len)"
                )
            out["prompt"].append(prompt)
            out["generated_text"].append(completion.text if completion is not None else "")
            out["num_prompt_tokens"].append(num_prompt)
            out["num_generated_tokens"].append(num_generated)
            out["finish_reason"].append(finish)
            out["error"].append(error)
        passthrough = {k: v for k, v in columns.items() if k not in out}
        return {**passthrough, **{k: np.asarray(v) for k, v in out.items()}}


# -- helpers ------------------------------------------------------------------------------------


def _columns(batch: Any) -> dict[str, Any]:
    """A numpy dict or a pandas DataFrame -> {column: array-like}."""
    if hasattr(batch, "to_dict") and hasattr(batch, "columns"):  # pandas
        return {str(c): batch[c].to_numpy() for c in batch.columns}
    if isinstance(batch, Mapping):
        return dict(batch)
    raise TypeError(f"batch must be a dict of arrays or a DataFrame, got {type(batch).__name__}")


def _plain(value: Any) -> Any:
    """Arrow/numpy containers from Ray Data -> plain Python (lists, dicts, str, None)."""
    if value is None:
        return None
    if isinstance(value, np.ndarray):
        return [_plain(v) for v in value.tolist()] if value.dtype == object else value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, float) and value != value:  # NaN: pandas' missing value
        return None
    return value


def _as_params(
    value: SamplingParams | Mapping[str, Any] | None, base: SamplingParams
) -> SamplingParams:
    """SamplingParams from an object or a dict of fields laid over `base` (None fields, as
    Arrow fills them for keys other rows have, are skipped)."""
    if value is None:
        return base
    if isinstance(value, SamplingParams):
        return value
    if not isinstance(value, Mapping):
        raise TypeError(f"sampling_params must be a dict, got {type(value).__name__}")
    fields = {k: v for k, v in value.items() if v is not None}
    if not fields:
        return base
    return dataclasses.replace(base, **fields)


def _as_lora(value: Any) -> LoRARequest | None:
    """A row's `lora_request`: a LoRARequest, a dict of its fields, or nothing."""
    value = value if isinstance(value, LoRARequest) else _plain(value)
    if value is None or isinstance(value, LoRARequest):
        return value
    if not isinstance(value, Mapping):
        raise TypeError(f"lora_request must be a LoRARequest or a dict, got {type(value).__name__}")
    fields = {k: v for k, v in value.items() if v is not None}
    return LoRARequest(**fields) if fields else None


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"
