"""`LoRARequest`: which adapter a request runs with (vLLM's `vllm.lora.request.LoRARequest`).
Imports no torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LoRARequest:
    """A LoRA adapter by name, a unique positive integer id and its directory (PEFT layout:
    `adapter_config.json` plus `adapter_model.safetensors` or `adapter_model.bin`).

    Two requests are the same adapter when their names are equal (vLLM's rule)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    lora_local_path: str | None = None
    long_lora_max_len: int | None = None
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool):
            raise TypeError(f"lora_int_id must be an int, got {self.lora_int_id!r}")
        if self.lora_int_id < 1:
            raise ValueError(f"id must be > 0, got {self.lora_int_id}")
        if self.lora_local_path and not self.lora_path:
            self.lora_path = self.lora_local_path
        if not self.lora_path:
            raise ValueError("lora_path cannot be empty")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    @property
    def local_path(self) -> str:
        return self.lora_path

    def __eq__(self, value: object) -> bool:
        return isinstance(value, LoRARequest) and self.lora_name == value.lora_name

    def __hash__(self) -> int:
        return hash(self.lora_name)
