"""Host memory on CPU: the KV cache on transparent huge pages, and glibc malloc kept from
handing memory back to the kernel.

Decode attention reads each sequence's blocks from anywhere in a multi-GiB cache. With 4 KiB
pages nearly every block costs a TLB miss (and in a VM a two-level page walk); with 2 MiB pages
a whole run of blocks shares one entry (paged attention ~20% faster late in a long decode;
figures in docs/PERFORMANCE.md, "Measurements behind design choices"). torch's allocator
would only use huge pages with THP_MEM_ALLOC_ENABLE=1 set before torch starts, for every
allocation, so the cache maps its own memory instead.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import math
import mmap
import platform

import torch

from vllm import envs
from vllm.utils import ceil_div

HUGE_PAGE = 2 << 20


def huge_page_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor on its own anonymous mapping, advised to use huge pages.

    The tensor starts on a 2 MiB boundary (the mapping has a huge page to spare for that), so
    under THP mode "madvise" (or "always") the kernel fills it with huge pages on first touch.
    Where MADV_HUGEPAGE does not exist (not Linux) it is plain memory. Pages are mapped on
    first write, like torch.empty's. The tensor keeps the mapping alive; it is unmapped when
    the tensor is freed."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    length = ceil_div(nbytes, HUGE_PAGE) * HUGE_PAGE + HUGE_PAGE
    buf = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            buf.madvise(advice)
        except OSError:  # THP compiled out or disabled: plain pages still work
            pass
    whole = torch.frombuffer(buf, dtype=torch.uint8)
    skip = -whole.data_ptr() % HUGE_PAGE
    return whole[skip : skip + nbytes].view(dtype).view(shape)


# glibc mallopt() parameters (malloc.h) and glibc's defaults for them.
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -2, -3, -4
_GLIBC_DEFAULTS = ((_M_MMAP_MAX, 65536), (_M_TRIM_THRESHOLD, 128 << 10), (_M_TOP_PAD, 0))
# The API server also pins the mmap threshold at glibc's initial 128 KiB: glibc otherwise raises
# it (up to 32 MiB) each time a big mapped block is freed, after which request-sized blocks come
# from the heap and may stay there.
_SERVER_SETTINGS = (*_GLIBC_DEFAULTS, (_M_MMAP_THRESHOLD, 128 << 10))
# Engines (workers) in this process that asked for the tuning and are still alive.
_tuned_users = 0
# Set by a process that serves requests (the API server): it keeps glibc's defaults even when
# a worker runs in it (PP=1), because its memory follows the clients, not the model.
_keep_defaults = False


def keep_malloc_defaults_in_this_process() -> None:
    """Never tune malloc in this process (the API server's; stage processes still tune).

    The tuning keeps every freed block (no mmap, no trim): right for a stage, whose
    allocations are the same activations step after step, but in the API process a 10 MB
    request body that was tokenized stayed mapped for good -- each /tokenize grew the
    server by ~0.5 GB. With PP=1 the worker runs in the API process and loses the tuning
    (prefill slower); with PP>1 (ray or mp) the stages keep it.
    An engine already running in this process (tuned before the call) is put back on
    glibc's defaults too: the settings are per process, not per engine. The mmap threshold is
    pinned (see _SERVER_SETTINGS), so a freed request-sized block is always unmapped."""
    global _keep_defaults
    _keep_defaults = True
    libc = _libc()
    if libc is not None:
        for param, value in _SERVER_SETTINGS:
            libc.mallopt(param, value)
        libc.malloc_trim(0)


def _libc() -> ctypes.CDLL | None:
    if platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def tune_malloc() -> bool:
    """Make glibc malloc keep and reuse freed memory instead of returning it to the kernel.

    By default glibc serves blocks over its mmap threshold (128 KiB to 32 MiB) with a fresh
    mapping and unmaps it on free, and trims the heap top; every forward then faults its big
    activations in again, page by page, and the kernel zeroes each page: kept, the page faults
    of a repeated batch almost vanish and prefill gets faster, for a little more peak memory
    (docs/PERFORMANCE.md, "Measurements behind design choices"). This is what vLLM's CPU
    guide gets from preloading tcmalloc, without the extra library.

    Applies to this process (the worker's; with PP=1 that is the caller's process, except in
    the API server: see keep_malloc_defaults_in_this_process). VLLM_CPU_MALLOC_TUNING=0
    leaves malloc alone. Returns whether the settings took effect
    (False off glibc)."""
    global _tuned_users
    libc = _libc()
    if not envs.get_bool("VLLM_CPU_MALLOC_TUNING") or libc is None or _keep_defaults:
        return False
    settings = (
        (_M_MMAP_MAX, 0),  # every block from the heap, so freed memory is reused
        (_M_TRIM_THRESHOLD, 2**31 - 1),  # never give the heap top back
        (_M_TOP_PAD, 64 << 20),  # grow the heap 64 MiB at a time
    )
    if all(libc.mallopt(param, value) == 1 for param, value in settings):
        _tuned_users += 1
        return True
    return False


def release_memory() -> None:
    """A worker shut down: give the memory it freed back to the kernel.

    Collects garbage (model and cache tensors held in cycles), puts malloc back to glibc's
    defaults once no live engine in this process wants the tuning, and trims every arena
    (`malloc_trim(0)` also returns free pages in the middle of the heap). Without this, a
    process that deleted its PP=1 `LLM` kept the freed weights mapped in the heap."""
    global _tuned_users
    gc.collect()
    libc = _libc()
    if libc is None:
        return
    if _tuned_users > 0:
        _tuned_users -= 1
        if _tuned_users == 0:
            for param, value in _GLIBC_DEFAULTS:
                libc.mallopt(param, value)
    libc.malloc_trim(0)
