"""`LoRARegistry`: the engine's adapters. It checks an adapter (torch-free) before any stage
loads it, registers it on every rank, and sends the whole set again to replaced stages, so a
stage process started after a failure serves the same adapters. Imports no torch."""

from __future__ import annotations

from typing import Any, Protocol

from vllm.config import LoRAConfig
from vllm.distributed.rank_verbs import Verb
from vllm.logger import init_logger
from vllm.lora.peft_config import read_adapter_config
from vllm.lora.request import LoRARequest

logger = init_logger("vllm.lora.registry")


class RankCaller(Protocol):
    """What the registry needs of the executor: its verbs run on every rank."""

    def collective_rpc(
        self, method: Verb, args: tuple = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]: ...


class LoRARegistry:
    """Registered adapters by id, mirrored on every rank of the executor."""

    def __init__(self, config: LoRAConfig | None, executor: RankCaller) -> None:
        self.config = config
        self.executor = executor
        self.requests: dict[int, LoRARequest] = {}
        if config is not None:
            self._check_ranks(executor.collective_rpc(Verb.SYNC_LORAS, (config, [])))

    @property
    def enabled(self) -> bool:
        return self.config is not None

    def check_request(self, lora_request: Any) -> None:
        """A request's `lora_request`: LoRA must be on and it must be a LoRARequest."""
        if lora_request is None:
            return
        if self.config is None:
            raise ValueError(f"Got lora_request {lora_request} but LoRA is not enabled!")
        if not isinstance(lora_request, LoRARequest):
            raise TypeError(
                f"lora_request must be a LoRARequest, got {type(lora_request).__name__}."
            )
        known = self.requests.get(lora_request.lora_int_id)
        if known is not None and known.lora_name != lora_request.lora_name:
            raise ValueError(
                f"lora_int_id {lora_request.lora_int_id} is registered as adapter "
                f"{known.lora_name!r}, not {lora_request.lora_name!r}."
            )

    def ensure(self, lora_request: LoRARequest) -> None:
        """Register a request's adapter on first use."""
        if lora_request.lora_int_id not in self.requests:
            self.add(lora_request)

    def add(self, lora_request: LoRARequest) -> bool:
        """Check and load an adapter on every rank (False: the id is registered already).
        A bad adapter is a ValueError and leaves no rank holding it."""
        self.check_request(lora_request)
        assert self.config is not None
        if lora_request.lora_int_id in self.requests:
            return False
        adapter = read_adapter_config(lora_request.lora_path)
        if adapter.rank > self.config.max_lora_rank:
            raise ValueError(
                f"LoRA rank {adapter.rank} is greater than max_lora_rank "
                f"{self.config.max_lora_rank}."
            )
        errors = self.executor.collective_rpc(Verb.ADD_LORA, (lora_request,))
        if any(errors):
            self.executor.collective_rpc(Verb.REMOVE_LORA, (lora_request.lora_int_id,))
            raise ValueError(next(e for e in errors if e))
        self.requests[lora_request.lora_int_id] = lora_request
        logger.info(
            "Loaded LoRA adapter %r (id %d)", lora_request.lora_name, lora_request.lora_int_id
        )
        return True

    def remove(self, lora_id: int) -> bool:
        if self.requests.pop(lora_id, None) is None:
            return False
        self.executor.collective_rpc(Verb.REMOVE_LORA, (lora_id,))
        return True

    def ids(self) -> set[int]:
        return set(self.requests)

    def resync(self) -> None:
        """After stages were replaced: every rank holds the registered adapters again."""
        if self.config is not None:
            self._check_ranks(
                self.executor.collective_rpc(
                    Verb.SYNC_LORAS, (self.config, list(self.requests.values()))
                )
            )

    @staticmethod
    def _check_ranks(errors: list[Any]) -> None:
        for error in errors:
            if error:
                raise RuntimeError(f"a stage could not load the registered LoRA adapters: {error}")
