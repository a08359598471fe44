"""A decode step's matmuls in each packed float32 layout, in one run: column panels (the C++
kernel of csrc/linear_panels.cpp), oneDNN's prepacked layout, and plain F.linear.

    python -m benchmarks.linear_layouts                        # 1, 4, 16, 32, 128, 512 rows
    python -m benchmarks.linear_layouts --rows 16 --threads 2

SmolLM2-135M's shapes (30 layers of qkv 576->960, o 576->576, gate_up 576->3072, down
1536->576, and the 49152-row lm_head): every layer gets its own random weights, 538 MB in all,
so they stream from memory as in a real step and no layout is helped by a warm cache. For each
row count the whole set is multiplied `--repeats` times per layout and the mean time of one
pass (one step's matmuls) is printed with GFLOP/s and the ratio to oneDNN. The outputs of the
layouts are checked against each other first (a wrong kernel would be fast for nothing).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from benchmarks.common import print_table, write_json

LAYERS = 30
# (out, in) of one decoder layer's matmuls, then the lm_head.
LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
HEAD = (49152, 576)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rows", type=str, default="1,4,16,32,128,512", help="row counts")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-plain", action="store_true", help="skip F.linear (slow at many rows)")
    p.add_argument("--output-json", type=str, default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch
    import torch.nn.functional as F

    from vllm.model_executor.layers.packed_weight import PackedWeight

    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    shapes = [s for _ in range(LAYERS) for s in LAYER_SHAPES] + [HEAD]
    raw = [torch.randn(n, k, generator=gen) * 0.05 for n, k in shapes]
    layouts: dict[str, list[Callable[[torch.Tensor], torch.Tensor]]] = {
        "panels": [PackedWeight(w, "panels") for w in raw],
        "onednn": [PackedWeight(w, "onednn") for w in raw],
    }
    if not args.no_plain:
        layouts["plain"] = [lambda x, w=w: F.linear(x, w) for w in raw]
    else:
        del raw
    # The layouts agree (layer 0's qkv and the lm_head at 7 rows).
    for index in (0, len(shapes) - 1):
        x = torch.randn(7, shapes[index][1], generator=gen)
        ref = layouts["onednn"][index](x)
        for mats in layouts.values():
            torch.testing.assert_close(mats[index](x), ref, rtol=0, atol=1e-3)
    flops_per_row = 2 * sum(n * k for n, k in shapes)
    weight_mb = 4 * sum(n * k for n, k in shapes) / 1e6
    rows_out = []
    for rows in [int(r) for r in args.rows.split(",")]:
        inputs = {k: torch.randn(rows, k, generator=gen) for k in {k for _, k in shapes}}
        times: dict[str, float] = {}
        for name, mats in layouts.items():

            def one_pass(
                mats: list[Callable[[torch.Tensor], torch.Tensor]] = mats,
                inputs: dict[int, torch.Tensor] = inputs,
            ) -> None:
                for (_, k), mat in zip(shapes, mats):
                    mat(inputs[k])

            one_pass()  # first touch
            start = time.perf_counter()
            for _ in range(args.repeats):
                one_pass()
            times[name] = (time.perf_counter() - start) / args.repeats
        for name, seconds in times.items():
            rows_out.append(
                {
                    "rows": rows,
                    "layout": name,
                    "ms_per_step": round(seconds * 1e3, 1),
                    "gflops": round(flops_per_row * rows / seconds / 1e9, 1),
                    "vs_onednn": round(times["onednn"] / seconds, 2),
                }
            )
    print(
        f"{weight_mb:.0f} MB of fp32 weights, {args.threads} thread(s), "
        f"mean of {args.repeats} passes"
    )
    print_table(
        ["rows", "layout", "ms / step", "GFLOP/s", "speed vs oneDNN"],
        [
            [r["rows"], r["layout"], r["ms_per_step"], r["gflops"], f"{r['vs_onednn']:.2f}x"]
            for r in rows_out
        ],
    )
    if args.output_json:
        write_json(args.output_json, {"threads": args.threads, "rows": rows_out})


if __name__ == "__main__":
    main()
