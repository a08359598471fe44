"""`--lora-modules`: the adapters a server serves from the start, each under its own model
name (vLLM's `name=path` form, or its JSON form `{"name": ..., "path": ...,
"base_model_name": ...}`), numbered 1, 2, ... as LoRA ids. Imports no torch."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vllm.lora.request import LoRARequest


@dataclass
class LoRAModulePath:
    """One served adapter: its model name, directory and (optionally) the base model it names
    as its parent in /v1/models."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(value: str) -> LoRAModulePath:
    """`name=path` or a JSON object with `name`, `path` and optionally `base_model_name`."""
    text = value.strip()
    if text.startswith("{"):
        try:
            data = json.loads(text)
            return LoRAModulePath(data["name"], data["path"], data.get("base_model_name"))
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"Invalid JSON format for --lora-modules: {value}") from exc
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(
            f"Invalid format for --lora-modules: {value!r}; expected 'name=path' or JSON"
        )
    return LoRAModulePath(name, path)


class LoRAParserAction(argparse.Action):
    """argparse action collecting `--lora-modules` values into LoRAModulePaths."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        items = [values] if isinstance(values, str) else list(values or [])
        try:
            modules = [parse_lora_module(item) for item in items]
        except ValueError as exc:
            parser.error(str(exc))
        setattr(namespace, self.dest, (getattr(namespace, self.dest, None) or []) + modules)


def add_lora_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--lora-modules",
        type=str,
        default=None,
        nargs="+",
        action=LoRAParserAction,
        help="LoRA module configurations in either 'name=path' format or JSON format "
        '(\'{"name": "name", "path": "lora_path", "base_model_name": "id"}\'); needs '
        "--enable-lora.",
    )


def lora_requests(modules: Sequence[LoRAModulePath] | None) -> list[LoRARequest]:
    """The served adapters as LoRARequests with ids 1, 2, ... in flag order."""
    return [
        LoRARequest(m.name, i + 1, m.path, base_model_name=m.base_model_name)
        for i, m in enumerate(modules or [])
    ]
