"""The matmul roofline of a model on this machine: its own GEMM shapes, timed with the same
linear path the engine uses (oneDNN-packed weights in fp32 on CPU, F.linear otherwise)."""

from __future__ import annotations

import time

import torch


def gemm_flops_per_s(
    shapes: list[tuple[int, int]], rows: int, dtype: torch.dtype, repeats: int = 15
) -> float:
    """FLOP/s of x[rows, in] @ W[out, in]^T over `shapes` (each with its own weight)."""
    from torch import nn

    from vllm.model_executor.layers.linear import PackedLinear, linear_path

    layers = []
    for out_f, in_f in shapes:
        linear = nn.Linear(in_f, out_f, bias=False, dtype=dtype)
        layers.append(
            PackedLinear(linear) if linear_path(torch.device("cpu"), dtype)[0] else linear
        )
    inputs = [torch.randn(rows, in_f, dtype=dtype) for _, in_f in shapes]
    flops = sum(2 * rows * out_f * in_f for out_f, in_f in shapes)
    with torch.inference_mode():
        for layer, x in zip(layers, inputs):
            layer(x)  # warm-up (oneDNN primitive creation)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            for layer, x in zip(layers, inputs):
                layer(x)
            best = min(best, time.perf_counter() - start)
    return flops / best


def model_gemm_roofline(model_config, rows: int, dtype: torch.dtype) -> tuple[float, float]:
    """(GEMM FLOP/s at `rows` rows for the whole model's shapes, GEMM FLOPs per token)."""
    layer, head = model_config.get_gemm_shapes()
    num_layers = model_config.get_num_layers()
    # Every layer's weights, so weights stream from memory as they do in the real model.
    shapes = layer * num_layers + [head]
    flops_per_token = 2 * sum(n * k for n, k in shapes)
    return gemm_flops_per_s(shapes, rows, dtype), flops_per_token
