"""Build one stage's model and load only the checkpoint tensors that stage owns.

Sources: HF directories (`*.safetensors` read tensor by tensor, or `pytorch_model*.bin`) and
GGUF files (dequantized by gguf_loader). Each stage reads ~1/N of the decoder weights; with
tensor parallelism each rank reads only its shard of each (the model's `weight_shard(name)`):
safetensors slices, mmap-ed .bin views, GGUF rows (or whole quantisation blocks of columns).
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import time
from collections.abc import Iterator, Sequence
from typing import Any, Callable

import torch
from torch import nn

from vllm.config import ModelConfig
from vllm.model_executor.layers.linear import linear_path, pack_linears
from vllm.model_executor.layers.quantization import gguf as gguf_quant
from vllm.model_executor.layers.rotary import serving_positions
from vllm.model_executor.models import get_model_class
from vllm.model_executor.models.utils import Shard, StageLayout

logger = logging.getLogger("vllm.model_executor.weight_utils")

WeightFilter = Callable[[str], bool]
# name -> this TP rank's part of the tensor (None: all of it; several: their parts joined).
ShardSpec = Shard | Sequence[Shard] | None
ShardFn = Callable[[str], ShardSpec]


def _no_shard(name: str) -> ShardSpec:
    return None


def read_sharded(spec: ShardSpec, read: Callable[[Shard], torch.Tensor]) -> torch.Tensor:
    """`read(shard)` for one shard; for several (one fused checkpoint tensor: this rank's q, k
    and v rows), their parts concatenated along their common dimension."""
    assert spec is not None
    if isinstance(spec, Shard):
        return read(spec)
    return torch.cat([read(shard) for shard in spec], dim=spec[0].dim)


_TORCH_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def get_torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a config dtype string ("float32", "bfloat16", "float16")."""
    return _TORCH_DTYPES[name]


def iter_safetensors(
    path: str, wanted: WeightFilter, shard_of: ShardFn = _no_shard
) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                if not wanted(name):
                    continue
                shard = shard_of(name)
                if shard is None:
                    yield name, f.get_tensor(name)
                    continue
                # get_slice reads only the shard's bytes from the file.
                part = f.get_slice(name)
                shape = part.get_shape()

                def read(one: Shard, part=part, shape=shape) -> torch.Tensor:
                    end = min(one.start + one.size, shape[one.dim])
                    index = [slice(None)] * len(shape)
                    index[one.dim] = slice(one.start, end)
                    return part[tuple(index)]

                yield name, read_sharded(shard, read)


def iter_torch_bin(
    path: str, wanted: WeightFilter, shard_of: ShardFn = _no_shard
) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(glob.glob(os.path.join(path, "pytorch_model*.bin")))
    for file in files:
        # mmap: untouched tensors (other stages' layers, other ranks' shards) are never read.
        state = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
        for name, tensor in state.items():
            if wanted(name):
                shard = shard_of(name)
                if shard is None:
                    yield name, tensor
                else:
                    yield name, read_sharded(shard, lambda one, t=tensor: one.narrow(t))
        del state


def iter_weights(
    model_config: ModelConfig, wanted: WeightFilter, shard_of: ShardFn = _no_shard
) -> Iterator[tuple[str, Any]]:
    """Checkpoint tensors (HF names) accepted by `wanted`, from whatever format the model uses,
    each cut to `shard_of(name)` (this TP rank's part) while reading. Under --quantization
    gguf, the linear layers' weights come as `GGUFBlocks`."""
    path = model_config.model
    if model_config.is_gguf:
        from vllm.model_executor.gguf_loader import iter_gguf_weights

        keep = model_config.quantization == "gguf"
        yield from iter_gguf_weights(path, wanted, shard_of, keep_quantized=keep)
        return
    if glob.glob(os.path.join(path, "*.safetensors")):
        yield from iter_safetensors(path, wanted, shard_of)
    elif glob.glob(os.path.join(path, "pytorch_model*.bin")):
        yield from iter_torch_bin(path, wanted, shard_of)
    else:
        raise ValueError(
            f"model {path!r} has no weights: expected *.safetensors or pytorch_model*.bin."
        )


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def load_stage_model(
    model_config: ModelConfig, layout: StageLayout, device: torch.device
) -> nn.Module:
    """Construct this stage's module in the engine dtype on `device` and load its weights."""
    start = time.perf_counter()
    model_cls = get_model_class(model_config.hf_config, model_config)
    dtype = get_torch_dtype(model_config.dtype)
    quantized = model_config.quantization == "gguf" and device.type == "cpu"
    with (
        _default_dtype(dtype),
        torch.device(device),
        gguf_quant.quantized_linears(quantized),
        serving_positions(model_config.max_model_len),
    ):
        model = model_cls(model_config.hf_config, layout)
    model.load_weights(iter_weights(model_config, model.owns_weight, model.weight_shard))
    model.eval()
    n_quant = 0
    if quantized:
        n_quant = gguf_quant.finalize_quantized(model, dtype)
        n_quant += quantize_vocab(model, model_config.model, dtype)
    # Counted before packing: packed weights are plain tensors, not parameters.
    quant_params, quant_bytes = gguf_quant.quantized_bytes(model)
    n_params = sum(p.numel() for p in model.parameters()) + quant_params
    model.num_params = n_params
    # Bytes of this rank's weights (tied tensors once): what TP x PP divides.
    model.weight_bytes = quant_bytes + sum(p.numel() * p.element_size() for p in model.parameters())
    packed, path = linear_path(device, dtype)
    if packed:
        pack_linears(model)
    if n_quant:
        path = f"GGUF blocks ({n_quant} layers; the rest: {path})"
    model.linear_path = path
    logger.info(
        "Loaded layers [%d, %d) (%.1fM params, %s) in %.2f s; linear layers: %s",
        layout.start_layer,
        layout.end_layer,
        n_params / 1e6,
        model_config.dtype,
        time.perf_counter() - start,
        path,
    )
    return model


def quantize_vocab(model: nn.Module, path: str, dtype: torch.dtype) -> int:
    """Give the lm_head and the embedding (this stage's, this rank's vocabulary shard) the
    file's blocks when the kernel runs their type (Q8_0 in most GGUFs): the lm_head multiplies
    with them, the embedding dequantizes the rows it looks up. A tied pair shares one copy.
    Returns how many of the two were quantized."""
    from vllm.model_executor.gguf_loader import read_gguf_blocks
    from vllm.model_executor.layers.quantization.gguf import (
        GGUFBlocks,
        GGUFWeight,
        kernel_runs,
        repack_gguf_rows,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        VocabParallelEmbedding,
    )

    tied = bool(getattr(model, "tie_word_embeddings", False))
    cache: dict[str, GGUFBlocks | None] = {}

    def blocks(name: str, rows: int) -> GGUFBlocks | None:
        if name not in cache:
            found = read_gguf_blocks(path, name, model.weight_shard(name))
            if found is not None and kernel_runs(found.qtype, dtype):
                pad = rows - found.raw.shape[0]  # the last TP shard's padding rows: zero bytes
                raw = torch.cat([found.raw, found.raw.new_zeros(pad, found.raw.shape[1])])
                found = GGUFBlocks(raw if pad else found.raw, found.qtype, (rows, found.shape[1]))
            else:
                found = None
            cache[name] = found
        return cache[name]

    count = 0
    packed_cache: dict[str, torch.Tensor] = {}  # a tied pair shares one tensor
    for module in model.modules():
        if isinstance(module, ParallelLMHead):
            name = "model.embed_tokens.weight" if tied else "lm_head.weight"
        elif type(module) is VocabParallelEmbedding:  # not Gemma's (it scales the weight)
            name = "model.embed_tokens.weight"
        else:
            continue
        rows, cols = module.weight.shape
        found = blocks(name, rows)
        if found is None or found.shape[1] != cols:
            continue
        del module.weight
        packed = packed_cache.get(name)
        if packed is None:
            packed = packed_cache[name] = repack_gguf_rows(found.raw, found.qtype)
        module.quant = GGUFWeight([(found.qtype, packed)], cols, dtype)
        count += 1
    return count
