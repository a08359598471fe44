"""Environment variables of the engine's fault handling: name, default, meaning.

Read through these functions (at call time, so tests may set them). The Ray executor forwards
every `VLLM_*` variable of the driver to its stage actors.
"""

from __future__ import annotations

import os

# name -> (default, meaning)
ENV_VARS: dict[str, tuple[str, str]] = {
    "VLLM_PP_STEP_TIMEOUT_S": (
        "60",
        "Base deadline (seconds) for one micro-batch to come back from the pipeline; "
        "a stage that misses it is declared failed (engine arg step_timeout_s overrides).",
    ),
    "VLLM_PP_STEP_TIMEOUT_PER_TOKEN_S": (
        "0.05",
        "Seconds added to the step deadline per token in the micro-batch (long prefills).",
    ),
    "VLLM_PP_STAGE_RESTART_TIMEOUT_S": (
        "180",
        "Deadline (seconds) for replacing failed stages (start, load, rejoin) before giving up.",
    ),
    "VLLM_PP_HEARTBEAT_TIMEOUT_S": (
        "5",
        "A stage that leaves a health check unanswered this long (seconds) while a step is "
        "slow counts as frozen and is replaced.",
    ),
    "VLLM_PP_PLACEMENT_TIMEOUT": (
        "30",
        "Seconds to wait for the Ray placement group before failing with a clear error.",
    ),
    "VLLM_PP_ACTOR_START_TIMEOUT": (
        "180",
        "Seconds rank actors may take to start inside a caller's placement group (the engine "
        "runs in a Ray task/actor holding one) before failing with a clear error.",
    ),
    "VLLM_MP_CALL_TIMEOUT": (
        "600",
        "Seconds one call to a rank of the `mp` backend may take (0: no limit); a rank that "
        "dies is noticed within half a second regardless.",
    ),
}


def get_float(name: str) -> float:
    """The variable's value as a float (its registered default when unset or empty)."""
    default, _ = ENV_VARS[name]
    raw = os.environ.get(name, "").strip() or default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number of seconds, got {raw!r}.") from None
