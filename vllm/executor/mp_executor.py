"""Multiprocessing executor: one local process per rank, no Ray (vLLM's `mp` backend).

Each rank is a `spawn`-ed process running `_rank_main`: it reads calls from its end of a pipe,
runs them on its Worker and writes the results back, in order; a thread of its own answers the
engine's heartbeats on a second pipe (`vllm.executor.supervisor`). The engine's side sends a step
to every rank without waiting (the pipes keep the order, like Ray's per-actor call order), so
several micro-batches can be inside the pipeline at once. The calls and their results go
through `rank_calls` (shared with the Ray backend): `get_output` fails at once when any rank
reports an error or its process dies (a StageFailedError naming the rank, as on Ray). A failed
rank is replaced as on Ray (`replace_stages`: a new process, the groups re-formed with the
survivors, which keep their weights), up to `max_stage_restarts` times; a stage that cannot be
replaced leaves the pipeline and comes back later (`vllm.executor.elastic`). A replacement
takes a warm spare when there is one: a process started ahead with torch and the Worker's
modules imported (`VLLM_PP_SPARE_PROCESSES`, 1 by default), so it skips the ~1.5 s a new
process spends importing; another spare is started once the recovery has caught up.

The ranks meet through a FileStore in a private directory (no port). Shutdown asks every rank
to stop, then terminates and finally kills whatever is left, so no process outlives the engine.
A rank also exits by itself when the engine's process disappears (its pipe closes, or its
parent changes).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Iterator

from vllm import envs
from vllm.distributed.pipeline_shape import PipelineShape
from vllm.distributed.rank_verbs import Verb
from vllm.executor.elastic import ElasticStageExecutor
from vllm.executor.rank_calls import Calls, RankCallError
from vllm.logger import init_logger
from vllm.resilience.errors import StageFailedError, StageFailure
from vllm.worker.rank_server import (
    WorkerHost,
    say_last_words,
    serve_calls,
    start_heartbeat_thread,
)
from vllm.worker.stage_report import StageInfo

logger = init_logger("vllm.executor.mp_executor")

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
    saved: dict[str, Any] = {
        k: main.__dict__[k] for k in ("__file__", "__spec__") if main and k in main.__dict__
    }
    try:
        if main is not None:
            main.__dict__.pop("__file__", None)
            main.__spec__ = None
        yield
    finally:
        if main is not None:
            main.__dict__.pop("__spec__", None)
            main.__dict__.update(saved)


def _rank_main(conn: Connection, heartbeat: Connection, rank: int | None, num_threads: int) -> None:
    """Body of one rank's process (`rank` None: a spare, given its rank by `init_worker`):
    answer heartbeats (on a thread, from the start) and serve calls from the engine until
    told to stop. An error outside any call is said to the engine (`say_last_words`) before
    the process dies of it."""
    try:
        _serve_rank(conn, heartbeat, rank, num_threads)
    except BaseException as exc:
        say_last_words(conn, exc)
        raise


def _serve_rank(
    conn: Connection, heartbeat: Connection, rank: int | None, num_threads: int
) -> None:
    import signal

    host = WorkerHost()
    start_heartbeat_thread(heartbeat, host.busy_s)
    os.environ.setdefault("OMP_NUM_THREADS", str(num_threads))
    if rank is not None:
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
                say_last_words(conn, RuntimeError(f"the engine's process (pid {parent}) is gone"))
                os._exit(1)

    threading.Thread(target=watch_parent, daemon=True, name="parent-watch").start()
    from vllm.logger import configure_logging

    configure_logging()
    # Imported before the first call (torch, the Worker, the model code: ~1.5 s), so a spare
    # is ready to become a rank at once.
    import vllm.worker.worker  # noqa: F401

    serve_calls(conn, host)


@dataclass
class _Process:
    """A started rank process and the engine's ends of its calls and heartbeat pipes."""

    proc: Any
    conn: Connection
    heartbeat: Connection

    def discard(self) -> None:
        """Close its pipes (it exits when its calls pipe closes) and make sure it is gone."""
        self.conn.close()
        self.heartbeat.close()
        self.proc.join(_SHUTDOWN_GRACE_S)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(2.0)


class MultiprocessingExecutor(ElasticStageExecutor):
    """Runs each rank (pipeline stage x TP rank) in its own local process."""

    def _init_workers(self) -> None:
        pc = self.parallel_config
        world = pc.world_size
        use_gpu = self.device_config.device == "cuda"
        threads = envs.get_int("VLLM_CPU_THREADS_PER_STAGE") or 1
        if not use_gpu and world > (os.cpu_count() or 1):
            logger.warning(
                "%d ranks on %d CPU cores: ranks are oversubscribed", world, os.cpu_count() or 1
            )
        tp = pc.tensor_parallel_size
        # Replaced by the ranks' own get_stage_info once they are up (ExecutorBase).
        self.stage_infos = [StageInfo(r, r // tp, r % tp) for r in range(world)]
        self._start_calls(world)
        self._threads = threads
        self.procs: list[Any] = [None] * world
        self.spares: list[_Process] = []
        for rank in range(world):
            self._spawn(rank)
        init_method = self._local_init_method()
        ranks = list(range(world))
        self._wait_calls(ranks, self._submit(self._init_worker_calls(ranks, init_method)))
        # Process-group rendezvous needs every rank at once: send all, then wait.
        self._run_workers(Verb.INIT_DEVICE)
        self._run_workers(Verb.LOAD_MODEL)
        self.refill_spares()

    def _start_process(self, rank: int | None) -> _Process:
        """Start a rank process (`rank` None: a spare)."""
        ctx = multiprocessing.get_context("spawn")
        parent_end, child_end = ctx.Pipe(duplex=True)
        beat_parent, beat_child = ctx.Pipe(duplex=True)
        proc = ctx.Process(
            target=_rank_main,
            args=(child_end, beat_child, rank, self._threads),
            name="vllm-rank-spare" if rank is None else f"vllm-rank-{rank}",
            daemon=True,  # terminated by multiprocessing's exit hook if we never shut down
        )
        with _main_module_hidden():
            proc.start()
        child_end.close()
        beat_child.close()
        return _Process(proc, parent_end, beat_parent)

    def _spawn(self, rank: int) -> None:
        """Give `rank` a process -- a warm spare when one is alive, else a new one -- and
        attach its pipes to the calls and the watch."""
        started = self._take_spare()
        kind = "warm spare process"
        if started is None:
            started, kind = self._start_process(rank), "local process"
        proc = started.proc
        self.calls.attach(rank, started.conn, process=proc)
        self.watch.attach(rank, started.heartbeat, proc.pid, socket.gethostname())
        self.procs[rank] = proc
        self.stage_infos[rank].pid = proc.pid
        logger.info("Rank %d: %s (pid %d)", rank, kind, proc.pid)

    def _take_spare(self) -> _Process | None:
        """A live spare, taken out of the pool (dead ones are discarded)."""
        while self.spares:
            spare = self.spares.pop(0)
            if spare.proc.is_alive():
                return spare
            logger.warning(
                "Spare rank process %d exited (exit code %s); not used",
                spare.proc.pid, spare.proc.exitcode,
            )  # fmt: skip
            spare.discard()
        return None

    def refill_spares(self) -> None:
        """Start spares up to VLLM_PP_SPARE_PROCESSES (none when stages are never replaced).
        The engine calls it once a recovery has caught up: a spare importing torch beside a
        replay or a re-prefill would slow it on a small machine."""
        wanted = self._spares_wanted()
        while len(self.spares) < wanted:
            spare = self._start_process(None)
            self.spares.append(spare)
            logger.debug("Spare rank process started (pid %d)", spare.proc.pid)

    def _init_worker_calls(
        self, ranks: list[int], init_method: str, shape: PipelineShape | None = None
    ) -> Calls:
        use_gpu = self.device_config.device == "cuda"
        kwargs = dict(
            distributed_init_method=init_method,
            num_threads=None if use_gpu else self._threads,
            shape=shape or self.shape,
        )
        # local_rank: a spare learns its device here (one node: the rank is the local rank).
        return {
            rank: (
                Verb.INIT_WORKER,
                (self.engine_config,),
                dict(kwargs, rank=rank, local_rank=rank),
            )
            for rank in ranks
        }

    # ---- recovery --------------------------------------------------------------------------

    def replace_stages(self, ranks: list[int]) -> float:
        """Kill the failed ranks' processes, spawn new ones, re-form the process groups with
        the survivors (who keep their weights), load the new ranks' layers and give them
        caches of the engine's size. Returns the seconds it took. The engine recomputes its
        requests, so no KV from before the failure is read."""
        started = time.monotonic()
        budget = envs.get_float("VLLM_PP_STAGE_RESTART_TIMEOUT_S")
        # Re-forming the groups is set-up: heartbeat silences count again once it is over
        # (dead or stopped processes are still found at once).
        self.watch.arm(armed=False)
        self._stop_ranks(ranks)
        # The survivors still run (and fail) the steps sent before the failure, before they
        # rejoin: nobody wants those results or errors.
        self.calls.forget()
        survivors = [r for r in range(len(self.procs)) if r not in ranks]
        for rank in ranks:
            self._spawn(rank)
        init_method = self._local_init_method()
        self._wait_calls(ranks, self._submit(self._init_worker_calls(ranks, init_method)), budget)
        # Process-group rendezvous needs every rank at once: send all, then wait.
        calls: dict[int, tuple[Verb, tuple, dict]] = {r: (Verb.INIT_DEVICE, (), {}) for r in ranks}
        calls.update({r: (Verb.REJOIN_PROCESS_GROUPS, (init_method,), {}) for r in survivors})
        self._wait_calls(list(calls), self._submit(calls), budget)
        self._load_replacements(ranks, budget)
        return time.monotonic() - started

    # ---- an elastic pipeline (vllm.executor.elastic) -----------------------------------------

    def _stop_ranks(self, ranks: list[int]) -> None:
        for rank in ranks:
            proc = self.procs[rank]
            self.watch.detach(rank)
            self.calls.detach(rank)
            if proc is not None and proc.is_alive():
                proc.kill()  # a frozen (SIGSTOPped) process ignores anything milder
            if proc is not None:
                proc.join(10.0)
            self.procs[rank] = None

    def _start_processes(self, ranks: list[int], budget: float) -> None:
        for rank in ranks:
            self._spawn(rank)
        self.refill_spares()

    def _renumber_processes(self, order: list[int | None]) -> None:
        self.procs = [None if old is None else self.procs[old] for old in order]

    # ---- calls -----------------------------------------------------------------------------

    def _rank_error(self, err: RankCallError, started: float) -> StageFailedError:
        """The engine's stage-failure error, naming the rank (stage, TP rank, layers, pid)."""
        info = self.stage_infos[err.rank]
        if info.pid is None and err.rank < len(self.procs) and self.procs[err.rank] is not None:
            info.pid = self.procs[err.rank].pid
        name = f"{info.describe()} tp_rank {info.tp_rank}"
        failure = StageFailure(err.rank, name, err.problem)
        # From the start of the rank's trouble when the supervisor found it, else the wait.
        since = started if err.since is None else err.since
        return StageFailedError([failure], time.monotonic() - since, err.call_id)

    @contextlib.contextmanager
    def _failures_named(self, timeout_problem: str) -> Iterator[None]:
        # A missed deadline names its rank too (the wait's own "missed the N s deadline").
        started = time.monotonic()
        try:
            yield
        except RankCallError as err:
            raise self._rank_error(err, started) from None

    def _call_timeout_s(self) -> float:
        return envs.get_float("VLLM_MP_CALL_TIMEOUT")

    # ---- shutdown --------------------------------------------------------------------------

    def _release_workers(self, graceful: bool) -> None:
        spares: list[_Process] = getattr(self, "spares", [])
        self.spares = []
        for spare in spares:
            spare.conn.close()
            spare.heartbeat.close()
            # A spare holds no state, and one still importing torch would notice its pipe
            # closing only seconds later: stopped at once rather than waited for.
            if spare.proc.is_alive():
                spare.proc.terminate()
        slots: list[Any] = getattr(self, "procs", [])
        # A slot is empty when its stage left the pipeline (or never started).
        procs = [proc for proc in slots if proc is not None]
        if not procs and not spares:
            return
        deadline = time.monotonic() + (_SHUTDOWN_GRACE_S if graceful else 0.0)
        if graceful:
            live = [rank for rank, proc in enumerate(slots) if proc is not None and proc.is_alive()]
            self.calls.forget()  # errors of earlier steps do not matter any more
            try:
                call_id = self.calls.broadcast(Verb.SHUTDOWN, live)
                self.calls.wait_all(live, call_id, max(deadline - time.monotonic(), 1e-3))
            except RankCallError as err:  # gone already, or stuck: terminated below
                if err.rank in live and not err.lost:
                    logger.warning("rank %d did not shut down cleanly: %s", err.rank, err.problem)
        # A rank leaves when its connection closes.
        self._close_calls()
        self._remove_rendezvous_dir()
        procs += [spare.proc for spare in spares]
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
        self.procs = []
