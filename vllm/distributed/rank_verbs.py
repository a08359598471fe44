"""The verbs the engine may call on a rank: one fixed list, the only names that cross.

The engine names a call by a `Verb` (`RankCalls.submit`, `ExecutorBase.collective_rpc`); a
rank answers each from its table (`vllm.worker.rank_server.WorkerHost`: verb -> handler with
its argument types) and refuses any other name with `UnknownVerbError`. Adding a call to the
ranks means adding a verb here and its handler there. Torch-free.
"""

from __future__ import annotations

import enum


class Verb(str, enum.Enum):
    """A call from the engine to a rank (its value is the name that crosses; a `str`, so it
    is the name it stands for in any comparison)."""

    # Building a rank: the Worker, its device and groups, its layers and cache.
    INIT_WORKER = "init_worker"
    INIT_DEVICE = "init_device"
    LOAD_MODEL = "load_model"
    DETERMINE_NUM_AVAILABLE_BLOCKS = "determine_num_available_blocks"
    INITIALIZE_CACHE = "initialize_cache"
    # Steps.
    EXECUTE_MODEL = "execute_model"
    REPLAY_STAGES = "replay_stages"
    # A draft model's rank: k greedy draft tokens per sequence (`vllm.spec_decode`).
    PROPOSE_DRAFTS = "propose_drafts"
    # The pipeline changes: groups re-formed, layers re-split or merged into a neighbour.
    REJOIN_PROCESS_GROUPS = "rejoin_process_groups"
    RESHAPE = "reshape"
    MERGE_LAYERS = "merge_layers"
    GROW_MERGED_CACHE = "grow_merged_cache"
    REPLAY_GAINED_LAYERS = "replay_gained_layers"
    FINISH_MERGE = "finish_merge"
    # LoRA adapters.
    SYNC_LORAS = "sync_loras"
    ADD_LORA = "add_lora"
    REMOVE_LORA = "remove_lora"
    # Reports and diagnostics.
    GET_STAGE_INFO = "get_stage_info"
    GET_STAGE_STATS = "get_stage_stats"
    GET_MEMORY_STATS = "get_memory_stats"
    START_PROFILE = "start_profile"
    STOP_PROFILE = "stop_profile"
    # The end.
    SHUTDOWN = "shutdown"


class UnknownVerbError(ValueError):
    """A call named no verb of the rank's table."""

    def __init__(self, verb: object, known: list[str]) -> None:
        self.verb = verb
        super().__init__(f"unknown verb {verb!r}: a rank answers only {', '.join(sorted(known))}")
