"""Helpers shared by run.py, masstest.py and the benchmarks: prompts, tokenizer, timing, JSON.

Importable as `benchmarks.common` from the repository root, where the benchmarks run as
`python -m benchmarks.<name>`.
"""

from __future__ import annotations

import json
import os
import platform
import random
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
PROMPTS_FILE = REPO_ROOT / "benchmarks" / "prompts.txt"


def load_prompts(path: str | None = None) -> list[str]:
    """One prompt per non-empty line; a literal backslash-n inside a line is a newline (so code
    prompts stay on one line of the file)."""
    text = Path(path or PROMPTS_FILE).read_text(encoding="utf-8")
    return [line.strip().replace("\\n", "\n") for line in text.splitlines() if line.strip()]


def take_prompts(prompts: list[str], n: int, seed: int = 0) -> list[str]:
    """`n` prompts: the file's own first, then distinct synthesised ones (two prompts joined
    with a connective) so a large stress run does not just repeat the file."""
    if n <= len(prompts):
        return list(prompts[:n])
    rng = random.Random(seed)
    joiners = (" Then, ", " Also: ", " After that, answer this: ", "\n\n")
    out = list(prompts)
    while len(out) < n:
        first, second = rng.sample(prompts, 2)
        out.append(first + rng.choice(joiners) + second)
    return out


def synthetic_word_prompts(
    n: int, min_words: int = 8, max_words: int = 200, seed: int = 0
) -> list[str]:
    """`n` prompts of `min_words`..`max_words` words cut from the prompts file at random
    offsets: real text (so tokenisation is realistic) with widely varying lengths."""
    words = " ".join(load_prompts()).split()
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(min_words, max_words)
        start = rng.randrange(0, len(words))
        # Wrap around the corpus end so every length is reachable from every offset.
        out.append(" ".join(words[(start + i) % len(words)] for i in range(length)))
    return out


def synthetic_token_prompts(tokenizer: Any, n: int, length: int, seed: int = 0) -> list[list[int]]:
    """`n` prompts of exactly `length` token ids, slices of the tokenised prompts file."""
    ids = tokenizer.encode(" ".join(load_prompts()), add_special_tokens=False)
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        start = rng.randrange(0, len(ids))
        out.append([ids[(start + i) % len(ids)] for i in range(length)])
    return out


def random_token_ids(length: int, seed: int) -> list[int]:
    """`length` random token ids from the middle of a ~49k vocabulary (SmolLM2's), the same
    for a seed: a prompt of an exact length; other seeds give other ids, so prefix caching
    finds nothing to share between them."""
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(length)]


def resolve(model: str, dtype: str = "auto") -> Any:
    """The engine's own ModelConfig for `model`: resolved path, GGUF or not, dtype."""
    from vllm.config import ModelConfig

    return ModelConfig(model=model, dtype=dtype)


def load_tokenizer(model: str) -> Any:
    """The tokenizer the engine would load for `model` (GGUF-built or from the HF directory)."""
    config = resolve(model)
    if config.is_gguf:
        from vllm.transformers_utils.gguf_config import load_gguf_tokenizer

        return load_gguf_tokenizer(config.model)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(config.tokenizer)


@contextmanager
def timer(result: dict[str, float], key: str = "seconds") -> Iterator[None]:
    """Stores the wall time of the block in `result[key]` (perf_counter: monotonic)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        result[key] = time.perf_counter() - start


@contextmanager
def env_var(name: str, value: str | None) -> Iterator[None]:
    """Set (or, with None, leave alone) an environment variable for the block only."""
    saved = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved


def environment() -> dict[str, Any]:
    """Context recorded with every result: the machine is shared, so its load matters."""
    import torch

    return {
        "argv": sys.argv,
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        "host": socket.gethostname(),
        "cpu_count": os.cpu_count(),
        "load_avg_1_5_15": list(os.getloadavg()),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads_driver": torch.get_num_threads(),
        "VLLM_CPU_THREADS_PER_STAGE": os.environ.get("VLLM_CPU_THREADS_PER_STAGE"),
    }


def write_json(path: str | None, data: dict[str, Any]) -> None:
    """Write `data` plus the environment to `path` (no-op when path is None)."""
    if not path:
        return
    payload = {**data, "environment": environment()}
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=2, default=str)
    print(f"Wrote {path}")


def fmt_bytes(num: float) -> str:
    """1234567 -> '1.18 MiB'."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(num) < 1024 or unit == "GiB":
            return f"{num:.0f} {unit}" if unit == "B" else f"{num:.2f} {unit}"
        num /= 1024
    return f"{num:.2f} GiB"


def print_table(headers: list[str], rows: list[list[Any]]) -> None:
    """A plain aligned text table (no dependency on tabulate)."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for i, row in enumerate(cells):
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))
        if i == 0:
            print("  ".join("-" * w for w in widths))


def stage_layout(llm: Any) -> dict[str, Any]:
    """Blocks and per-rank placement of a built LLM, from the engine's stage report."""
    engine = llm.llm_engine
    infos = engine.get_stage_infos()
    keys = (
        "pp_rank",
        "tp_rank",
        "layers",
        "host",
        "pid",
        "device",
        "threads",
        "num_params",
        "weight_bytes",
    )
    return {
        "num_gpu_blocks": engine.cache_config.num_gpu_blocks,
        "num_cpu_blocks": engine.cache_config.num_cpu_blocks,
        "block_size": engine.cache_config.block_size,
        "stages": [{k: getattr(info, k) for k in keys} for info in infos],
    }


def print_stage_layout(layout: dict[str, Any]) -> None:
    """The summary table: one row per rank (pipeline stage x TP rank) with its weights, then
    the block counts."""
    stages = layout["stages"]
    total = sum(s.get("weight_bytes") or 0 for s in stages)
    rows = []
    for s in stages:
        weights = s.get("weight_bytes") or 0
        share = f"{fmt_bytes(weights)} ({weights / total:.0%})" if total else "-"
        rows.append(
            [
                s["pp_rank"],
                s.get("tp_rank", 0),
                f"[{s['layers'][0]}, {s['layers'][1]})",
                share,
                s["host"],
                s["pid"],
                s["device"],
                s["threads"],
            ]
        )
    print_table(
        ["stage", "TP", "layers", "weights (share)", "host", "pid", "device", "threads"], rows
    )
    print(
        f"# GPU blocks: {layout['num_gpu_blocks']}, # CPU blocks: {layout['num_cpu_blocks']} "
        f"(block size {layout['block_size']})"
    )


def stage_peak_memory(llm: Any) -> list[int]:
    """Peak RSS in bytes of each stage's process, in rank order (PP=1: the driver itself)."""
    return [int(m.get("peak_rss_bytes", 0)) for m in llm.llm_engine.executor.get_stage_memory()]
