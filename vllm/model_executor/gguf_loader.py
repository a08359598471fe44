"""GGUF checkpoints (llama.cpp's format): the tensor data, as HF weights of the LLaMA-style
families (llama and Mistral, qwen2, qwen3, phi3) and of Gemma 2 / Gemma 3.

Tensor data is memory-mapped and only the tensors a caller wants are dequantized (with
`gguf.quants.dequantize`), so a pipeline stage reads its own layers only. Locating the file,
parsing its header, the config and the tokenizer live in the torch-free
`vllm.transformers_utils.gguf_config`.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Iterator
from typing import Any

import gguf
import numpy as np
import torch

from vllm.model_executor.layers.quantization.gguf import GGUFBlocks
from vllm.transformers_utils.gguf_config import TensorInfo, gguf_config_dict, read_header

logger = logging.getLogger("vllm.gguf_loader")

# HF names of the linear layers' weights: kept as blocks under --quantization gguf.
_LINEAR_WEIGHT = re.compile(r"\.(self_attn|mlp)\.[a-z_]*proj\.weight$")

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
    "attn_q_norm": "self_attn.q_norm",  # qwen3
    "attn_k_norm": "self_attn.k_norm",
    "attn_qkv": "self_attn.qkv_proj",  # phi3: fused, as in its HF checkpoint
}
# Gemma's four norms per layer: llama.cpp's ffn_norm is the pre-feed-forward norm there.
_GEMMA_LAYER_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# phi3 keeps gate and up fused under ffn_up, as its HF checkpoint does.
_ARCH_LAYER_NAMES = {
    "phi3": {"ffn_up": "mlp.gate_up_proj"},
    "gemma2": _GEMMA_LAYER_NAMES,
    "gemma3": _GEMMA_LAYER_NAMES,
}
# Architectures whose RMSNorm computes x * (1 + w): llama.cpp's converter stores 1 + w (its
# Gemma2Model/Gemma3Model add 1 to every *norm.weight), HF holds w, so 1 is taken off again.
_NORM_PLUS_ONE = frozenset({"gemma2", "gemma3"})


def _hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """HF name of a GGUF tensor, or None for tensors HF has no parameter for."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    names = {**_LAYER_NAMES, **_ARCH_LAYER_NAMES.get(arch, {})}
    if (
        len(parts) == 4
        and parts[0] == "blk"
        and parts[3] in ("weight", "bias")
        and parts[2] in names
    ):
        return f"model.layers.{parts[1]}.{names[parts[2]]}.{parts[3]}"
    # e.g. rope_freqs.weight, rope_factors_*: the rope is computed from the config.
    return None


def _unpermute(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (it pairs each head's rotary halves for its rope)."""
    rows = weight.shape[0]
    per_head = weight.reshape(n_head, rows // n_head // 2, 2, *weight.shape[1:])
    return per_head.transpose(1, 2).reshape(weight.shape).contiguous()


def _read_rows(
    blob: np.memmap, info: TensorInfo, shard: Any = None
) -> tuple[np.ndarray, list[int], Any]:
    """The raw bytes [rows, row_bytes] of one tensor, or of one TP shard of it
    (`models.utils.Shard`: rows of a 2-D tensor, dim 0, or columns, dim 1), with the shape they
    stand for and what is left of the shard to cut after dequantizing (None when the bytes are
    exactly the shard). Only the bytes needed are read from the mapped file: a row shard reads
    its rows; a column shard reads the quantisation blocks it covers in each row (when its
    edges fall on block boundaries; else the whole rows, to be cut once dequantized)."""
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
        raw = raw[
            :,
            shard.start // block * block_bytes : (shard.start + shard.size) // block * block_bytes,
        ]
        shape[-1] = shard.size
        shard = None
    return raw, shape, shard


def _dequantize(blob: np.memmap, info: TensorInfo, shard: Any = None) -> torch.Tensor:
    """Float32 copy of one tensor, or of one TP shard of it (see `_read_rows`)."""
    raw, shape, shard = _read_rows(blob, info, shard)
    qtype = gguf.GGMLQuantizationType(info.ggml_type)
    values = gguf.quants.dequantize(np.ascontiguousarray(raw), qtype)
    if not values.flags.writeable or values.dtype != np.float32:
        values = values.astype(np.float32)  # F32 tensors come back as views of the read-only map
    tensor = torch.from_numpy(values).reshape(shape)
    return tensor if shard is None else shard.narrow(tensor).contiguous()


# Types that are not block-quantized: always loaded as dense tensors.
_DENSE_TYPES = frozenset(
    {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16}
)


def _blocks(blob: np.memmap, info: TensorInfo, shard: Any = None) -> GGUFBlocks | None:
    """One 2-D quantized tensor (or this rank's shard of it) as its raw blocks, copied out of
    the map; None when it is not block-quantized or the shard does not fall on whole blocks."""
    if info.ggml_type in _DENSE_TYPES or len(info.shape) != 2:
        return None
    raw, shape, rest = _read_rows(blob, info, shard)
    if rest is not None:
        return None
    tensor = torch.from_numpy(np.array(raw, dtype=np.uint8, copy=True))
    return GGUFBlocks(tensor, int(info.ggml_type), (shape[0], shape[1]))


def _kept_blocks(blob: np.memmap, info: TensorInfo, shard: Any) -> GGUFBlocks | None:
    """`_blocks` for a shard spec; several row shards (a fused tensor's parts) are joined."""
    if not isinstance(shard, (list, tuple)):
        return _blocks(blob, info, shard)
    if any(one.dim != 0 for one in shard):
        return None
    parts = [_blocks(blob, info, one) for one in shard]
    kept = [p for p in parts if p is not None]
    if len(kept) != len(parts):
        return None
    raw = torch.cat([p.raw for p in kept])  # one tensor: one type
    return GGUFBlocks(raw, kept[0].qtype, (raw.shape[0], kept[0].shape[1]))


def read_gguf_blocks(path: str, hf_name: str, shard: Any = None) -> GGUFBlocks | None:
    """The raw blocks of one tensor by HF name (this TP rank's `shard` of rows), or None if
    the file has no such quantized tensor."""
    header = read_header(path)
    arch = header.metadata["general.architecture"]
    blob = np.memmap(path, dtype=np.uint8, mode="r")
    for info in header.tensors:
        if _hf_name(info.name, arch) == hf_name:
            return _blocks(blob, info, shard)
    return None


def iter_gguf_weights(
    path: str,
    wanted: Callable[[str], bool] | None = None,
    shard_of: Callable[[str], Any] | None = None,
    keep_quantized: bool = False,
) -> Iterator[tuple[str, torch.Tensor | GGUFBlocks]]:
    """Yield (HF name, float32 tensor [out, in]) for each tensor of a GGUF file.

    llama files' Q/K rows are un-permuted as transformers does (llama.cpp permutes them for
    llama only); Gemma norm weights lose the 1 llama.cpp adds; lm_head.weight appears only
    if the file has one (tied models have none). Tensors whose name `wanted` rejects are never
    read. With `shard_of` (a TP rank's part of each tensor), only that part is read and
    dequantized; Q/K row shards hold whole heads, and the un-permutation is per head, so it
    applies to them.

    With `keep_quantized` (--quantization gguf), the block-quantized weights of the linear
    layers come as `GGUFBlocks`, the file's bytes (rows un-permuted alike), unless a column
    shard cuts through blocks (a K-quant row-parallel shard not a multiple of 256 columns):
    that layer is dequantized at load, with a warning.
    """
    header = read_header(path)
    config = gguf_config_dict(header, path)
    arch = header.metadata["general.architecture"]
    n_head = config["num_attention_heads"]
    n_kv_head = config.get("num_key_value_heads", n_head)
    blob = np.memmap(path, dtype=np.uint8, mode="r")
    for info in header.tensors:
        name = _hf_name(info.name, arch)
        if name is None or (wanted is not None and not wanted(name)):
            continue
        shard = shard_of(name) if shard_of is not None else None
        tensor: torch.Tensor | GGUFBlocks | None = None
        if keep_quantized and _LINEAR_WEIGHT.search(name):
            tensor = _kept_blocks(blob, info, shard)
            if tensor is None and info.ggml_type not in _DENSE_TYPES and len(info.shape) == 2:
                # A TP column shard cutting through blocks (e.g. a K-quant's 256 weights):
                # this layer is dequantized at load rather than refused.
                block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(info.ggml_type)][0]
                logger.warning(
                    "%s (%s): this rank's shard %s does not hold whole %d-weight blocks; "
                    "dequantized at load.",
                    name,
                    gguf.GGMLQuantizationType(info.ggml_type).name,
                    shard,
                    block,
                )
        if tensor is None and isinstance(shard, (list, tuple)):  # parts of a fused tensor
            parts = [_dequantize(blob, info, one) for one in shard]
            tensor = torch.cat(parts, dim=shard[0].dim)
        elif tensor is None:
            tensor = _dequantize(blob, info, shard)
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = n_head if name.endswith("q_proj.weight") else n_kv_head
            head_rows = info.shape[0] // heads
            if isinstance(tensor, GGUFBlocks):  # whole rows move: the same permutation
                tensor.raw = _unpermute(tensor.raw, tensor.shape[0] // head_rows)
            else:
                tensor = _unpermute(tensor, tensor.shape[0] // head_rows)
        if arch in _NORM_PLUS_ONE and name.endswith("norm.weight"):
            assert isinstance(tensor, torch.Tensor)
            tensor = tensor - 1.0
        yield name, tensor
