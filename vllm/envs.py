"""The one registry of the environment variables the engine reads: name, default, type, doc.

Every `VLLM_*` variable is declared in `ENV_VARS` and read through the accessors below (at
call time, so tests may set them). Ray and Ray-Data actors get `environment_to_forward()`:
exactly the registered variables that are set in the driver, nothing found by a prefix scan.
The `mp` backend's spawned processes inherit the driver's whole environment.
`tests/unit/test_envs.py` fails when code under vllm/ reads a `VLLM_*` variable directly.

Imports nothing but the standard library: the logger and the torch-free configs use it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class EnvVar:
    """One environment variable: its default (as the string it would be set to), the type
    it parses to, a one-line doc, and whether Ray actors get the driver's value."""

    name: str
    default: str
    type: type
    doc: str
    # False for values the stages never read and that should not travel (a secret, a
    # build-time switch).
    forward: bool = True


_VARS = (
    # Fault handling and deadlines.
    EnvVar(
        "VLLM_PP_MICRO_BATCHES",
        "0",
        int,
        "Micro-batches (decode cohorts) kept in the pipeline; 0 means one per stage. More "
        "gives each stage slack against the others' jitter, at smaller batches.",
    ),
    EnvVar(
        "VLLM_PP_CHUNKED_PIPELINING",
        "1",
        bool,
        "With chunked prefill and several micro-batches: the next chunk of a prompt is "
        "scheduled while its earlier chunks are still in the pipeline (each stage runs them "
        "in order), so one long prompt keeps every stage busy; 0 sends one chunk at a time.",
    ),
    EnvVar(
        "VLLM_PP_DYNAMIC_CHUNKS",
        "0",
        bool,
        "1: with chunked prefill, a prompt's chunks shrink as they start further into it, so "
        "each step costs what its first chunk did (attention grows with the position; the "
        "cost ratio is measured from the engine's own steps). Off by default: on CPU the "
        "smaller chunks cost more than the even steps save (benchmarks.long_prompt: 0.63x "
        "against 0.59x of PP=1's time at PP=2); 0 cuts chunks of the whole token budget, as "
        "vLLM does.",
    ),
    EnvVar(
        "VLLM_SPEC_DRAFT_PLACEMENT",
        "driver",
        str,
        "Where a speculative draft model runs: 'driver' (in the engine's process) or 'rank' "
        "(a process of its own); see vllm/spec_decode/draft_model.py.",
        forward=False,
    ),
    EnvVar(
        "VLLM_PP_STEP_TIMEOUT_S",
        "60",
        float,
        "Base deadline (seconds) for one micro-batch to come back from the pipeline; a stage "
        "that misses it is declared failed (engine arg step_timeout_s overrides).",
    ),
    EnvVar(
        "VLLM_PP_STEP_TIMEOUT_PER_TOKEN_S",
        "0.05",
        float,
        "Seconds added to the step deadline per token in the micro-batch (long prefills).",
    ),
    EnvVar(
        "VLLM_STAGE_RESTART_WINDOW_S",
        "600",
        float,
        "The stage restart budget is a rate: at most max_stage_restarts replacements within "
        "this many seconds (older ones no longer count); past it the engine stops.",
    ),
    EnvVar(
        "VLLM_PP_SPARE_PROCESSES",
        "1",
        int,
        "Warm spare rank processes kept to replace a failed rank without starting one (mp: "
        "processes with torch and the Worker imported; Ray on CPU: standby actors on the "
        "driver's node); 0 turns them off. None when max_stage_restarts is 0.",
    ),
    EnvVar(
        "VLLM_PP_STAGE_RESTART_TIMEOUT_S",
        "180",
        float,
        "Deadline (seconds) for replacing failed stages (start, load, rejoin) before giving up.",
    ),
    EnvVar(
        "VLLM_PP_REGROW_INTERVAL_S",
        "30",
        float,
        "While a pipeline runs with fewer stages than configured (a failed stage could not be "
        "replaced), the engine tries to start the missing stages again at most this often "
        "(seconds), between steps.",
    ),
    EnvVar(
        "VLLM_PP_HEARTBEAT_TIMEOUT_S",
        "1.5",
        float,
        "A stage that leaves a heartbeat unanswered this long (seconds) counts as frozen and "
        "is replaced, whatever the step's length (a thread of each stage process answers, not "
        "its step; the worst round trip measured on an overloaded 2-core machine was 0.63 s). "
        "Stopped or dead processes on the engine's node are found within "
        "VLLM_PP_HEARTBEAT_INTERVAL_S regardless.",
    ),
    EnvVar(
        "VLLM_PP_HEARTBEAT_INTERVAL_S",
        "0.25",
        float,
        "How often (seconds) the engine probes every stage's heartbeat and reads the state of "
        "the stage processes on its node.",
    ),
    EnvVar(
        "VLLM_PP_PLACEMENT_TIMEOUT",
        "30",
        float,
        "Seconds to wait for the Ray placement group before failing with a clear error; "
        "also how long a bundle whose node left the cluster gets to be re-placed on a node "
        "with room before its stage leaves the pipeline.",
    ),
    EnvVar(
        "VLLM_PP_ACTOR_START_TIMEOUT",
        "180",
        float,
        "Seconds rank actors may take to start inside a caller's placement group (the engine "
        "runs in a Ray task/actor holding one) before failing with a clear error.",
    ),
    EnvVar(
        "VLLM_MP_CALL_TIMEOUT",
        "600",
        float,
        "Seconds one call to a rank of the `mp` backend may take (0: no limit); a rank that "
        "dies is noticed within half a second regardless.",
    ),
    # Pipeline layout and distributed set-up.
    EnvVar(
        "VLLM_PP_LAYER_PARTITION",
        "",
        str,
        "Decoder layers per stage, comma-separated (e.g. '10,8,6,6'); empty: an even split "
        "(engine arg pp_layer_partition overrides).",
    ),
    EnvVar(
        "VLLM_HOST_IP",
        "",
        str,
        "This node's address as other nodes reach it (multi-homed hosts); empty: detected.",
    ),
    # CPU performance knobs.
    EnvVar(
        "VLLM_CPU_THREADS_PER_STAGE",
        "0",
        int,
        "Torch threads per stage process; 0: 1 per Ray/mp rank, torch's own count in-process.",
    ),
    EnvVar(
        "VLLM_PP_GGUF_ACTIVATIONS",
        "float",
        str,
        "Arithmetic of GGUF Q4_0/Q4_1/Q8_0 linears below dense_min_tokens tokens "
        "(--quantization gguf): 'float' (activations in --dtype, the dequantized weights' "
        "products) or 'int8' (llama.cpp's: activations quantized per 32 values, integer dot "
        "products; faster, not the dequantized model's results).",
    ),
    EnvVar(
        "VLLM_CPU_MALLOC_TUNING",
        "1",
        bool,
        "0 leaves glibc malloc alone (1: heap-only blocks, no trimming, fewer page faults).",
    ),
    EnvVar(
        "VLLM_CPU_PACKED_LINEAR",
        "1",
        bool,
        "0 forces plain matmuls in CPU linear layers instead of packed weights (fp32/bf16; "
        "used anyway where oneDNN cannot prepack, e.g. bf16 on an AVX2-only CPU).",
    ),
    EnvVar(
        "VLLM_CPU_LINEAR_LAYOUT",
        "auto",
        str,
        "Layout of packed CPU linear weights: 'auto' (column panels for float32 when the "
        "kernels' ISA is AVX2, oneDNN's layout otherwise), 'panels' (float32 only) or "
        "'onednn'.",
    ),
    EnvVar(
        "VLLM_PP_DISABLE_KERNELS",
        "0",
        bool,
        "1 makes the layers use their torch code instead of the C++ kernels (read once; "
        "_custom_ops.reset_availability() reads it again).",
    ),
    EnvVar(
        "VLLM_PP_SKIP_KERNELS",
        "0",
        bool,
        "1 makes setup.py skip building the C++ kernels (build time only).",
        forward=False,
    ),
    EnvVar(
        "VLLM_PP_REQUIRE_KERNELS",
        "0",
        bool,
        "1 makes a failed C++ kernel build fail setup.py instead of installing without the "
        "kernels (build time only; CI sets it).",
        forward=False,
    ),
    # Files, logging, serving.
    EnvVar(
        "VLLM_PP_CACHE_DIR",
        "",
        str,
        "Where tokenizers/configs extracted from GGUF files are cached; empty: ~/.cache/vllm-pp.",
    ),
    EnvVar(
        "VLLM_TORCH_PROFILER_DIR",
        "",
        str,
        "Directory for torch.profiler traces of every stage (LLM.start_profile/stop_profile, "
        "the server's /start_profile and /stop_profile); empty: profiling is off.",
    ),
    EnvVar(
        "VLLM_LOGGING_LEVEL",
        "INFO",
        str,
        "Level of the 'vllm' logger (DEBUG, INFO, WARNING, ...).",
    ),
    EnvVar(
        "VLLM_CONFIGURE_LOGGING",
        "1",
        bool,
        "0 leaves the 'vllm' logger unconfigured (no handler, level or format set).",
    ),
    EnvVar(
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING",
        "0",
        bool,
        "1 adds the server's POST /v1/load_lora_adapter and /v1/unload_lora_adapter routes "
        "(adapters loaded and unloaded while it runs); off, they do not exist (404).",
        forward=False,  # read by the API server only
    ),
    EnvVar(
        "VLLM_ALLOW_LONG_MAX_MODEL_LEN",
        "0",
        bool,
        "1 allows a max_model_len above the model's context (its positions past what it was "
        "trained on give poor outputs: for timing long prompts), as vLLM's variable does.",
    ),
    EnvVar(
        "VLLM_KEEP_ALIVE_ON_ENGINE_DEATH",
        "0",
        bool,
        "1 keeps the OpenAI server running after its engine died (every request then gets a "
        "500 and /health a 503); by default the server shuts down, as vLLM's does.",
        forward=False,  # read by the API server only
    ),
    EnvVar(
        "VLLM_SERVER_DEV_MODE",
        "0",
        bool,
        "1 turns on the server's development routes without an API key: /v1/admin/* (show and "
        "re-split the pipeline); off, they exist only when an API key is set (else 403).",
        forward=False,  # read by the API server only
    ),
    EnvVar(
        "VLLM_API_KEY",
        "",
        str,
        "Bearer token the OpenAI-compatible server requires (--api-key overrides).",
        forward=False,  # a secret the stages never read
    ),
)

ENV_VARS: dict[str, EnvVar] = {var.name: var for var in _VARS}

# Variables of other software that the engine reads or sets; documented, not registered
# (they keep their own owners' names and meaning, and are never forwarded from here).
OTHER_VARS: dict[str, str] = {
    "OMP_NUM_THREADS": "Set for each stage process to its thread count (Ray and mp backends).",
    "LOCAL_RANK": "The rank's device index on its node (set by the mp backend, read by "
    "the worker on CUDA).",
    "RAY_ADDRESS": "Connect to this existing Ray cluster instead of starting a local one.",
    "PYTHONPATH": "Extended for Ray actors so they import vllm from the driver's source tree.",
}

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _raw(name: str) -> str:
    """The variable's value, stripped; its registered default when unset or empty."""
    var = ENV_VARS[name]  # KeyError: every variable must be registered first
    return os.environ.get(name, "").strip() or var.default


def get_str(name: str) -> str:
    """The variable's value as a string (its registered default when unset or empty)."""
    return _raw(name)


def _parsed(name: str, parse: Callable[[str], T], expected: str) -> T:
    raw = _raw(name)
    try:
        return parse(raw)
    except ValueError:
        raise ValueError(f"{name} must be {expected}, got {raw!r}.") from None


def get_float(name: str) -> float:
    """The variable's value as a float (its registered default when unset or empty)."""
    return _parsed(name, float, "a number of seconds")


def get_int(name: str) -> int:
    """The variable's value as an int (its registered default when unset or empty)."""
    return _parsed(name, int, "an integer")


def get_bool(name: str) -> bool:
    """The variable's value as a flag: 1/true/yes/on or 0/false/no/off (any case)."""
    raw = _raw(name).lower()
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ValueError(f"{name} must be 0 or 1, got {raw!r}.")


def environment_to_forward() -> dict[str, str]:
    """The registered variables set in this process (and meant for the stages), to give to
    the actors this process starts."""
    return {
        name: os.environ[name]
        for name, var in ENV_VARS.items()
        if var.forward and name in os.environ
    }
