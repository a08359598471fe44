"""Decoder stage modules as pooling models (vLLM's `as_embedding_model` / `as_seq_cls_model`).

The same layers as the generator; the last stage has no lm_head. An embedder returns the final
norm's output for the pooler; a sequence classifier (`*ForSequenceClassification`, reward
models) adds HF's `score` head ([num_labels, hidden], no bias), replicated on every TP rank of
the last stage, which the pooler applies to the pooled rows (`classify_head`).

Checkpoints name their tensors as HF saves them: `model.layers...` (a *ForCausalLM or a
*ForSequenceClassification) or `layers...` (a bare `LlamaModel` / `Qwen3Model`); both load.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from functools import cache
from typing import Any

import torch
from torch import nn

from vllm.model_executor.models.utils import Shard, copy_weight

_BARE_PREFIXES = ("embed_tokens.", "layers.", "norm.")


def _hf_name(name: str) -> str:
    """A bare decoder's tensor name with the `model.` prefix the stage modules use."""
    return "model." + name if name.startswith(_BARE_PREFIXES) else name


def num_labels_of(config: Any) -> int:
    """A classifier's label count: HF's `num_labels` property, or the size of `id2label`
    (all a stage process sees: its config comes as the plain `to_dict()` fields)."""
    labels = getattr(config, "num_labels", None)
    if labels:
        return int(labels)
    return len(getattr(config, "id2label", None) or {})


@cache
def as_pooling_model(base: type, convert: str) -> type:
    """A subclass of the decoder stage module `base` for `convert` ("embed", "classify",
    "reward"): built once per pair."""

    class PoolingStage(base):  # type: ignore[valid-type, misc]
        is_pooling_model = True

        def __init__(self, config: Any, layout: Any) -> None:
            super().__init__(config, layout)
            if hasattr(self, "lm_head"):
                del self.lm_head  # no vocabulary projection on a pooling model
            self.tie_word_embeddings = False  # nothing on the last stage reads embed_tokens
            self.has_classifier = convert in ("classify", "reward")
            if self.has_classifier and layout.is_last:
                labels = num_labels_of(config)
                if labels < 1:
                    raise ValueError("a sequence-classification model needs num_labels >= 1")
                self.score = nn.Linear(config.hidden_size, labels, bias=False)
                # Read here: after loading, pack_linears may replace the Linear by a packed one.
                self.score_dtype = self.score.weight.dtype

        def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
            raise RuntimeError("a pooling model has no lm_head: it pools, it does not sample")

        def classify_head(self, pooled: torch.Tensor) -> torch.Tensor:
            """pooled [N, hidden] -> logits [N, num_labels] (the `score` head)."""
            return self.score(pooled.to(self.score_dtype))

        def weight_shard(self, name: str) -> Shard | Sequence[Shard] | None:
            name = _hf_name(name)
            if name.startswith("score."):
                return None  # replicated: every TP rank of the last stage holds it whole
            return super().weight_shard(name)

        def owns_weight(self, name: str) -> bool:
            name = _hf_name(name)
            if name.startswith("lm_head."):
                return False
            if name.startswith("score."):
                return self.has_classifier and self.layout.is_last
            return bool(super().owns_weight(name))

        def load_other_weight(
            self, params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor
        ) -> str | None:
            if name == "score.weight":
                copy_weight(params[name], tensor, name)
                return name
            return super().load_other_weight(params, name, tensor)

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
            super().load_weights((_hf_name(n), t) for n, t in weights)

    PoolingStage.__name__ = PoolingStage.__qualname__ = f"{base.__name__}As{convert.title()}"
    return PoolingStage
