"""A stage worker: device and distributed set-up, this stage's model, its KV cache sized from its
own layers and budget, and one step of execution (receive, run, send or sample)."""

from __future__ import annotations

import gc
import logging
import os
import socket
import time
from typing import Any, Callable

import torch

from vllm.config import EngineConfig, LoRAConfig, ParallelConfig
from vllm.distributed import net_utils as net
from vllm.distributed import parallel_state as ps
from vllm.distributed import tensor_parallel as tpu
from vllm.distributed.communication import recv_tensor_dict, send_tensor_dict
from vllm.distributed.pipeline_shape import PipelineShape
from vllm.distributed.rank_verbs import Verb
from vllm.distributed.serialization import message_bytes
from vllm.lora.request import LoRARequest
from vllm.lora.worker_manager import StageLoRAManager
from vllm.model_executor.models.utils import StageLayout
from vllm.model_executor.weight_utils import get_torch_dtype, load_stage_model
from vllm.sequence import SamplerOutput
from vllm.spec_decode.draft_runner import DraftRequest, DraftRunner
from vllm.step_records import BlockOps, ExecuteModelRequest
from vllm.worker.cache_engine import CacheEngine, layers_block_bytes
from vllm.worker.cpu_memory import release_memory, tune_malloc
from vllm.worker.model_runner import ModelRunner
from vllm.worker.profiler import StageProfiler
from vllm.worker.rank_recovery import RankRecovery
from vllm.worker.request_table import RequestTable, StepRows
from vllm.worker.sampled_ids import SampledIdChannel
from vllm.worker.stage_report import StageInfo, StageStats, StageTimers

logger = logging.getLogger("vllm.worker")


class Worker:
    """Runs one pipeline stage (one rank) of the model."""

    def __init__(
        self,
        engine_config: EngineConfig,
        rank: int = 0,
        distributed_init_method: str | None = None,
        num_threads: int | None = None,
        shape: PipelineShape | None = None,
    ) -> None:
        """The one way every executor builds a rank: the engine's configs, the rank, the
        rendezvous URL (world size > 1), the CPU threads (None: torch's default) and the
        pipeline it is a rank of (None: the configured one)."""
        self.engine_config = engine_config
        self.model_config = engine_config.model_config
        self.set_shape(shape or PipelineShape.configured(engine_config))
        self.scheduler_config = engine_config.scheduler_config
        self.device_config = engine_config.device_config
        self.cache_config = engine_config.cache_config
        self.rank = rank
        self.distributed_init_method = distributed_init_method
        self.num_threads = num_threads
        self.cache_engine: CacheEngine | None = None
        self._pending_send: Any = None
        # Replays of a stage-local rebuild, and layers taken over from a lost neighbour.
        self.recovery = RankRecovery(self)
        # First and last stage: the requests the step records told this stage (with their
        # seeded generators), and the channel of sampled ids from the last stage to the
        # first (asynchronous pipeline).
        self.request_table = RequestTable()
        self.sampled_ids = SampledIdChannel(rank, self.parallel_config)
        self.timers = StageTimers()
        # A draft model's rank: its draft sequences (built on the first proposal).
        self.draft_runner: DraftRunner | None = None

    def set_shape(self, shape: PipelineShape) -> None:
        """The pipeline this rank belongs to from now on (the executor's, sent with each call
        that changes it)."""
        self.shape = shape
        self._parallel_config = shape.parallel_config(self.engine_config.parallel_config)

    @property
    def parallel_config(self) -> ParallelConfig:
        """The parallel config as the pipeline runs now (size and split from `shape`)."""
        return self._parallel_config

    @property
    def busy_since(self) -> float | None:
        """perf_counter() when the step in progress started; None between steps (read by the
        rank's heartbeat thread, `rank_server.answer_heartbeats`)."""
        return self.timers.busy_since

    def init_device(self) -> None:
        """Pick the device, set CPU threads, join the process groups (world size > 1)."""
        if self.device_config.device == "cuda":
            local_rank = int(os.environ.get("LOCAL_RANK", "0"))
            self.device = torch.device(f"cuda:{local_rank}")
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
            if self.num_threads:
                torch.set_num_threads(self.num_threads)
            if tune_malloc():
                logger.debug("glibc malloc: heap only, never trimmed (VLLM_CPU_MALLOC_TUNING)")
        torch.manual_seed(self.model_config.seed)
        self._join_process_groups()
        pp_rank = ps.get_pipeline_model_parallel_rank()
        self.layout = self.stage_layout()
        self.timers = StageTimers(pp_rank)
        self.profiler = StageProfiler(self.device, self.rank)

    def stage_layout(self) -> StageLayout:
        """The layers this stage owns in the current `shape`."""
        start, end = self.shape.stage_layers(ps.get_pipeline_model_parallel_rank())
        return StageLayout(start, end, ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage())

    def _join_process_groups(self) -> None:
        pc, shape = self.parallel_config, self.shape
        if shape.world_size > 1:
            assert self.distributed_init_method is not None
            ps.init_distributed_environment(
                shape.world_size,
                self.rank,
                self.distributed_init_method,
                timeout_s=pc.comm_timeout_s(self.scheduler_config.max_num_batched_tokens),
                local_rank=self.device.index or 0,  # NCCL binds to this rank's own GPU
            )
            ps.initialize_model_parallel(shape.pipeline_parallel_size, shape.tensor_parallel_size)

    def rejoin_process_groups(
        self,
        distributed_init_method: str,
        rank: int | None = None,
        shape: PipelineShape | None = None,
    ) -> None:
        """A peer stage was replaced: leave the old process groups and join the new ones.

        This stage keeps its weights and cache tensors; the engine recomputes every request,
        so no KV written before the failure is read again. With `rank` and `shape` the
        pipeline changed size (a stage left or came back): this rank joins under its new
        number, and the engine follows with `reshape` or `merge_layers` (the layers of its
        new stage, a cache re-sized for them)."""
        # The previous send's peer may be gone: never wait on it.
        self._pending_send = None
        self.sampled_ids.reset()
        seeded = list(self.request_table.generators)
        self.request_table.clear()
        try:
            ps.destroy_model_parallel()
        except Exception as exc:  # a group with a dead peer may not close cleanly
            logger.warning("rank %d: leaving the old process groups: %s", self.rank, exc)
        self.distributed_init_method = distributed_init_method
        if rank is not None and shape is not None:
            pp = shape.pipeline_parallel_size
            if (rank, pp) != (self.rank, self.shape.pipeline_parallel_size):
                logger.info("rank %d: now rank %d of a %d-stage pipeline", self.rank, rank, pp)
            self.rank = rank
            self.set_shape(shape)
            # Peers (the last stage's driver, the first stage's ranks) follow the new size.
            self.sampled_ids = SampledIdChannel(rank, self.parallel_config)
        self._join_process_groups()
        self.model_runner.drop_requests(seeded)
        if shape is not None:
            self.timers = StageTimers(ps.get_pipeline_model_parallel_rank())
        self.timers.abort()

    def use_layers(self, layout: StageLayout, runner: ModelRunner) -> None:
        """This stage holds `layout` from now on, run by `runner` (layers taken over from a
        lost neighbour: `RankRecovery.merge_layers`)."""
        self.layout, self.model_runner = layout, runner
        self.timers.abort()

    def load_model(self) -> None:
        model = load_stage_model(self.model_config, self.layout, self.device)
        self.model_runner = ModelRunner(
            model, self.layout, self.cache_config.block_size, self.device, self.model_config
        )

    def reshape(self, shape: PipelineShape) -> tuple[int, int]:
        """Take the layers of this stage in `shape` (same stages, same groups): load
        them (reading only their tensors) unless the range is unchanged, drop the KV cache
        and return the blocks this stage can hold now, like `determine_num_available_blocks`
        (the engine then gives every stage the minimum through `initialize_cache`).

        The engine drained the pipeline and recomputes every request afterwards (the step
        after this one tells the stages to forget every request), so no KV is read again."""
        self.wait_for_send()  # the pipeline is drained: it has completed
        self.drop_pending_send()
        self.set_shape(shape)
        old, new = self.layout, self.stage_layout()
        self.cache_engine = None  # sized for the old layer count
        self.recovery.forget()
        # A stage keeping its layers keeps its runner: its structured-output matchers of the
        # held requests go (they are sent again in full).
        self.model_runner.drop_requests(self.request_table.request_ids())
        self.request_table.clear()
        if new != old:
            self.layout = new
            self.model_runner = None  # type: ignore[assignment]  # its memory reused first
            gc.collect()
            self.load_model()
            logger.info(
                "rank %d: layers [%d, %d) -> [%d, %d)",
                self.rank, old.start_layer, old.end_layer, new.start_layer, new.end_layer,
            )  # fmt: skip
        self.timers.abort()
        return self.determine_num_available_blocks()

    # -- LoRA adapters (the engine's registry, mirrored on every rank) ------------------------

    def _lora(self, lora_config: LoRAConfig | None = None) -> StageLoRAManager:
        runner = self.model_runner
        if runner.lora_manager is None:
            if lora_config is None:
                raise RuntimeError(f"rank {self.rank}: LoRA is not set up on this stage")
            dtype = get_torch_dtype(self.model_config.dtype)
            runner.lora_manager = StageLoRAManager(
                runner.model, self.layout, lora_config, dtype, self.device
            )
        return runner.lora_manager

    def sync_loras(self, lora_config: LoRAConfig, requests: list[LoRARequest]) -> str | None:
        """Install the LoRA layers if not yet, and hold exactly `requests` (the engine's
        registry: at start, and on a replaced stage). Returns an error message or None (a bad
        adapter is the caller's error, not this stage's failure)."""
        manager = self._lora(lora_config)
        wanted = {r.lora_int_id: r for r in requests}
        for lora_id in set(manager.known) - set(wanted):
            manager.remove(lora_id)
        for request in requests:
            error = self.add_lora(request)
            if error is not None:
                return error
        return None

    def add_lora(self, request: LoRARequest) -> str | None:
        """Register and load an adapter; an error message instead of raising."""
        try:
            self._lora().add(request)
        except (ValueError, OSError) as exc:
            return str(exc)
        return None

    def remove_lora(self, lora_id: int) -> bool:
        return self._lora().remove(lora_id)

    def list_loras(self) -> list[int]:
        return self._lora().ids()

    def get_stage_info(self) -> StageInfo:
        """Where this stage runs and what it holds (the engine logs it)."""
        model = self.model_runner.model
        return StageInfo(
            rank=self.rank,
            pp_rank=ps.get_pipeline_model_parallel_rank(),
            tp_rank=ps.get_tensor_model_parallel_rank(),
            tp_size=ps.get_tensor_model_parallel_world_size(),
            layers=(self.layout.start_layer, self.layout.end_layer),
            is_first=self.layout.is_first,
            is_last=self.layout.is_last,
            host=socket.gethostname(),
            ip=net.get_ip(),
            pid=os.getpid(),
            device=str(self.device),
            threads=torch.get_num_threads(),
            num_params=model.num_params,
            weight_bytes=model.weight_bytes,
            linear_path=model.linear_path,
        )

    def get_memory_stats(self) -> dict[str, Any]:
        """Peak memory of this stage's process (RSS on CPU, allocator peak on CUDA)."""
        import resource

        stats: dict[str, Any] = {
            "pp_rank": ps.get_pipeline_model_parallel_rank(),
            # ru_maxrss is in KiB on Linux.
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        }
        if self.device.type == "cuda":
            stats["cuda_peak_bytes"] = torch.cuda.max_memory_allocated(self.device)
        return stats

    def num_kv_heads(self) -> int:
        """KV heads this rank caches: its TP share (replicated when kv heads < TP)."""
        return tpu.num_kv_heads_per_rank(
            self.model_config.get_num_kv_heads(), self.parallel_config.tensor_parallel_size
        )

    def _layer_kv_shapes(self) -> list[tuple[int, int]]:
        """(KV heads this rank caches, head size) of each of this stage's layers: the model's
        own when it names them (layers may differ), else the config's for every layer."""
        model = getattr(getattr(self, "model_runner", None), "model", None)
        if model is not None and hasattr(model, "kv_cache_shapes"):
            return list(model.kv_cache_shapes())
        shape = (self.num_kv_heads(), self.model_config.get_head_size())
        return [shape] * self.layout.num_layers

    def _boundary_width(self) -> int:
        """Width of the row this rank keeps per KV slot in its boundary cache: what it sends
        downstream (its 1/tp slice, see `tpu.slice_for_next_stage`); 0 when it keeps none
        (the last stage, or stage-local recovery off)."""
        if not self.parallel_config.boundary_cache_enabled or self.layout.is_last:
            return 0
        hidden = self.model_config.get_hidden_size()
        tp = self.parallel_config.tensor_parallel_size
        return hidden // tp if tp > 1 and hidden % tp == 0 else hidden

    def get_cache_block_size_bytes(self) -> int:
        """Bytes of one KV block across this stage's layers, each with its own KV shape, plus
        the block's boundary-cache rows (counted so KV sizing stays honest)."""
        dtype = get_torch_dtype(self.model_config.dtype)
        block_size = self.cache_config.block_size
        element_size = torch.tensor([], dtype=dtype).element_size()
        boundary = block_size * self._boundary_width() * element_size
        return layers_block_bytes(block_size, self._layer_kv_shapes(), dtype) + boundary

    def determine_num_available_blocks(self) -> tuple[int, int]:
        """(device blocks, host swap blocks) this stage can hold within its own budget.

        CPU: `kv_cache_space` GiB. CUDA: total memory x gpu_memory_utilization minus the
        peak of a max-size forward of this stage's layers, profiled."""
        block_bytes = self.get_cache_block_size_bytes()
        cc = self.cache_config
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            self._profile_run()
            torch.cuda.synchronize()
            free, total = torch.cuda.mem_get_info()
            peak = torch.cuda.max_memory_allocated()
            used_by_others = total - free - torch.cuda.memory_allocated()
            budget = total * cc.gpu_memory_utilization - peak - used_by_others
            num_gpu = max(int(budget // block_bytes), 0)
            torch.cuda.empty_cache()
        else:
            num_gpu = cc.kv_cache_space_bytes // block_bytes
        if cc.num_gpu_blocks_override is not None:
            num_gpu = cc.num_gpu_blocks_override
        return num_gpu, cc.swap_space_bytes // block_bytes

    @torch.inference_mode()
    def _profile_run(self) -> None:
        """A max-size prefill through this stage alone (no communication, no cache)."""
        from vllm.model_executor.input_metadata import InputMetadata

        sc = self.scheduler_config
        num_seqs = min(sc.max_num_seqs, sc.max_num_batched_tokens)
        seq_len = sc.max_num_batched_tokens // num_seqs
        total = seq_len * num_seqs
        empty = torch.empty(0, dtype=torch.long, device=self.device)
        md = InputMetadata(
            num_prefills=num_seqs,
            num_prefill_tokens=total,
            num_decode_tokens=0,
            slot_mapping=empty,
            prefill_seq_lens=torch.full((num_seqs,), seq_len, dtype=torch.long),
            decode_context_lens=empty,
            decode_block_tables=empty.view(0, 0),
        )
        positions = torch.arange(seq_len, device=self.device).repeat(num_seqs)
        model = self.model_runner.model
        caches = [None] * self.layout.num_layers
        if self.layout.is_first:
            ids = torch.zeros(total, dtype=torch.long, device=self.device)
            hidden = model(ids, positions, caches, md)
        else:
            width = self.model_config.get_hidden_size()
            dtype = get_torch_dtype(self.model_config.dtype)
            h = torch.zeros(total, width, dtype=dtype, device=self.device)
            hidden = model(None, positions, caches, md, hidden_states=h)
        if self.layout.is_last:
            model.compute_logits(hidden[-num_seqs:])

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        mc = self.model_config
        self.cache_engine = CacheEngine(
            self.layout.num_layers,
            self.num_kv_heads(),
            mc.get_head_size(),
            self.cache_config.block_size,
            num_gpu_blocks,
            num_cpu_blocks,
            get_torch_dtype(mc.dtype),
            self.device,
            layer_shapes=self._layer_kv_shapes(),
            boundary_width=self._boundary_width(),
        )

    def execute_model(self, request: ExecuteModelRequest) -> SamplerOutput | None:
        """One step of this stage. Returns the sampler output on the last stage, else None.

        A step that fails with other ranks around closes this rank's process groups before
        raising. A failed step means the engine re-forms the groups anyway (or stops), and a
        peer still waiting on this rank -- receives are posted ahead, so a neighbour can be
        several messages further on -- is released at once by the closed connection instead
        of waiting out the group timeout while the engine waits for it to rejoin."""
        if request.step is not None and request.step.replay is not None:
            # Run as a step, it would sample and enter the request table.
            raise ValueError(
                "execute_model: a replay step (StepMessage.replay) goes through replay_stages "
                "or replay_gained_layers"
            )
        if self.parallel_config.world_size > 1 and not ps.model_parallel_is_initialized():
            # A step queued before the engine saw an earlier failure of this rank's. Its block
            # operations are local and still applied: every surviving rank gets the same
            # steps, so after a stage replacement all of them hold the blocks the scheduler
            # moved or copied, and only the replaced stage must rebuild its KV.
            self.apply_block_ops(request.kv_blocks_bound, request.block_ops())
            raise RuntimeError(
                f"rank {self.rank}: this stage left its process groups after a failed step "
                "and waits for the engine to re-form them"
            )
        try:
            return self._execute_model(request)
        except BaseException as exc:
            self.leave_groups_after(exc)
            raise

    def leave_groups_after(self, exc: BaseException) -> None:
        """A step or replay failed: close this rank's process groups (see execute_model)."""
        self.timers.abort()  # the step is over: a heartbeat must not report it busy
        if self.parallel_config.world_size > 1:
            logger.warning(
                "rank %d: step failed (%s: %s); leaving the process groups",
                self.rank,
                type(exc).__name__,
                str(exc).strip()[-200:],
            )
            self._pending_send = None
            try:
                ps.destroy_model_parallel()
            except Exception as close_exc:  # a group with a dead peer may not close cleanly
                logger.warning("rank %d: closing the groups: %s", self.rank, close_exc)

    def _execute_model(self, request: ExecuteModelRequest) -> SamplerOutput | None:
        assert self.cache_engine is not None, "initialize_cache() first"
        timers, step, layout = self.timers, request.step, self.layout
        timers.begin()
        cache = self.cache_engine
        # Block operations come before the forward: this step's batch may use moved blocks.
        self.apply_block_ops(request.kv_blocks_bound, request.block_ops())
        self.model_runner.drop_requests(request.finished_request_ids)
        rows: StepRows | None = None
        if step is not None:
            self.request_table.drop(request.finished_request_ids)
            if layout.is_first and not layout.is_last:
                # Decodes scheduled ahead feed the ids the last stage sampled for them.
                timers.lap("cache_s")
                self.sampled_ids.receive(step.recv_sampled_through, self.request_table)
                timers.lap("tokens_wait_s")
            rows = self.request_table.apply(step)
            if layout.is_first and self.parallel_config.world_size > 1:
                # What the engine sent this stage for the step (records): ~20 us to count.
                # In-process (one rank) nothing was pickled, and a request's logits processor
                # need not be picklable at all.
                timers.stats.step_bytes += message_bytes(step)
        # Cache work first: on a later stage it overlaps with the previous stage's compute.
        timers.lap("cache_s")
        received = None if layout.is_first else self.receive_hidden()
        timers.lap("recv_s")
        cpu_started = time.thread_time()
        to_send, output = self.model_runner.execute_stage(
            cache.gpu_cache, rows, received, self.request_table.generators
        )
        if layout.is_last and step is not None and not layout.is_first:
            self.sampled_ids.share(step, output, self.request_table)
        timers.lap("compute_s")
        timers.stats.compute_cpu_s += time.thread_time() - cpu_started
        if to_send is not None:
            self.send_hidden(to_send)
        timers.lap("send_s")
        timers.end()
        return output

    def apply_block_ops(self, kv_blocks_bound: int, ops: BlockOps) -> None:
        """Map the cache up to `kv_blocks_bound` blocks, then swap in, swap out and copy."""
        cache = self.cache_engine
        assert cache is not None, "initialize_cache() first"
        cache.reserve(kv_blocks_bound)
        cache.swap_in(ops.swap_in)
        cache.swap_out(ops.swap_out)
        cache.copy(ops.copy)

    def receive_hidden(self) -> dict[str, Any]:
        """The previous stage's hidden states and metadata (TP: all-gathered from slices)."""
        received = recv_tensor_dict(ps.get_pipeline_model_parallel_prev_rank(), device=self.device)
        if received.pop("hidden_tp_sliced", False):
            received["hidden"] = tpu.all_gather_last_dim(received["hidden"])
        return received

    def send_hidden(self, to_send: dict[str, Any], send: bool = True) -> None:
        """Send to the next stage without waiting for it (the next stage overlaps with this
        one), after the previous step's send finished (keeps order and bounds memory). The
        rows sent are kept in the boundary cache at the step's slots; with `send=False`
        (a replay whose next stage kept its KV) they are only kept."""
        if self._pending_send is not None:
            self._pending_send.wait()
        # TP: each rank sends its 1/tp slice; the next stage's ranks all-gather them.
        to_send["hidden"], sliced = tpu.slice_for_next_stage(to_send["hidden"])
        if sliced:
            to_send["hidden_tp_sliced"] = True
        cache = self.cache_engine
        if cache is not None and cache.gpu_boundary is not None:
            cache.write_boundary(to_send["md.slot_mapping"], to_send["hidden"])
        if send:
            self.send_to_next(to_send)

    def send_to_next(self, to_send: dict[str, Any]) -> None:
        """Send `to_send` to the next stage without waiting (`wait_for_send` waits)."""
        self._pending_send = send_tensor_dict(
            to_send, ps.get_pipeline_model_parallel_next_rank(), async_op=True
        )

    def wait_for_send(self) -> None:
        """Wait until the last send to the next stage completed."""
        if self._pending_send is not None:
            self._pending_send.wait()

    def drop_pending_send(self) -> None:
        """Forget the last send (completed, or its peer is gone: never wait on it)."""
        self._pending_send = None

    def propose_drafts(self, requests: list[DraftRequest], finished: list[str]) -> list[list[int]]:
        """A draft model's rank (the whole model, one stage): k greedy draft tokens after each
        request's token ids, over draft sequences kept in this rank's cache (`DraftRunner`)."""
        if self.draft_runner is None:
            cache = self.cache_engine
            assert cache is not None, "initialize_cache() first"
            if not (self.layout.is_first and self.layout.is_last):
                raise RuntimeError(f"rank {self.rank}: a draft model runs as one stage")
            self.draft_runner = DraftRunner(
                self.model_runner.model,
                cache.gpu_cache,
                cache.num_gpu_blocks,
                self.cache_config.block_size,
                self.device,
                cache.reserve,
            )
        return self.draft_runner.propose(requests, finished)

    def get_stage_stats(self, reset: bool = True) -> StageStats:
        """Where this stage's time went since the last reset (`StageStats`)."""
        return self.timers.take(reset)

    def start_profile(self, trace_dir: str) -> None:
        """Start torch's profiler on this rank (see `StageProfiler`)."""
        self.profiler.start(
            trace_dir, f"stage{ps.get_pipeline_model_parallel_rank()}-rank{self.rank}"
        )

    def stop_profile(self) -> str | None:
        """Stop the profiler; the path of its ops table (None if it was not running)."""
        return self.profiler.stop()

    def shutdown(self) -> None:
        """Finish the last send, leave the process groups and give the memory back."""
        try:
            if self._pending_send is not None:
                self._pending_send.wait()
        finally:
            self._pending_send = None
            if self.parallel_config.world_size > 1:
                ps.destroy_model_parallel()
            # With PP=1 this is the user's process, which lives on: the weights and the cache
            # must not stay mapped in malloc's heap after the engine is gone.
            self.cache_engine = None
            self.model_runner = None  # type: ignore[assignment]
            self.draft_runner = None
            release_memory()


def worker_verbs(worker: Worker) -> dict[Verb, Callable[..., Any]]:
    """What answers each verb a built Worker takes (`vllm.distributed.rank_verbs`): the step
    and its set-up on the Worker, a recovery's calls on its `RankRecovery`. One table, used
    by a rank's process (`rank_server.WorkerHost`) and in-process (`UniProcExecutor`)."""
    recovery = worker.recovery
    return {
        Verb.INIT_DEVICE: worker.init_device,
        Verb.LOAD_MODEL: worker.load_model,
        Verb.DETERMINE_NUM_AVAILABLE_BLOCKS: worker.determine_num_available_blocks,
        Verb.INITIALIZE_CACHE: worker.initialize_cache,
        Verb.EXECUTE_MODEL: worker.execute_model,
        Verb.REPLAY_STAGES: recovery.replay_stages,
        Verb.PROPOSE_DRAFTS: worker.propose_drafts,
        Verb.REJOIN_PROCESS_GROUPS: worker.rejoin_process_groups,
        Verb.RESHAPE: worker.reshape,
        Verb.MERGE_LAYERS: recovery.merge_layers,
        Verb.GROW_MERGED_CACHE: recovery.grow_merged_cache,
        Verb.REPLAY_GAINED_LAYERS: recovery.replay_gained_layers,
        Verb.FINISH_MERGE: recovery.finish_merge,
        Verb.SYNC_LORAS: worker.sync_loras,
        Verb.ADD_LORA: worker.add_lora,
        Verb.REMOVE_LORA: worker.remove_lora,
        Verb.GET_STAGE_INFO: worker.get_stage_info,
        Verb.GET_STAGE_STATS: worker.get_stage_stats,
        Verb.GET_MEMORY_STATS: worker.get_memory_stats,
        Verb.START_PROFILE: worker.start_profile,
        Verb.STOP_PROFILE: worker.stop_profile,
        Verb.SHUTDOWN: worker.shutdown,
    }
