"""Multiprocessing executor: one local process per rank, no Ray (vLLM's `mp` backend).

Each rank is a `spawn`-ed process running `_rank_main`: it reads calls from its end of a pipe,
runs them on its Worker and writes the results back, in order. The engine's side sends a step
to every rank without waiting (the pipes keep the order, like Ray's per-actor call order), so
several micro-batches can be inside the pipeline at once; one reader thread drains every
rank's results as they arrive, and `get_output` waits for the step it wants in short slices,
failing at once when any rank reports an error or its process dies (a StageFailedError
naming the rank, as on Ray). This backend does not replace failed ranks: the engine then stops
(EngineDeadError) and a new LLM must be built.

Ports come from the OS (`get_open_port`); shutdown asks every rank to stop, then terminates and
finally kills whatever is left, so no process outlives the engine. A rank also exits by itself
when the engine's process disappears (its pipe closes, or its parent changes).
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing
import os
import sys
import threading
import time
from multiprocessing.connection import Connection, wait
from typing import Any, Iterator, Optional

from vllm import envs
from vllm.executor.base import ExecutorBase
from vllm.executor.stage_supervisor import StageFailedError, StageFailure, describe_stage
from vllm.logger import init_logger
from vllm.sequence import ExecuteModelRequest, SamplerOutput

logger = init_logger("vllm.executor.mp_executor")

# Death of a rank is noticed within this many seconds, whatever the call's deadline.
_POLL_S = 0.5
_SHUTDOWN_GRACE_S = 10.0


@contextlib.contextmanager
def _main_module_hidden() -> Iterator[None]:
    """Start `spawn` children without re-running the user's main script in them.

    A spawned child normally imports the parent's __main__ first; a script without an
    `if __name__ == "__main__":` guard (README's example, most notebooks' exports) would then
    build a second LLM inside every rank process and fail. The ranks need nothing from
    __main__ (their target lives in this module), so the child is told there is none.
    """
    main = sys.modules.get("__main__")
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if main and k in main.__dict__}
    try:
        if main is not None:
            main.__dict__.pop("__file__", None)
            main.__spec__ = None
        yield
    finally:
        if main is not None:
            main.__dict__.pop("__spec__", None)
            main.__dict__.update(saved)


def _rank_main(conn: Connection, rank: int, num_threads: int) -> None:
    """Body of one rank's process: serve calls from the engine until told to stop."""
    import signal

    os.environ.setdefault("OMP_NUM_THREADS", str(num_threads))
    # One node: the rank is the local rank, i.e. this process's GPU (cuda:rank) on CUDA.
    os.environ["LOCAL_RANK"] = str(rank)
    # Ctrl-C reaches the whole process group; the engine's process decides what to do.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = os.getppid()

    def watch_parent() -> None:
        # A rank blocked inside a collective would otherwise outlive a killed engine.
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch_parent, daemon=True, name="parent-watch").start()
    import gc
    import traceback

    from vllm.logger import configure_logging

    configure_logging()
    worker: Any = None
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            break
        if msg is None:
            break
        call_id, method, args, kwargs = msg
        try:
            if method == "init_worker":
                from vllm.worker.worker import Worker

                worker = Worker(*args, **kwargs)
                result = os.getpid()
            else:
                result = getattr(worker, method)(*args, **kwargs)
                if method == "initialize_cache":
                    # As in the Ray actors: what exists now lives until exit; keep it out of
                    # the cyclic GC's full collections (pauses that would stall the pipeline).
                    gc.collect()
                    gc.freeze()
            reply = (call_id, True, result)
        except BaseException as exc:  # report everything; the engine decides
            reply = (call_id, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        try:
            conn.send(reply)
        except (BrokenPipeError, OSError):
            break
        if method == "shutdown":
            break
    conn.close()


class MultiprocessingExecutor(ExecutorBase):
    """Runs each rank (pipeline stage x TP rank) in its own local process."""

    def _init_workers(self) -> None:
        from vllm.model_executor.parallel_utils.parallel_state import (
            get_distributed_init_method,
            get_open_port,
        )

        pc = self.parallel_config
        world = pc.world_size
        use_gpu = self.device_config.device == "cuda"
        threads = envs.get_int("VLLM_CPU_THREADS_PER_STAGE") or 1
        if not use_gpu and world > (os.cpu_count() or 1):
            logger.warning(
                "%d ranks on %d CPU cores: ranks are oversubscribed", world, os.cpu_count() or 1
            )
        ctx = multiprocessing.get_context("spawn")
        self._ids = itertools.count()
        self._cond = threading.Condition()
        # rank -> call id -> (ok, value); filled by the reader thread.
        self._results: list[dict[int, tuple[bool, Any]]] = [{} for _ in range(world)]
        self._dead: dict[int, str] = {}
        tp = pc.tensor_parallel_size
        # Replaced by the ranks' own get_stage_info once they are up (ExecutorBase).
        self.stage_infos = [
            {"rank": r, "pp_rank": r // tp, "tp_rank": r % tp} for r in range(world)
        ]
        self._closing = False
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        for rank in range(world):
            parent_end, child_end = ctx.Pipe(duplex=True)
            proc = ctx.Process(
                target=_rank_main,
                args=(child_end, rank, threads),
                name=f"vllm-rank-{rank}",
                daemon=True,  # terminated by multiprocessing's exit hook if we never shut down
            )
            with _main_module_hidden():
                proc.start()
            child_end.close()
            self.conns.append(parent_end)
            self.procs.append(proc)
        self._reader = threading.Thread(target=self._read_loop, daemon=True, name="mp-results")
        self._reader.start()
        init_method = get_distributed_init_method("127.0.0.1", get_open_port())
        configs = (
            self.model_config,
            self.parallel_config,
            self.scheduler_config,
            self.device_config,
            self.cache_config,
        )
        ids = []
        for rank in range(world):
            kwargs = dict(
                rank=rank,
                distributed_init_method=init_method,
                num_threads=None if use_gpu else threads,
            )
            ids.append(self._send(rank, "init_worker", configs, kwargs))
        self._wait_all(ids)
        for rank, proc in enumerate(self.procs):
            self.stage_infos[rank]["pid"] = proc.pid
            logger.info("Rank %d: local process (pid %d)", rank, proc.pid)
        # Process-group rendezvous needs every rank at once: send all, then wait.
        self._run_workers("init_device")
        self._run_workers("load_model")
        self._in_flight: list[int] = []

    # ---- transport -------------------------------------------------------------------------

    def _read_loop(self) -> None:
        """Drain every rank's pipe; notice dead ranks (their process sentinel fires)."""
        conn_rank = {id(c): r for r, c in enumerate(self.conns)}
        sentinel_rank = {p.sentinel: r for r, p in enumerate(self.procs)}
        live_conns = list(self.conns)
        while not self._closing:
            watched = live_conns + [s for s, r in sentinel_rank.items() if r not in self._dead]
            if not watched:
                return
            try:
                ready = wait(watched, timeout=_POLL_S)
            except OSError:  # a connection closed by shutdown
                return
            for obj in ready:
                if isinstance(obj, int):
                    rank = sentinel_rank[obj]
                    # Results it wrote before dying are still in the pipe: read them first.
                    self._drain(rank, live_conns)
                    with self._cond:
                        code = self.procs[rank].exitcode
                        self._dead[rank] = f"exit code {code}"
                        self._cond.notify_all()
                    continue
                rank = conn_rank[id(obj)]
                if not self._recv_one(rank, obj):
                    live_conns.remove(obj)

    def _recv_one(self, rank: int, conn: Connection) -> bool:
        try:
            call_id, ok, value = conn.recv()
        except (EOFError, OSError):
            return False
        with self._cond:
            self._results[rank][call_id] = (ok, value)
            self._cond.notify_all()
        return True

    def _drain(self, rank: int, live_conns: list[Connection]) -> None:
        conn = self.conns[rank]
        while conn in live_conns:
            try:
                if not conn.poll(0):
                    return
            except (EOFError, OSError):
                return
            if not self._recv_one(rank, conn):
                live_conns.remove(conn)

    def _send(self, rank: int, method: str, args: Any, kwargs: Any) -> int:
        call_id = next(self._ids)
        self._send_id(rank, call_id, method, args, kwargs)
        return call_id

    def _send_id(self, rank: int, call_id: int, method: str, args: Any, kwargs: Any) -> None:
        if rank in self._dead:
            raise self._rank_error(rank, f"the process died ({self._dead[rank]})")
        try:
            self.conns[rank].send((call_id, method, args, kwargs))
        except (BrokenPipeError, OSError) as exc:
            raise self._rank_error(rank, f"its pipe is closed ({exc})") from None

    def _rank_error(self, rank: int, what: str) -> StageFailedError:
        """The engine's stage-failure error, naming the rank (stage, TP rank, layers, pid)."""
        info = dict(self.stage_infos[rank])
        info.setdefault("pid", self.procs[rank].pid if rank < len(self.procs) else None)
        name = f"{describe_stage(info)} tp_rank {info.get('tp_rank', 0)}"
        waited = time.monotonic() - getattr(self, "_wait_started", time.monotonic())
        return StageFailedError([StageFailure(rank, name, what)], waited)

    def _check_failures(self) -> None:
        """Raise for the first rank that reported an error or died (call under _cond)."""
        for rank, results in enumerate(self._results):
            for ok, value in results.values():
                if not ok:
                    raise self._rank_error(rank, value)
        if self._dead:
            rank = min(self._dead)
            raise self._rank_error(rank, f"the process died ({self._dead[rank]})")

    def _wait_for(self, rank: int, call_id: int, timeout: Optional[float] = None) -> Any:
        """Wait for one call's result, failing fast on any rank's error or death. `timeout`
        defaults to VLLM_MP_CALL_TIMEOUT (0: none)."""
        if timeout is None:
            timeout = envs.get_float("VLLM_MP_CALL_TIMEOUT")
        self._wait_started = time.monotonic()
        deadline = self._wait_started + timeout if timeout > 0 else None
        with self._cond:
            while True:
                entry = self._results[rank].get(call_id)
                if entry is not None and entry[0]:
                    del self._results[rank][call_id]
                    return entry[1]
                self._check_failures()
                if deadline is not None and time.monotonic() > deadline:
                    raise self._rank_error(rank, f"missed the {timeout:.0f} s deadline")
                self._cond.wait(_POLL_S)

    def _wait_all(self, call_ids: list[int]) -> list[Any]:
        return [self._wait_for(rank, cid) for rank, cid in enumerate(call_ids)]

    def _run_workers(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        call_id = next(self._ids)
        for rank in range(len(self.procs)):
            self._send_id(rank, call_id, method, args, kwargs)
        return self._wait_all([call_id] * len(self.procs))

    # ---- steps -----------------------------------------------------------------------------

    _stages_in_own_processes = True

    def execute_model_async(self, request: ExecuteModelRequest, num_tokens: int = 0) -> Any:
        # As on Ray; the last stage's TP driver returns the sampler output.
        call_id = next(self._ids)
        for rank, req in enumerate(self._requests_per_rank(request)):
            self._send_id(rank, call_id, "execute_model", (req,), {})
        self._in_flight.append(call_id)
        return call_id, self.parallel_config.step_deadline_s(num_tokens)

    def get_output(self, handle: Any) -> SamplerOutput:
        call_id, deadline_s = handle
        output = self._wait_for(self.output_rank, call_id, deadline_s)
        # The other ranks' results for this step (None), and outputs of discarded earlier
        # steps, are dropped; an error among them was raised above.
        with self._cond:
            for results in self._results:
                for cid in [c for c, (ok, _) in results.items() if ok and c <= call_id]:
                    del results[cid]
        self._in_flight = [c for c in self._in_flight if c > call_id]
        return output

    def discard_steps(self) -> None:
        """The engine will not collect the submitted steps: their outputs are dropped when a
        later step is collected; an error in them still fails the next wait."""
        self._in_flight = []

    # ---- shutdown --------------------------------------------------------------------------

    def shutdown(self, graceful: bool = True) -> None:
        procs: list[Any] = getattr(self, "procs", [])
        if not procs:
            return
        conns = self.conns
        call_id = next(self._ids)
        for rank, conn in enumerate(conns):
            if graceful and procs[rank].is_alive():
                try:
                    conn.send((call_id, "shutdown", (), {}))
                except (BrokenPipeError, OSError):
                    pass
        deadline = time.monotonic() + (_SHUTDOWN_GRACE_S if graceful else 0.0)
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in procs:
            if proc.is_alive():
                logger.warning("rank process %d did not stop; terminating it", proc.pid)
                proc.terminate()
                proc.join(2.0)
            if proc.is_alive():
                proc.kill()
                proc.join(2.0)
        self._closing = True
        for conn in conns:
            conn.close()
        reader: Optional[threading.Thread] = getattr(self, "_reader", None)
        if reader is not None and reader is not threading.current_thread():
            reader.join(2.0)
        self.procs = []
        self.conns = []
