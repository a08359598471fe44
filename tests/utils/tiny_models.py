"""Tiny random-weight OPT and LLaMA models saved as HF directories, plus HF greedy references.

The tokenizer is SmolLM2's (built by transformers from the bundled GGUF, saved once). Weights are
drawn with std 0.08 rather than HF's 0.02 so logits are well separated and fp32 summation order
cannot flip a greedy choice.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

KINDS = ("opt-pre", "opt-post", "llama-gqa-tied", "llama-gqa-untied")

PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "In a hole in the ground there lived a hobbit. Not a nasty, dirty, wet hole",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25",
    "def fibonacci(n):",
    "The quick brown fox jumps over the lazy dog because",
    "A",
    "Once upon a time, in a kingdom far away, there was a princess who loved to read books "
    "about distant stars, ancient machines and the people who built them long ago.",
]


def build_tokenizer(out_dir: str) -> str:
    """Save SmolLM2's tokenizer (from the bundled GGUF) into `out_dir`; returns the dir."""
    from vllm.transformers_utils.gguf_config import load_gguf_tokenizer, resolve_model

    tokenizer = load_gguf_tokenizer(resolve_model("smollm2"))
    tokenizer.save_pretrained(out_dir)
    return out_dir


def _config(kind: str, tokenizer: Any, num_layers: int) -> Any:
    from transformers import LlamaConfig, OPTConfig

    common = dict(
        vocab_size=len(tokenizer),
        num_hidden_layers=num_layers,
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id
        if tokenizer.pad_token_id is not None
        else tokenizer.eos_token_id,
    )
    if kind.startswith("opt"):
        pre = kind == "opt-pre"
        return OPTConfig(
            hidden_size=64,
            ffn_dim=128,
            num_attention_heads=4,
            do_layer_norm_before=pre,
            # opt-350m style: embeddings in a smaller space, projected in and out.
            word_embed_proj_dim=64 if pre else 32,
            dropout=0.0,
            attention_dropout=0.0,
            **common,
        )
    return LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        # "llama-mqa" (one KV head: fewer than the TP ranks) is built by the TP tests only.
        num_key_value_heads=1 if kind == "llama-mqa" else 2,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=kind == "llama-gqa-tied",
        **common,
    )


def build_model(
    kind: str, out_dir: str, tokenizer_dir: str, num_layers: int = 6, seed: int = 0
) -> str:
    """Create, randomise (std 0.08, fixed seed) and save a tiny model with the tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    return save_random_model(_config(kind, tokenizer, num_layers), out_dir, tokenizer, seed)


def save_random_model(config: Any, out_dir: str, tokenizer: Any, seed: int = 0) -> str:
    """Instantiate `config` in HF transformers, randomise it (std 0.08; norms around 1) and
    save it with the tokenizer."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
            else:
                param.copy_(0.08 * torch.randn(param.shape, generator=gen))
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def load_hf(model_dir: str) -> Any:
    """The HF transformers model of a saved directory, float32, in eval mode: the oracle."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_greedy(model_dir: str, prompts: list[str], max_new_tokens: int) -> list[list[int]]:
    """HF transformers' greedy continuation of each prompt of a saved HF model directory."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return hf_greedy_with(load_hf(model_dir), tokenizer, prompts, max_new_tokens)


def load_hf_smollm2(dtype: torch.dtype = torch.float32) -> Any:
    """transformers' model of the bundled SmolLM2 GGUF, loaded the way transformers loads it
    (dequantized to `dtype`), in eval mode."""
    from transformers import AutoModelForCausalLM

    from vllm.transformers_utils.gguf_config import resolve_model

    directory, name = os.path.split(resolve_model("smollm2"))
    return AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=dtype).eval()


def hf_smollm2_greedy(
    prompts: list[str], max_new_tokens: int, model: Any = None
) -> list[list[int]]:
    """The same oracle for the bundled SmolLM2 GGUF: `model` (`load_hf_smollm2()` when not
    given) with the tokenizer transformers builds from the file."""
    from vllm.transformers_utils.gguf_config import load_gguf_tokenizer, resolve_model

    if model is None:
        model = load_hf_smollm2()
    tokenizer = load_gguf_tokenizer(resolve_model("smollm2"))
    return hf_greedy_with(model, tokenizer, prompts, max_new_tokens)


# Below this many parameters a model's matmuls gain nothing from a second thread (SmolLM2,
# 135M, keeps the default).
ONE_THREAD_MAX_PARAMS = 20_000_000


@contextmanager
def one_thread_if_tiny(model: Any) -> Iterator[None]:
    """Run HF's reference of a tiny model on one torch thread, then restore the count. On a
    loaded 2-core machine two threads stall each other on tiny matmuls: the 8 prompts x 32
    tokens of one tiny model took 40-47 s on two threads against 9-19 s on one (measured with
    the suite running alongside). The weights' std of 0.08 keeps the greedy choices
    independent of the summation order a thread count picks."""
    threads = torch.get_num_threads()
    tiny = sum(p.numel() for p in model.parameters()) < ONE_THREAD_MAX_PARAMS
    if tiny:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def hf_greedy_with(
    model: Any, tokenizer: Any, prompts: list[str], max_new_tokens: int
) -> list[list[int]]:
    """`generate(do_sample=False)` one prompt at a time (no padding); new token ids only."""
    return hf_greedy_ids(model, [tokenizer.encode(p) for p in prompts], max_new_tokens)


def hf_greedy_ids(model: Any, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """`generate(do_sample=False)` on prompts given as token ids, one at a time (no padding);
    new token ids only."""
    model.eval()
    outputs = []
    with one_thread_if_tiny(model), torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=model.config.pad_token_id,
            )
            outputs.append(out[0, ids.shape[1] :].tolist())
    return outputs


def model_dirs(root: str) -> dict[str, str]:
    """Build (once per root) the tokenizer and all tiny models; returns kind -> directory."""
    return build_dirs(root, KINDS, build_model)


def build_dirs(root: str, kinds: Any, build: Any) -> dict[str, str]:
    """Build (once per root) the tokenizer, then `build(kind, path, tokenizer_dir)` for each
    kind not built yet; returns kind -> directory."""
    tok_dir = os.path.join(root, "tokenizer")
    if not os.path.isdir(tok_dir):
        build_tokenizer(tok_dir)
    dirs = {}
    for kind in kinds:
        path = os.path.join(root, kind)
        if not os.path.isdir(path):
            build(kind, path, tok_dir)
        dirs[kind] = path
    return dirs
