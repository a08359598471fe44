"""Hooks on what the engine hands back, for tests that check more than vLLM exposes."""

from __future__ import annotations


def keep_engine_cumulative_logprob(monkeypatch) -> None:
    """Without `logprobs`, CompletionOutput.cumulative_logprob is None (vLLM 0.5.4); the
    engine still sums the sampled tokens' logprobs. Keep that sum on each output as
    `engine_cumulative_logprob` so tests can check it."""
    import vllm.outputs

    real = vllm.outputs._completion

    def completion(seq, *args):
        out = real(seq, *args)
        out.engine_cumulative_logprob = seq.get_cumulative_logprob()
        return out

    monkeypatch.setattr(vllm.outputs, "_completion", completion)
