"""A frozen, test-only copy of the scheduler as it was before it became a composed scheduler
(`vllm/core/scheduler.py` with the `classic_policy`, `chunked_policy` and `queue_heads` mixins
and `scheduler_types`), kept verbatim except for its imports.

`tests/unit/test_scheduler_differential.py` drives it side by side with the live scheduler on
random workloads and asserts that every `schedule()` decides the same. Never import it from
`vllm/`, and never edit it to make a difference go away: a difference is either a bug in the
live scheduler or an intended change, which the differential test then states explicitly.

It shares `vllm.config`, `vllm.sequence` and `vllm.core.block_manager` with the live code: the
refactor it guards only adds fields to `SequenceGroup` (which this copy never reads) and does
not change the block manager.
"""
