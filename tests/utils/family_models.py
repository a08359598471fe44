"""Tiny random-weight checkpoints of the LLaMA-style families (Llama 3.1, Mistral, Qwen2.5,
Qwen3, Phi-3), saved by HF transformers with SmolLM2's tokenizer, as tiny_models.py does for
OPT and LLaMA (weights std 0.08, norms 1 + 0.1 N(0, 1), fixed seed).

Each config carries what makes its family different and what users' checkpoints carry:
  llama3   Llama 3.1 rope scaling (`rope_type: llama3`, original context 32 of 256), GQA
  mistral  an explicit head_dim (32) wider than hidden / heads (16), GQA, no sliding window
  qwen2    q/k/v biases, tied embeddings, YaRN scaling (Qwen2.5's long-context recipe)
  qwen3    per-head q/k RMSNorm, head_dim 32 (hidden 64, 4 heads), tied embeddings
  phi3     fused qkv_proj / gate_up_proj, one KV head (replicated over TP ranks), longrope
           with original context 128 of 512: tiny_models.PROMPTS stay within it (short
           factors), LONG_PROMPTS start past it (long factors)
WINDOWED adds windowed variants (16-token windows, shorter than most prompts): Mistral's on
every layer, Qwen2's on the layers from max_window_layers (2) on.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import numpy as np

FAMILIES = ("llama3", "mistral", "qwen2", "qwen3", "phi3")
NUM_LAYERS = 4

# Longer than phi3's original context (128 tokens) from the prompt on: 141 and 167 tokens.
LONG_PROMPTS = [
    "Once upon a time, in a kingdom far away, there was a princess who loved to read books "
    "about distant stars, ancient machines and the people who built them long ago. " * 4,
    " ".join(str(i) for i in range(1, 60)),
]
PHI3_ORIGINAL_CONTEXT = 128

LONGROPE_SHORT = [1.0, 1.0, 1.05, 1.1, 1.2, 1.3, 1.5, 2.0]
LONGROPE_LONG = [1.0, 1.3, 1.7, 2.2, 3.0, 4.0, 6.0, 8.0]


WINDOWED = {
    "mistral-window": ("mistral", {"sliding_window": 16}),
    "qwen2-window": (
        "qwen2",
        {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 2},
    ),
}


def family_config(kind: str, tokenizer: Any, num_layers: int = NUM_LAYERS) -> Any:
    """The HF config of one tiny family model (or of a WINDOWED variant)."""
    import transformers

    if kind in WINDOWED:
        base, overrides = WINDOWED[kind]
        config = family_config(base, tokenizer, num_layers)
        for key, value in overrides.items():
            setattr(config, key, value)
        if base == "qwen2":  # layer_types is derived at construction: derive it again
            config.layer_types = [
                "sliding_attention" if i >= config.max_window_layers else "full_attention"
                for i in range(num_layers)
            ]
        return config

    common: dict[str, Any] = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
    )
    if kind == "llama3":
        rope = {
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        }
        return transformers.LlamaConfig(
            max_position_embeddings=256, rope_parameters=rope, tie_word_embeddings=False, **common
        )
    if kind == "mistral":
        return transformers.MistralConfig(
            head_dim=32, max_position_embeddings=256, sliding_window=None, **common
        )
    if kind == "qwen2":
        rope = {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 32,
        }
        return transformers.Qwen2Config(
            max_position_embeddings=128,
            rope_parameters=rope,
            tie_word_embeddings=True,
            use_sliding_window=False,
            **common,
        )
    if kind == "qwen3":
        return transformers.Qwen3Config(
            head_dim=32, max_position_embeddings=256, tie_word_embeddings=True, **common
        )
    if kind == "phi3":
        common["num_key_value_heads"] = 1
        rope = {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": LONGROPE_SHORT,
            "long_factor": LONGROPE_LONG,
        }
        return transformers.Phi3Config(
            max_position_embeddings=4 * PHI3_ORIGINAL_CONTEXT,
            original_max_position_embeddings=PHI3_ORIGINAL_CONTEXT,
            rope_scaling=rope,
            sliding_window=None,
            tie_word_embeddings=False,
            **common,
        )
    raise ValueError(f"unknown family {kind!r}")


# Each family's chat format, small: what LLM.chat must render through the tokenizer.
CHAT_TEMPLATES = {
    "llama3": (
        "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
        "<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
        "{% endif %}"
    ),
    "mistral": (
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}"
        "[INST] {{ m['content'] }} [/INST]{% else %}{{ m['content'] }}{{ eos_token }}"
        "{% endif %}{% endfor %}"
    ),
    "qwen2": (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    ),
    "phi3": (
        "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    ),
}
CHAT_TEMPLATES["qwen3"] = CHAT_TEMPLATES["qwen2"]


def expected_chat_text(kind: str, tokenizer: Any, conversation: list[dict[str, str]]) -> str:
    """One user message rendered in the family's format (what its template must produce)."""
    (message,) = conversation
    text = message["content"]
    if kind == "llama3":
        return (
            f"{tokenizer.bos_token}<|start_header_id|>user<|end_header_id|>\n\n{text}<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n"
        )
    if kind == "mistral":
        return f"{tokenizer.bos_token}[INST] {text} [/INST]"
    if kind == "phi3":
        return f"<|user|>\n{text}<|end|>\n<|assistant|>\n"
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def build_family(kind: str, out_dir: str, tokenizer_dir: str, num_layers: int = NUM_LAYERS) -> str:
    """Create and save one tiny family model; returns its directory."""
    from transformers import AutoTokenizer

    from tests.utils import tiny_models

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.chat_template = CHAT_TEMPLATES[WINDOWED.get(kind, (kind,))[0]]
    return tiny_models.save_random_model(
        family_config(kind, tokenizer, num_layers), out_dir, tokenizer
    )


def family_dirs(root: str) -> dict[str, str]:
    """Build (once per root) the tokenizer and every family model; returns kind -> directory."""
    from tests.utils import tiny_models

    return tiny_models.build_dirs(root, FAMILIES, build_family)


# HF name (after "model.layers.N.") -> llama.cpp tensor name.
_GGUF_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.qkv_proj": "attn_qkv",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.gate_up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
GGUF_ARCH = {
    "mistral": "llama",
    "llama3": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "phi3": "phi3",
}


def _llama_cpp_permute(weight: Any, n_head: int) -> Any:
    """llama.cpp's Q/K row order for llama files (gguf_loader undoes it)."""
    return (
        weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def gguf_tokenizer_fields(path: str) -> dict[str, Any]:
    """The tokenizer.* metadata of a GGUF file (SmolLM2's: a gpt2-style BPE), as Python values
    (a copy of the values read once per file and test session)."""
    return {
        k: list(v) if isinstance(v, list) else v for k, v in _read_tokenizer_fields(path).items()
    }


@functools.lru_cache(maxsize=2)
def _read_tokenizer_fields(path: str) -> dict[str, Any]:
    # gguf-py parses each of the ~49k tokens and ~49k merges into an array of its own: tens of
    # seconds on a busy 2-core machine, for a file that does not change during the session.
    import gguf

    reader = gguf.GGUFReader(path)
    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer.ggml."):
            continue
        values = [field.parts[i] for i in field.data]
        if field.types[-1] == gguf.GGUFValueType.STRING:
            items: list[Any] = [bytes(v).decode("utf-8") for v in values]
        else:
            items = [v.tolist()[0] for v in values]
        out[key] = items if field.types[0] == gguf.GGUFValueType.ARRAY else items[0]
    return out


def _write_tokenizer(writer: Any, fields: dict[str, Any], chat_template: str) -> None:
    t = "tokenizer.ggml."
    writer.add_tokenizer_model(fields[t + "model"])
    writer.add_tokenizer_pre(fields[t + "pre"])
    writer.add_token_list(fields[t + "tokens"])
    writer.add_token_types(fields[t + "token_type"])
    writer.add_token_merges(fields[t + "merges"])
    writer.add_unk_token_id(fields[t + "unknown_token_id"])
    writer.add_pad_token_id(fields[t + "padding_token_id"])
    writer.add_add_bos_token(fields[t + "add_bos_token"])
    writer.add_chat_template(chat_template)


def write_gguf(
    model_dir: str,
    out_path: str,
    kind: str,
    tokenizer_fields: dict[str, Any] | None = None,
    quantize: Any = None,
) -> str:
    """Write a saved tiny family model as an F32 GGUF file the way llama.cpp's converter
    names it (llama for Mistral, with permuted Q/K rows; Phi-3's longrope factors as tensors).
    With `tokenizer_fields` (`gguf_tokenizer_fields`) the file also holds the tokenizer and
    the family's chat template; else pass the HF directory as `tokenizer`. `quantize(gguf
    name, float array)` may return (block bytes [rows, row bytes] uint8, ggml type id) to
    store a tensor quantized, or None to keep it F32."""
    import gguf
    from safetensors.torch import load_file
    from transformers import AutoConfig

    arch = GGUF_ARCH[kind]
    cfg = AutoConfig.from_pretrained(model_dir)
    state = load_file(os.path.join(model_dir, "model.safetensors"))
    writer = gguf.GGUFWriter(out_path, arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)
    if tokenizer_fields is not None:
        _write_tokenizer(writer, tokenizer_fields, CHAT_TEMPLATES[kind])
    rope = cfg.rope_parameters
    writer.add_rope_freq_base(rope["rope_theta"])
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if arch in ("llama", "phi3"):
        writer.add_rope_dimension_count(head_dim)
    if arch == "qwen3":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if rope["rope_type"] == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if arch == "phi3":
        writer.add_rope_scaling_orig_ctx_len(cfg.original_max_position_embeddings)
        writer.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], np.float32))
        writer.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], np.float32))
    globals_ = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }

    def add(gguf_name: str, array: Any) -> None:
        blocks = quantize(gguf_name, array) if quantize is not None else None
        if blocks is None:
            writer.add_tensor(gguf_name, array)
        else:
            writer.add_tensor(gguf_name, blocks[0], raw_dtype=gguf.GGMLQuantizationType(blocks[1]))

    for name, tensor in state.items():
        array = tensor.float().numpy()
        if name in globals_:
            add(globals_[name], array)
            continue
        _, _, layer, rest = name.split(".", 3)
        module, kind_ = rest.rsplit(".", 1)
        if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
            heads = cfg.num_attention_heads if "q_proj" in module else cfg.num_key_value_heads
            array = _llama_cpp_permute(array, heads)
        add(f"blk.{layer}.{_GGUF_LAYER_NAMES[module]}.{kind_}", array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path


def quantize_as_shipped(gguf_name: str, array: Any) -> tuple[Any, int] | None:
    """A `write_gguf` quantizer storing a model the way the bundled SmolLM2 GGUF is: the
    decoder layers' matrices Q4_1, the other matrices (embedding, lm_head) Q8_0, vectors F32."""
    import gguf

    if array.ndim != 2:
        return None
    qtype = gguf.GGMLQuantizationType.Q8_0
    if gguf_name.startswith("blk."):
        qtype = gguf.GGMLQuantizationType.Q4_1
    return gguf.quants.quantize(array.astype(np.float32), qtype), int(qtype)
