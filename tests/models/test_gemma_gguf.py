"""Gemma 2 and Gemma 3 GGUF files (llama.cpp's `gemma2` / `gemma3` architectures): tiny
checkpoints written as F32 GGUF the way llama.cpp's converter writes them (its tensor names,
norm weights stored as 1 + w, its header keys and nothing it leaves out) load to the original
model: the config read from the header equals the original in every field the model uses,
the weights equal the safetensors ones, and greedy ids and text equal HF transformers' eager
`generate` on the original checkpoint at PP 1 and PP 2 (mp).

llama.cpp's converter writes no score scale (llama.cpp scales by 1/sqrt(key_length)), no
layer pattern (gemma2: every 2nd layer global, gemma3: every 6th) and no Gemma 3 local rope
base (10000); the checkpoints here are built with exactly those values so the file can hold
them. A third file (`gemma3-keys`) is the tiny_gemma Gemma 3 with its own layer pattern and
local rope base written under llama.cpp's optional keys `attention.sliding_window_pattern`
and `rope.freq_base_swa`. Header variants (no window, a period key, linear rope scaling, a
bad pattern) are checked on the config alone.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from tests.utils import family_models, tiny_gemma, tiny_models
from vllm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=32)
# file kind -> (HF kind, build_gemma overrides): values llama.cpp's converter can represent.
KINDS: dict[str, tuple[str, dict[str, Any]]] = {
    "gemma2": ("gemma2", {"query_pre_attn_scalar": 32}),
    "gemma3": (
        "gemma3",
        {
            "query_pre_attn_scalar": 32,
            "layer_types": None,  # HF's default: every 6th layer global, as llama.cpp
            "rope_parameters": {
                "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            },
        },
    ),
    "gemma3-keys": ("gemma3", {"query_pre_attn_scalar": 32}),
}
# HF name after "model.layers.N." -> llama.cpp name (gguf.constants' MODEL_TENSORS for
# gemma2/gemma3: four norms per layer, q/k norms for gemma3).
_GEMMA_NAMES = {
    **family_models._GGUF_LAYER_NAMES,
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
CHAT_TEMPLATE = (
    "{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def write_gemma_gguf(
    model_dir: str, out_path: str, kind: str, tokenizer_fields: dict[str, Any] | None = None
) -> str:
    """Write a saved tiny Gemma as llama.cpp's convert_hf_to_gguf.py (Gemma2Model /
    Gemma3Model) would, in F32: its keys, its tensor names, every *norm.weight + 1, no
    output.weight (tied). `kind` "gemma3-keys" also writes the per-layer window pattern and
    the local rope base; with `tokenizer_fields` the tokenizer and a chat template too."""
    import gguf
    from safetensors.torch import load_file
    from transformers import AutoConfig

    arch = "gemma2" if kind == "gemma2" else "gemma3"
    cfg = AutoConfig.from_pretrained(model_dir)
    state = load_file(os.path.join(model_dir, "model.safetensors"))
    writer = gguf.GGUFWriter(out_path, arch)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)
    if tokenizer_fields is not None:
        family_models._write_tokenizer(writer, tokenizer_fields, CHAT_TEMPLATE)
    if arch == "gemma2":  # no rope base: Gemma 2's is llama.cpp's default
        writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    else:
        writer.add_rope_freq_base(cfg.rope_parameters["full_attention"]["rope_theta"])
        if cfg.final_logit_softcapping:
            writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    writer.add_sliding_window(cfg.sliding_window)
    if kind == "gemma3-keys":
        writer.add_sliding_window_pattern([t == tiny_gemma.S for t in cfg.layer_types])
        writer.add_rope_freq_base_swa(cfg.rope_parameters["sliding_attention"]["rope_theta"])
    for name, tensor in state.items():
        if name == "lm_head.weight":
            continue  # the converter skips it: Gemma ties the head to the embedding
        array = tensor.float().numpy()
        if name.endswith("norm.weight"):
            array = array + np.float32(1.0)
        if name == "model.embed_tokens.weight":
            writer.add_tensor("token_embd.weight", array)
        elif name == "model.norm.weight":
            writer.add_tensor("output_norm.weight", array)
        else:
            _, _, layer, rest = name.split(".", 3)
            module, suffix = rest.rsplit(".", 1)
            writer.add_tensor(f"blk.{layer}.{_GEMMA_NAMES[module]}.{suffix}", array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Iterator[dict[str, tuple[str, str]]]:
    """file kind -> (original HF directory, its GGUF file); gemma3 holds the tokenizer, whose
    cache lives in this module's own directory (built by the PP 1 test, read by PP 2)."""
    from vllm.transformers_utils.gguf_config import resolve_model

    root = str(tmp_path_factory.mktemp("gemma_gguf"))
    tok_dir = os.path.join(root, "tokenizer")
    # SmolLM2's tokenizer (the source of the HF checkpoints) from the usual cache, as for every
    # tiny model: under the module's new cache dir it would be rebuilt from the 138 MB GGUF
    # (tens of seconds), and that cache is for gemma3's file only.
    tiny_models.build_tokenizer(tok_dir)
    patch = pytest.MonkeyPatch()
    patch.setenv("VLLM_PP_CACHE_DIR", os.path.join(root, "cache"))
    fields = family_models.gguf_tokenizer_fields(resolve_model("smollm2"))
    out = {}
    for kind, (hf_kind, overrides) in KINDS.items():
        model_dir = tiny_gemma.build_gemma(hf_kind, os.path.join(root, kind), tok_dir, **overrides)
        path = os.path.join(root, f"{kind}.gguf")
        write_gemma_gguf(model_dir, path, kind, fields if kind == "gemma3" else None)
        out[kind] = (model_dir, path)
    yield out
    patch.undo()


@pytest.fixture(scope="module")
def reference(files):
    """file kind -> HF greedy ids of tiny_models.PROMPTS (32 new tokens), computed once."""
    from transformers import AutoTokenizer

    cache: dict[str, list[list[int]]] = {}

    def get(kind: str) -> list[list[int]]:
        if kind not in cache:
            model_dir = files[kind][0]
            cache[kind] = tiny_models.hf_greedy_with(
                tiny_gemma.load_hf(model_dir),
                AutoTokenizer.from_pretrained(model_dir),
                tiny_models.PROMPTS,
                32,
            )
        return cache[kind]

    return get


def _llm(kind: str, files: dict[str, tuple[str, str]], **kwargs: Any) -> LLM:
    model_dir, path = files[kind]
    if kind != "gemma3":  # the others hold no tokenizer: the original's
        kwargs["tokenizer"] = model_dir
    return LLM(path, kv_cache_space=0.05, swap_space=0.01, **kwargs)


def check_equal(llm: LLM, expected: list[list[int]]) -> None:
    outs = llm.generate(tiny_models.PROMPTS, GREEDY, use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    for out, ref in zip(outs, expected):
        assert out.outputs[0].token_ids == ref, f"prompt {out.prompt!r}"
        assert out.outputs[0].text == tokenizer.decode(ref, skip_special_tokens=True)


# Every config field the Gemma modules read.
FIELDS = [
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "rms_norm_eps",
    "hidden_activation",
    "sliding_window",
    "layer_types",
    "query_pre_attn_scalar",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "rope_parameters",
    "tie_word_embeddings",
    "attention_bias",
    "bos_token_id",
    "eos_token_id",
]


@pytest.mark.parametrize("kind", list(KINDS))
def test_config_from_gguf_equals_original(kind, files):
    """The config read from the header equals the original one in every field the model
    uses, and so do the per-layer specs (window, rope, soft-cap, q/k norms) built from it."""
    from transformers import AutoConfig

    from vllm.model_executor.models.gemma2 import gemma2_layer_spec
    from vllm.model_executor.models.gemma3 import gemma3_layer_spec
    from vllm.transformers_utils.gguf_config import load_gguf_config

    model_dir, path = files[kind]
    original, loaded = AutoConfig.from_pretrained(model_dir), load_gguf_config(path)
    assert type(loaded) is type(original)
    assert loaded.architectures == original.architectures
    for field in FIELDS:
        want = getattr(original, field)
        if isinstance(want, float):  # the header stores float32
            want = pytest.approx(want, rel=1e-6)
        assert getattr(loaded, field) == want, field
    spec = gemma2_layer_spec if kind == "gemma2" else gemma3_layer_spec
    for i in range(original.num_hidden_layers):
        assert spec(loaded, i) == spec(original, i)
    # The files differ where they should: gemma3-keys has another pattern and local base.
    if kind == "gemma3-keys":
        assert loaded.layer_types == tiny_gemma.GEMMA3_LAYER_TYPES
        assert loaded.rope_parameters["sliding_attention"]["rope_theta"] == 100.0


@pytest.mark.parametrize("kind", list(KINDS))
def test_weights_from_gguf_equal_safetensors(kind, files):
    """Every GGUF tensor maps to the HF name and value of the original (norms lose the 1
    llama.cpp adds); nothing is missing but the tied head. transformers' own GGUF reverse
    mapping (its Gemma2TensorProcessor also subtracts 1) reads the same weights from the file
    (its config from the file is not used: it reads no soft-caps nor score scale)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from vllm.model_executor.gguf_loader import iter_gguf_weights

    model_dir, path = files[kind]
    state = load_file(os.path.join(model_dir, "model.safetensors"))
    state.pop("lm_head.weight", None)
    loaded = dict(iter_gguf_weights(path))
    assert sorted(loaded) == sorted(state)
    directory, file_name = os.path.split(path)
    theirs = AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=file_name, dtype=torch.float32
    ).state_dict()
    for name, tensor in state.items():
        tol = 1e-6 if name.endswith("norm.weight") else 0.0  # (w + 1) - 1 rounds in float32
        torch.testing.assert_close(loaded[name], tensor.float(), rtol=0, atol=tol)
        torch.testing.assert_close(loaded[name], theirs[name], rtol=0, atol=0)


@pytest.mark.parametrize("kind", list(KINDS))
def test_gguf_pp1_matches_hf(kind, files, reference):
    """Greedy ids and text of the GGUF equal HF's on the original checkpoint; gemma3's file
    also gives the tokenizer and chat template, built from the file and again from its cache
    (transformers' GemmaTokenizer class must not re-split the file's BPE on reload)."""
    from transformers import AutoTokenizer

    from vllm.transformers_utils.gguf_config import load_gguf_tokenizer

    llm = _llm(kind, files)
    try:
        if kind == "gemma3":
            original = AutoTokenizer.from_pretrained(files[kind][0])
            cached = load_gguf_tokenizer(files[kind][1])
            for tokenizer in (llm.get_tokenizer(), cached):
                for prompt in tiny_models.PROMPTS:
                    assert tokenizer.encode(prompt) == original.encode(prompt)
                assert tokenizer.chat_template == CHAT_TEMPLATE
        check_equal(llm, reference(kind))
    finally:
        llm.shutdown()


@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
def test_gguf_pp2_mp_matches_hf(kind, files, reference):
    """PP = 2 on mp: each stage reads its layers from the file; output equals HF's."""
    llm = _llm(kind, files, pipeline_parallel_size=2, distributed_executor_backend="mp")
    try:
        check_equal(llm, reference(kind))
    finally:
        llm.shutdown()


def _gemma3_header(**extra: Any) -> Any:
    """A gemma3 header (metadata only, no tensors: tied head) with `extra` keys."""
    from vllm.transformers_utils.gguf_config import GGUFHeader

    meta = {
        "general.architecture": "gemma3",
        "gemma3.block_count": 4,
        "gemma3.embedding_length": 64,
        "gemma3.attention.head_count": 4,
        "gemma3.attention.key_length": 32,
        "gemma3.rope.freq_base": 1_000_000.0,
    }
    meta.update({f"gemma3.{key}": value for key, value in extra.items()})
    return GGUFHeader(meta, [])


def test_gemma3_header_variants():
    """No window key: every layer global (llama.cpp then runs no sliding window); a period
    key; linear rope scaling (Gemma 3 4B+) on the global layers only; the 27B score scale; a
    per-layer pattern of the wrong length is refused."""
    from vllm.transformers_utils.gguf_config import gguf_config_dict

    F = tiny_gemma.F
    fields = gguf_config_dict(_gemma3_header(), "x.gguf")
    assert fields["layer_types"] == [F] * 4 and fields["query_pre_attn_scalar"] == 32
    assert fields["final_logit_softcapping"] is None
    fields = gguf_config_dict(
        _gemma3_header(**{"attention.sliding_window": 16, "attention.sliding_window_pattern": 2}),
        "x.gguf",
    )
    assert fields["layer_types"] == [tiny_gemma.S, F, tiny_gemma.S, F]
    fields = gguf_config_dict(
        _gemma3_header(**{"rope.scaling.type": "linear", "rope.scaling.factor": 8.0}), "x.gguf"
    )
    assert fields["rope_parameters"] == {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    }
    # llama.cpp scales the 27B (62 layers for Gemma 3) by hidden / heads, as HF's 168.
    big = _gemma3_header(
        **{"block_count": 62, "embedding_length": 5376, "attention.head_count": 32}
    )
    assert gguf_config_dict(big, "x.gguf")["query_pre_attn_scalar"] == 168
    with pytest.raises(ValueError, match="sliding_window_pattern"):
        gguf_config_dict(
            _gemma3_header(
                **{"attention.sliding_window": 16, "attention.sliding_window_pattern": [True]}
            ),
            "x.gguf",
        )
