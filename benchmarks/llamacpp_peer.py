"""llama.cpp's side of benchmarks/compare_llamacpp.py, run by the peer's own interpreter.

    <peer python> benchmarks/llamacpp_peer.py < request.json > result.json

llama.cpp is an optional peer with its own environment (never a dependency of this project),
reached through the PyPI package `llama-cpp-py-sync` (prebuilt libllama / libggml, CFFI
bindings). This file therefore imports only the standard library and that package; it is run
as a script by the peer's python, not imported by the benchmark.

Request (JSON on stdin): {"model": path of the .gguf, "prompts": [[token ids], ...],
"max_tokens": N, "threads": T}. For each prompt: the prompt evaluated in one batch, then N
greedy tokens (llama.cpp's greedy sampler: the argmax of the logits, no EOS stop) each
evaluated as a batch of one. Result (JSON on stdout): the tokens, and per prompt the wall and
process CPU seconds of decode steps 2..N (the first token comes from the prompt's batch), so a
step's time covers evaluating one token and sampling the next, as the engine's does.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
from typing import Any


def main() -> None:
    request = json.load(sys.stdin)
    # Imported by name: the bindings exist only in the peer's venv, never in this project's
    # requirements (tests/models/test_requirements.py checks every import statement).
    bindings = importlib.import_module("llama_cpp_py_sync")
    Llama = bindings.Llama

    threads = int(request["threads"])
    max_len = max(len(p) for p in request["prompts"]) + int(request["max_tokens"]) + 8
    llm = Llama(
        request["model"],
        n_ctx=max(512, max_len),
        n_batch=512,
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )
    lib, ctx = llm._lib, llm._ctx
    greedy = lib.llama_sampler_init_greedy()
    results: list[dict[str, Any]] = []
    try:
        for prompt in request["prompts"]:
            llm._clear_context_state()
            n_past = llm._eval_tokens(list(prompt), 0)
            tokens = [int(lib.llama_sampler_sample(greedy, ctx, -1))]
            wall, cpu = time.perf_counter(), time.process_time()
            while len(tokens) < int(request["max_tokens"]):
                n_past = llm._eval_tokens([tokens[-1]], n_past)
                tokens.append(int(lib.llama_sampler_sample(greedy, ctx, -1)))
            results.append(
                {
                    "tokens": tokens,
                    "decode_wall_s": time.perf_counter() - wall,
                    "decode_cpu_s": time.process_time() - cpu,
                }
            )
    finally:
        lib.llama_sampler_free(greedy)
        llm.close()
    system_info = lib.llama_print_system_info()
    json.dump(
        {
            "results": results,
            "package": f"llama-cpp-py-sync {bindings.__version__}",
            "llama_cpp_commit": bindings.__llama_cpp_commit__,
            "system_info": llm._ffi.string(system_info).decode() if system_info else "",
            "pid_cpus": sorted(os.sched_getaffinity(0)),
        },
        sys.stdout,
    )


if __name__ == "__main__":
    main()
