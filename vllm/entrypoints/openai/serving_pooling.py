"""POST /pooling: the pooler's output as it is (vLLM's route for any pooling model): a vector
per input, or one per token for the `encode` task, as floats or base64 float32."""

from __future__ import annotations

import time
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from vllm.entrypoints.openai.protocol import ParameterError, random_uuid
from vllm.entrypoints.openai.protocol_pooling import (
    PoolingRequest,
    PoolingResponse,
    PoolingResponseData,
)
from vllm.entrypoints.openai.serving_embedding import encode_vector
from vllm.entrypoints.openai.serving_pooling_base import (
    PoolingServing,
    pooling_bad_request,
    supported_pooling_tasks,
    usage_of,
)


class OpenAIServingPooling(PoolingServing):
    """Handles /pooling."""

    task = "encode"
    api = "Pooling"

    def __init__(self, *args: Any, chat_template: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.chat_template = chat_template

    def default_task(self) -> str:
        tasks = supported_pooling_tasks(self.model_config)
        return "encode" if "encode" in tasks or not tasks else tasks[0]

    async def create_pooling(self, request: PoolingRequest, raw_request: Request) -> Any:
        task = request.task or self.default_task()
        error = self.check_model(request.model) or self.unsupported(self.default_task())
        if error is not None:
            return error
        try:
            tasks = supported_pooling_tasks(self.model_config)
            if task not in tasks:
                raise ParameterError(
                    f"task {task!r} is not one this model runs: {list(tasks)}", "task"
                )
            self.check_priority(request.priority)
            truncate = self.effective_truncation(request.truncate_prompt_tokens)
            params = self.pooling_params(request, task)
            inputs = await self.request_inputs(request, truncate)
        except ValueError as exc:
            return pooling_bad_request(exc)
        request_id = f"pool-{request.request_id or random_uuid()}"
        created = int(time.time())
        outputs = await self.encode_all(raw_request, request_id, inputs, params, request.model)
        if isinstance(outputs, JSONResponse):
            return outputs
        data = [
            PoolingResponseData(index=i, data=_pooled(o, request.encoding_format))
            for i, o in enumerate(outputs)
        ]
        body = PoolingResponse(
            id=request_id,
            created=created,
            model=self.model_name,
            data=data,
            usage=usage_of(outputs),
        )
        return JSONResponse(body.model_dump())


def _pooled(output: Any, encoding_format: str) -> Any:
    """The pooler's tensor: a vector, or [tokens x hidden] for per-token pooling (base64:
    its float32 bytes, row after row)."""
    import numpy as np

    data = np.asarray(output.outputs.data, dtype=np.float32)
    if encoding_format == "base64":
        return encode_vector(data.reshape(-1), "base64")
    return data.tolist()
