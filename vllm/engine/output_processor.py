"""Applies a step's sampler output to the sequences: append tokens, fork samples, detokenize,
check stop conditions, free finished sequences, and build RequestOutputs (torch-free)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable

from vllm.core.scheduler import Scheduler
from vllm.engine.detokenizer import TokenizerInfo, check_stop_strings, detokenize_incrementally
from vllm.outputs import RequestOutput
from vllm.sequence import (
    SamplerOutput,
    Sequence,
    SequenceGroup,
    SequenceGroupOutput,
    SequenceStatus,
)


class OutputProcessor:
    """Turns sampled tokens into sequence state and RequestOutputs, vLLM's stop order:
    min_tokens first, then EOS, stop_token_ids, stop strings, max_model_len, max_tokens."""

    def __init__(
        self,
        scheduler: Scheduler,
        tokenizer: Any,
        max_model_len: int,
        new_seq_id: Callable[[], int],
    ) -> None:
        self.scheduler = scheduler
        self.tokenizer_info = TokenizerInfo(tokenizer) if tokenizer is not None else None
        self.max_model_len = max_model_len
        self.new_seq_id = new_seq_id

    def process(self, groups: list[SequenceGroup], output: SamplerOutput) -> list[RequestOutput]:
        if len(groups) != len(output):
            raise RuntimeError(
                f"sampler returned {len(output)} group outputs for {len(groups)} groups"
            )
        results = []
        for group, group_output in zip(groups, output):
            if group.is_finished():
                # Aborted while its batch was inside the pipeline: discard the tokens.
                results.append(RequestOutput.from_seq_group(group))
                continue
            self._process_group(group, group_output)
            results.append(RequestOutput.from_seq_group(group))
        return results

    def _process_group(self, group: SequenceGroup, group_output: SequenceGroupOutput) -> None:
        if group_output.prompt_logprobs is not None:
            group.prompt_logprobs = group_output.prompt_logprobs
        by_parent: dict[int, list[Any]] = defaultdict(list)
        for sample in group_output.samples:
            by_parent[sample.parent_seq_id].append(sample)
        updated: list[Sequence] = []
        for parent in group.get_seqs(SequenceStatus.RUNNING):
            samples = by_parent.get(parent.seq_id)
            if not samples:
                raise RuntimeError(f"no sample for running sequence {parent.seq_id}")
            # Extra samples (best_of on the prompt step) become forks sharing the parent's
            # blocks copy-on-write; the parent itself takes the last sample.
            for sample in samples[:-1]:
                child = parent.fork(self.new_seq_id())
                child.append_token_id(sample.output_token, sample.logprobs)
                group.add(child)
                self.scheduler.fork_seq(parent, child)
                updated.append(child)
            parent.append_token_id(samples[-1].output_token, samples[-1].logprobs)
            updated.append(parent)
        params = group.sampling_params
        for seq in updated:
            new_chars = 0
            if params.detokenize and self.tokenizer_info is not None:
                new_text = detokenize_incrementally(
                    self.tokenizer_info,
                    seq,
                    params.skip_special_tokens,
                    params.spaces_between_special_tokens,
                )
                seq.output_text += new_text
                new_chars = len(new_text)
                if params.logprobs is not None:
                    self._fill_decoded_tokens(seq)
            self._check_stop(seq, params, new_chars)
            if seq.is_finished():
                self.scheduler.free_seq(seq)

    def _fill_decoded_tokens(self, seq: Sequence) -> None:
        """Give the newest logprob entries their decoded text."""
        assert self.tokenizer_info is not None
        tokenizer = self.tokenizer_info.tokenizer
        for token_id, logprob in seq.output_logprobs[-1].items():
            if logprob.decoded_token is None:
                logprob.decoded_token = tokenizer.decode([token_id])

    def _check_stop(self, seq: Sequence, params: Any, new_chars: int) -> None:
        if seq.get_output_len() < params.min_tokens:
            return
        last = seq.get_last_token_id()
        if not params.ignore_eos and last == seq.eos_token_id:
            seq.status = SequenceStatus.FINISHED_STOPPED
            return
        if last in params.stop_token_ids:
            seq.status = SequenceStatus.FINISHED_STOPPED
            seq.stop_reason = last
            return
        stop_str = check_stop_strings(
            seq, new_chars, params.stop, params.include_stop_str_in_output
        )
        if stop_str is not None:
            seq.status = SequenceStatus.FINISHED_STOPPED
            seq.stop_reason = stop_str
            return
        if seq.get_len() > self.max_model_len:
            seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED
            return
        if params.max_tokens is not None and seq.get_output_len() >= params.max_tokens:
            seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED
