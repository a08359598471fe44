"""Drafts from a smaller (or quantized) model sharing the target's tokenizer (the engine side).

The draft model runs as one stage of its own, built by the engine like a pipeline's
(`Worker`: the whole model, a paged KV cache sized by `kv_cache_space` like a stage's) behind
an executor, and answers one verb per proposal (`Verb.PROPOSE_DRAFTS`): every speculating
sequence's tokens and k in, k greedy draft tokens each out. Its draft sequences persist
between proposals (`vllm.spec_decode.draft_runner`), so a proposal costs k forwards of the
draft: the tokens the target accepted are fed in one, then k - 1 decodes.

Where it runs (measured, `benchmarks/spec_decode.py --draft-model`, SmolLM2 Q4_1 drafting
for SmolLM2 fp32, k=4, batch 1, 2-core CPU): in the engine's process (`draft_placement=
"driver"`, the default) or in a process of its own (`"rank"`, the `mp` backend). Proposing is
synchronous -- the scheduler waits for the drafts of the step it is building -- so a rank of
its own buys no overlap and costs a round trip per proposal plus a process on the shared
cores; see docs/PERFORMANCE.md for the figures of both.

A draft that fails (its rank lost, an error in its forward) never costs an output: the step
goes on without drafts, the failure is logged and the draft is rebuilt once; if that fails
too, drafting stays off (logged) and the target decodes alone. Greedy drafts are
deterministic proposals, so the target's acceptance rule stays exact
(`vllm.spec_decode.verify`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Protocol

from vllm.distributed.rank_verbs import Verb
from vllm.logger import init_logger

if TYPE_CHECKING:
    from vllm.config import EngineConfig

logger = init_logger("vllm.spec_decode")

# Where the draft model runs: in the engine's process, or in a process of its own.
DRAFT_PLACEMENTS = ("driver", "rank")
DEFAULT_DRAFT_PLACEMENT = "driver"


class DraftExecutor(Protocol):
    """What the proposer needs of the draft model's executor (built by the engine from
    `draft_engine_kwargs`)."""

    def collective_rpc(
        self, method: Verb, args: tuple = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]: ...

    def shutdown(self) -> None: ...


def draft_engine_kwargs(engine_config: EngineConfig, placement: str) -> dict[str, Any]:
    """`EngineArgs` of the draft model's stage: one rank (in the engine's process, or its own
    `mp` process), token ids only, the target's context, block size, seed and per-stage KV
    budget."""
    if placement not in DRAFT_PLACEMENTS:
        raise ValueError(f"draft placement must be one of {DRAFT_PLACEMENTS}, got {placement!r}")
    spec = engine_config.speculative_config
    assert spec is not None and spec.model is not None
    target = engine_config.model_config
    return dict(
        model=spec.model,
        quantization=spec.quantization,
        skip_tokenizer_init=True,
        seed=target.seed,
        max_model_len=target.max_model_len,
        block_size=engine_config.cache_config.block_size,
        kv_cache_space=engine_config.cache_config.kv_cache_space,
        distributed_executor_backend="mp" if placement == "rank" else None,
        # A lost draft is rebuilt by the proposer, as a whole: no spare process kept for it.
        max_stage_restarts=0,
        disable_log_stats=True,
    )


class DraftModelProposer:
    """Proposes drafts with a draft model's stage (see the module docstring). `build` makes
    its executor (again, after a failure)."""

    cheap = False

    def __init__(self, build: Callable[[], DraftExecutor]) -> None:
        self._build = build
        self.executor: DraftExecutor | None = build()
        self.rebuilds = 0  # how often the draft was rebuilt after a failure
        # Finished requests not yet told to the draft (sent with the next proposal).
        self._finished: list[str] = []

    @property
    def active(self) -> bool:
        """Whether drafts are proposed (False once the draft failed beyond a rebuild)."""
        return self.executor is not None

    def release(self, request_ids: list[str]) -> None:
        """Finished or aborted requests: their draft sequences are freed with the next
        proposal (no call of its own)."""
        if self.executor is not None:
            self._finished.extend(request_ids)

    def propose(self, requests: list[tuple[str, int, list[int], int]]) -> list[list[int]]:
        """For each (request id, seq id, token ids, k): up to k greedy draft tokens ([] for
        all when the draft failed: the step goes on without drafts)."""
        if self.executor is None:
            return [[] for _ in requests]
        finished, self._finished = self._finished, []
        try:
            return self.executor.collective_rpc(Verb.PROPOSE_DRAFTS, (requests, finished))[0]
        except Exception as exc:  # noqa: BLE001 - any failure of the draft: go on without
            self._recover(exc)
            return [[] for _ in requests]

    def _recover(self, exc: Exception) -> None:
        """The draft failed: rebuild it once (its draft sequences start empty: each is
        prefilled again on its next proposal), or stop drafting."""
        logger.warning(
            "Speculative decoding: the draft model failed (%s: %s); this step goes on "
            "without drafts",
            type(exc).__name__,
            str(exc).strip().splitlines()[0][:200] if str(exc).strip() else "",
        )
        self._shutdown_executor()
        if self.rebuilds >= 1:
            logger.warning("Speculative decoding: the draft model is off for good")
            return
        self.rebuilds += 1
        try:
            self.executor = self._build()
        except Exception as build_exc:  # noqa: BLE001
            logger.warning(
                "Speculative decoding: rebuilding the draft model failed (%s); drafting is "
                "off, the target decodes alone",
                build_exc,
            )
            return
        logger.info("Speculative decoding: the draft model was rebuilt; drafting resumes")

    def _shutdown_executor(self) -> None:
        executor, self.executor = self.executor, None
        self._finished = []
        if executor is not None:
            try:
                executor.shutdown()
            except Exception as exc:  # noqa: BLE001 - it is being dropped anyway
                logger.warning("Speculative decoding: shutting the draft model down: %s", exc)

    def shutdown(self) -> None:
        """Stop the draft model (its rank, or its weights and cache in this process)."""
        self._shutdown_executor()
