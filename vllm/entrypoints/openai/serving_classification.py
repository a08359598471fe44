"""POST /classify: each input's class probabilities (the classifier head's activation, a
softmax over the labels by default) and its most likely label from the model's `id2label`."""

from __future__ import annotations

import time
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from vllm.entrypoints.openai.protocol import random_uuid
from vllm.entrypoints.openai.protocol_pooling import (
    ClassificationData,
    ClassificationRequest,
    ClassificationResponse,
)
from vllm.entrypoints.openai.serving_pooling_base import (
    PoolingServing,
    pooling_bad_request,
    prompt_list,
    usage_of,
)


class ServingClassification(PoolingServing):
    """Handles /classify."""

    task = "classify"
    api = "Classification"

    async def create_classify(self, request: ClassificationRequest, raw_request: Request) -> Any:
        error = self.check_model(request.model) or self.unsupported()
        if error is not None:
            return error
        try:
            self.check_priority(request.priority)
            truncate = self.effective_truncation(request.truncate_prompt_tokens)
            params = self.pooling_params(request)
            prompts = prompt_list(request.input, "input")
            inputs = await self.engine_inputs(prompts, True, truncate)
        except ValueError as exc:
            return pooling_bad_request(exc)
        request_id = f"classify-{request.request_id or random_uuid()}"
        created = int(time.time())
        outputs = await self.encode_all(raw_request, request_id, inputs, params, request.model)
        if isinstance(outputs, JSONResponse):
            return outputs
        id2label = getattr(getattr(self.model_config, "hf_config", None), "id2label", None) or {}
        data = []
        for i, output in enumerate(outputs):
            probs = probs_of(output)
            best = max(range(len(probs)), key=probs.__getitem__) if probs else None
            data.append(
                ClassificationData(
                    index=i,
                    label=id2label.get(best) if best is not None else None,
                    probs=probs,
                    num_classes=len(probs),
                )
            )
        body = ClassificationResponse(
            id=request_id,
            created=created,
            model=self.model_name,
            data=data,
            usage=usage_of(outputs),
        )
        return JSONResponse(body.model_dump())


def probs_of(output: Any) -> list[float]:
    """The class probabilities of a finished pooling request (vLLM's ClassificationOutput)."""
    from vllm.outputs import ClassificationRequestOutput

    return [float(p) for p in ClassificationRequestOutput.from_base(output).outputs.probs]
