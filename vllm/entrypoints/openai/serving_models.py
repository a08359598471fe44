"""`OpenAIServingModels`: the LoRA adapters a server serves, by model name, and vLLM's runtime
adapter routes (`POST /v1/load_lora_adapter`, `POST /v1/unload_lora_adapter`, present only
with `VLLM_ALLOW_RUNTIME_LORA_UPDATING`), with vLLM's status codes and messages. The completion
and chat handlers read the same name -> LoRARequest map, so an adapter loaded here is usable
by `model=` (and listed in /v1/models) at once. Imports no torch."""

from __future__ import annotations

import asyncio
import collections
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from vllm.entrypoints.openai.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from vllm.entrypoints.openai.serving_engine import error_response
from vllm.logger import init_logger
from vllm.lora.request import LoRARequest

logger = init_logger("vllm.entrypoints.openai.serving_models")


class OpenAIServingModels:
    """The served base model names and LoRA adapters (`lora_requests`: name -> request, in
    load order); loads an adapter on every stage before serving it, unloads it from the map
    (and from the engine once no request uses it)."""

    def __init__(
        self,
        engine: Any,
        served_model_names: list[str],
        lora_requests: list[LoRARequest] | None = None,
    ) -> None:
        self.engine = engine
        self.served_model_names = served_model_names
        self.lora_requests: dict[str, LoRARequest] = {r.lora_name: r for r in lora_requests or []}
        # Ids of adapters loaded at run time: after every --lora-modules id, never reused (an
        # unloaded adapter stays registered in the engine while requests still use it).
        self._next_id = max((r.lora_int_id for r in lora_requests or []), default=0) + 1
        # One load or unload at a time per adapter name (vLLM's atomicity rule).
        self._locks: collections.defaultdict[str, asyncio.Lock] = collections.defaultdict(
            asyncio.Lock
        )

    async def load_lora_adapter(self, request: LoadLoRAAdapterRequest) -> JSONResponse | str:
        """Load and serve an adapter (with `load_inplace`, in place of the one served under
        its name: requests already running keep the old one): vLLM's success text, or its
        error (400; 404 when the directory holds no adapter)."""
        name = request.lora_name
        async with self._locks[name]:
            if not name or not request.lora_path:
                return error_response(
                    "Both 'lora_name' and 'lora_path' must be provided.",
                    err_type="InvalidUserInput",
                )
            replaced = self.lora_requests.get(name)
            if replaced is not None and not request.load_inplace:
                return error_response(
                    f"The lora adapter '{name}' has already been loaded.",
                    err_type="InvalidUserInput",
                    param="lora_name",
                )
            if name in self.served_model_names:
                return error_response(
                    f"The lora adapter name '{name}' is the served base model's name.",
                    err_type="InvalidUserInput",
                    param="lora_name",
                )
            lora = LoRARequest(name, self._next_id, request.lora_path)
            self._next_id += 1
            try:
                # Checked and loaded on every stage (the engine thread), before it is served.
                await self.engine.add_lora(lora)
            except Exception as exc:
                if "No adapter found" in str(exc):
                    return error_response(
                        str(exc), err_type="NotFoundError", status=HTTPStatus.NOT_FOUND
                    )
                return error_response(str(exc), err_type="BadRequestError")
            self.lora_requests[name] = lora
            if replaced is not None:
                await self.engine.remove_lora(replaced.lora_int_id)
            logger.info("Loaded new LoRA adapter: name '%s', path '%s'", name, lora.lora_path)
            return f"Success: LoRA adapter '{name}' added successfully."

    async def unload_lora_adapter(self, request: UnloadLoRAAdapterRequest) -> JSONResponse | str:
        """Stop serving an adapter: vLLM's success text, or 404 for a name not served."""
        name = request.lora_name
        async with self._locks[name]:
            if not name:
                return error_response(
                    "'lora_name' needs to be provided to unload a LoRA adapter.",
                    err_type="InvalidUserInput",
                )
            lora = self.lora_requests.get(name)
            if lora is None:
                return error_response(
                    f"The lora adapter '{name}' cannot be found.",
                    err_type="NotFoundError",
                    status=HTTPStatus.NOT_FOUND,
                    param="lora_name",
                )
            del self.lora_requests[name]
            # Kept registered (the engine logs it) while unfinished requests still use it.
            await self.engine.remove_lora(lora.lora_int_id)
            logger.info("Removed LoRA adapter: name '%s'", name)
            return f"Success: LoRA adapter '{name}' removed successfully."


def attach_lora_routes(app: FastAPI, models: OpenAIServingModels) -> None:
    """vLLM's runtime adapter routes; plain-text 200 on success, an error body otherwise."""
    logger.warning(
        "LoRA dynamic loading & unloading is enabled in the API server. "
        "This should ONLY be used for local development!"
    )

    def answer(result: JSONResponse | str) -> Response:
        return result if isinstance(result, JSONResponse) else Response(result, status_code=200)

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: LoadLoRAAdapterRequest) -> Response:
        return answer(await models.load_lora_adapter(request))

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: UnloadLoRAAdapterRequest) -> Response:
        return answer(await models.unload_lora_adapter(request))
