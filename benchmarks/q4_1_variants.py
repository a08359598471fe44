"""Ways to decode a Q4_1 block in the batch-1 fp32-activation GEMV, timed on this core.

    python -m benchmarks.q4_1_variants [--shapes 3072x576,576x576]

Compiles benchmarks/q4_1_variants.cpp (g++ -O3, AVX-512 target attribute; needs g++ and an
AVX-512 CPU) into a temporary directory and runs it once per shape: each variant's time per
32-weight block and row, hot (one copy of the weights, in L2/L3) and streamed (copies that
overflow the last-level cache), and whether it gives the production kernel's bits. All share
csrc/quant_gguf_avx512.cpp's arithmetic and order, so only the instruction mix differs: what
the kernel's lookup and unpacking cost, and how far below memory speed exact fp32 stays.
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_suffix(".cpp")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shapes", default="3072x576,576x576", help="N x K, comma-separated")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        binary = Path(tmp) / "q4_1_variants"
        subprocess.run(
            ["g++", "-O3", "-std=c++17", "-o", str(binary), str(SOURCE)], check=True, timeout=300
        )
        for shape in args.shapes.split(","):
            n, k = shape.lower().split("x")
            subprocess.run([str(binary), n, k], check=True, timeout=600)


if __name__ == "__main__":
    main()
