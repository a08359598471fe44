"""Tiny random decoder pooling models (embedders and sequence classifiers) saved by HF
transformers, and their references: sentence-transformers' semantics computed from HF's hidden
states (last token, [CLS], mean over the attention mask; then normalise), and
`AutoModelForSequenceClassification`'s logits.

Embedders are saved as the bare decoder (`LlamaModel`, `Qwen3Model`, ...: what embedding
checkpoints ship); `sentence_transformers_dir` adds a sentence-transformers pooling module to a
copy of one (MEAN, optionally Normalize), `matryoshka_dir` declares Matryoshka dimensions.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import torch

from tests.utils.family_models import family_config
from tests.utils.tiny_models import build_tokenizer

EMBED_FAMILIES = ("llama3", "mistral", "qwen2", "qwen3")

# Weights drawn as tiny_models does (std 0.08; norms around 1), fixed seed.
_STD = 0.08


def _randomise(model: Any, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
            else:
                param.copy_(_STD * torch.randn(param.shape, generator=gen))


def build_embedder(family: str, out_dir: str, tokenizer: Any, seed: int = 0) -> str:
    """The bare decoder of `family` (family_models' config), randomised and saved."""
    from transformers import AutoModel

    config = family_config(family, tokenizer)
    model = AutoModel.from_config(config, dtype=torch.float32)
    model.config.architectures = [type(model).__name__]
    _randomise(model, seed)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def build_classifier(
    family: str, out_dir: str, tokenizer: Any, num_labels: int, seed: int = 0
) -> str:
    """`family`'s *ForSequenceClassification with `num_labels` labels, randomised, saved."""
    from transformers import AutoModelForSequenceClassification

    config = family_config(family, tokenizer)
    config.num_labels = num_labels
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    _randomise(model, seed)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def sentence_transformers_dir(src: str, out_dir: str, mode: str, normalize: bool) -> str:
    """A copy of `src` declaring a sentence-transformers Pooling module (`mode`: "mean",
    "cls" or "lasttoken") and, with `normalize`, a Normalize module."""
    shutil.copytree(src, out_dir)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    if normalize:
        modules.append(
            {
                "idx": 2,
                "name": "2",
                "path": "2_Normalize",
                "type": "sentence_transformers.models.Normalize",
            }
        )
        os.makedirs(os.path.join(out_dir, "2_Normalize"))
    with open(os.path.join(out_dir, "modules.json"), "w") as f:
        json.dump(modules, f)
    os.makedirs(os.path.join(out_dir, "1_Pooling"))
    flags = {
        "pooling_mode_cls_token": mode == "cls",
        "pooling_mode_mean_tokens": mode == "mean",
        "pooling_mode_lasttoken": mode == "lasttoken",
    }
    with open(os.path.join(out_dir, "1_Pooling", "config.json"), "w") as f:
        json.dump({"word_embedding_dimension": 64, **flags}, f)
    return out_dir


def matryoshka_dir(src: str, out_dir: str, dimensions: list[int]) -> str:
    """A copy of `src` whose config declares `matryoshka_dimensions`."""
    shutil.copytree(src, out_dir)
    path = os.path.join(out_dir, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["matryoshka_dimensions"] = dimensions
    with open(path, "w") as f:
        json.dump(config, f)
    return out_dir


def model_dirs(root: str) -> dict[str, str]:
    """Every tiny pooling model of the tests, saved under `root`."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(build_tokenizer(os.path.join(root, "tok")))
    found = {f: build_embedder(f, os.path.join(root, f), tokenizer) for f in EMBED_FAMILIES}
    llama = found["llama3"]
    found["st-mean"] = sentence_transformers_dir(llama, f"{root}/st-mean", "mean", False)
    found["matryoshka"] = matryoshka_dir(llama, f"{root}/matryoshka", [16, 32])
    found["classify3"] = build_classifier("llama3", f"{root}/classify3", tokenizer, 3)
    found["cross1"] = build_classifier("qwen3", f"{root}/cross1", tokenizer, 1)
    return found


def hf_hidden_states(model_dir: str, prompts: list[Any]) -> list[torch.Tensor]:
    """HF's final hidden states [n, H] (after the final norm) of each prompt (text or ids)."""
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    result = []
    with torch.no_grad():
        for prompt in prompts:
            ids = prompt if isinstance(prompt, list) else tokenizer(prompt).input_ids
            result.append(model(torch.tensor([ids])).last_hidden_state[0])
    return result


def st_pool(hidden: torch.Tensor, mode: str, normalize: bool) -> torch.Tensor:
    """sentence-transformers' pooling of one unpadded sequence's hidden states [n, H]."""
    mask = torch.ones(hidden.shape[0], 1)
    if mode == "last":
        pooled = hidden[-1]
    elif mode == "cls":
        pooled = hidden[0]
    else:  # mean over the attention mask
        pooled = (hidden * mask).sum(0) / mask.sum().clamp(min=1e-9)
    return torch.nn.functional.normalize(pooled, p=2, dim=-1) if normalize else pooled


def hf_classifier_logits(model_dir: str, prompts: list[Any]) -> list[torch.Tensor]:
    """`AutoModelForSequenceClassification`'s logits [num_labels] of each prompt (text, ids,
    or a (text, text_pair) tuple)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    result = []
    with torch.no_grad():
        for prompt in prompts:
            if isinstance(prompt, tuple):
                ids = tokenizer(text=prompt[0], text_pair=prompt[1]).input_ids
            elif isinstance(prompt, list):
                ids = prompt
            else:
                ids = tokenizer(prompt).input_ids
            result.append(model(torch.tensor([ids])).logits[0])
    return result


def assert_close(got: Any, want: torch.Tensor, atol: float = 1e-5) -> None:
    """Equal within `atol` max-abs, and (vectors) cosine >= 1 - atol."""
    got_t = torch.as_tensor(got, dtype=torch.float32)
    assert got_t.shape == want.shape, (got_t.shape, want.shape)
    diff = (got_t - want).abs().max().item()
    assert diff <= atol, f"max abs diff {diff:.3g} > {atol}"
    if want.dim() == 1 and want.numel() > 1:
        cos = torch.nn.functional.cosine_similarity(got_t, want, dim=0).item()
        assert cos >= 1 - atol, f"cosine {cos}"
