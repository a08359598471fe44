"""Our C++ kernels (torch.ops.vllm_pp.*) release the GIL while they run, as torch's own ops
do: a stage's heartbeat thread keeps answering during a long step. One kernel call here runs
for a good fraction of a second while another thread ticks every 5 ms; a kernel that held the
GIL would leave a gap as long as the call."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from vllm import _custom_ops as ops

pytestmark = pytest.mark.skipif(not ops.is_available(), reason="vllm._C not built")

MIN_CALL_S = 0.15


def _worst_gap_during(call, repeats: int = 3) -> tuple[float, float]:
    """(the longest single call, the longest gap between another thread's 5 ms ticks)."""
    gaps: list[float] = []
    stop = threading.Event()

    def tick() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            time.sleep(0.005)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    thread = threading.Thread(target=tick, daemon=True)
    thread.start()
    time.sleep(0.05)
    longest = 0.0
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        longest = max(longest, time.perf_counter() - started)
    stop.set()
    thread.join()
    return longest, max(gaps)


@pytest.mark.parametrize("kernel", ["rms_norm", "silu_and_mul"])
def test_a_long_kernel_call_leaves_other_threads_running(kernel):
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one long call, as a stage with one thread runs it
    try:
        # A quiet fast machine runs the base size in ~20-70 ms: grow the rows until one warm
        # call lasts MIN_CALL_S, so the held-GIL gap it would leave stands far above tick
        # jitter. (CI once stopped at the base size on a cold call of 0.2 s, then ran 21 ms.)
        rows = 4096
        while True:
            if kernel == "rms_norm":
                x, w = torch.randn(2 * rows, 4096), torch.randn(4096)
                call = lambda x=x, w=w: ops.rms_norm(x, w, 1e-6)  # noqa: E731
            else:
                x = torch.randn(rows, 2 * 8192)
                call = lambda x=x: ops.silu_and_mul(x)  # noqa: E731
            call()  # the first call pays page faults and lazy set-up: time a warm one
            started = time.perf_counter()
            call()
            if time.perf_counter() - started >= MIN_CALL_S or rows >= 8 * 4096:
                break
            rows *= 2
        longest, worst_gap = _worst_gap_during(call)
    finally:
        torch.set_num_threads(threads)
    print(f"{kernel}: longest call {longest * 1e3:.0f} ms, worst tick gap {worst_gap * 1e3:.0f} ms")
    assert longest > 0.08, "the call is too short to tell"
    # Held, the GIL would stall the ticker for a whole call.
    assert worst_gap < 0.8 * longest
