"""Applies a step's sampler output to the sequences: append tokens, fork samples, detokenize,
check stop conditions, free finished sequences, and build RequestOutputs (torch-free)."""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any, Callable

from vllm.core.scheduler import Scheduler
from vllm.engine.beam_search import process_beam_step
from vllm.engine.detokenizer import (
    TokenizerInfo,
    decode_candidate,
    decode_prompt_logprobs,
    detokenize_incrementally,
    flush_detokenizer,
)
from vllm.engine.stop_checker import check_stop
from vllm.logger import init_logger
from vllm.outputs import EngineOutput, output_of_group
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.sequence import (
    PromptLogprobs,
    SamplerOutput,
    Sequence,
    SequenceGroup,
    SequenceGroupOutput,
    SequenceOutput,
    SequenceStatus,
)

FINAL_ONLY = RequestOutputKind.FINAL_ONLY

logger = init_logger("vllm.engine.output_processor")


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

    def process(self, groups: list[SequenceGroup], output: SamplerOutput) -> list[EngineOutput]:
        """Apply one batch's outputs (one per group, in schedule order)."""
        if len(groups) != len(output):
            raise RuntimeError(
                f"sampler returned {len(output)} group outputs for {len(groups)} groups"
            )
        results = []
        now = time.time()
        for group, group_output in zip(groups, output):
            # Finished while this batch was inside the pipeline (aborted, or stopped by the
            # step before a step scheduled ahead): the tokens are discarded, and the final
            # output goes out once.
            if not group.is_finished() and group.pooling_params is not None:
                if group_output.recompute:
                    # The last stage lost the request's earlier chunks: it runs again.
                    logger.info(
                        "Pooling request %s is recomputed: %s", group.request_id, group_output.error
                    )
                    self.scheduler.recompute_groups([group])
                    continue
                if group.is_prefill():
                    continue  # a chunk before the end of the prompt: nothing pooled yet
                self._finish_pooling(group, group_output)
                group.record_token_time(now)
            elif not group.is_finished():
                if group_output.prompt_logprobs is not None:
                    self._add_prompt_logprobs(group, group_output.prompt_logprobs)
                if group.is_prefill():
                    # A prefill chunk before the end of the prompt: nothing was sampled.
                    continue
                self._process_group(group, group_output)
                group.record_token_time(now)
            if group.is_finished():
                if not group.final_output_returned:
                    group.final_output_returned = True
                    results.append(output_of_group(group))
            elif group.pooling_params is None and group.sampling_params.output_kind != FINAL_ONLY:
                # FINAL_ONLY requests (all of LLM.generate's) get no partial outputs built.
                results.append(output_of_group(group))
        return results

    def _finish_pooling(self, group: SequenceGroup, group_output: SequenceGroupOutput) -> None:
        """A pooling request's prompt went through every stage: it finishes with its pooled
        data, and its blocks are released."""
        if group_output.pooled is None:
            raise RuntimeError(
                f"request {group.request_id}: the last stage returned no pooled data for it"
            )
        group.pooled_data = group_output.pooled
        for seq in group.get_unfinished_seqs():
            seq.status = SequenceStatus.FINISHED_STOPPED
            self.scheduler.free_seq(seq)

    def _add_prompt_logprobs(self, group: SequenceGroup, chunk: PromptLogprobs) -> None:
        """Join the prompt logprobs of one prefill chunk; set them once all have arrived (on
        the first prefill only: a recompute re-prefill does not bring them)."""
        if group.prompt_logprobs is not None:
            return
        if chunk and chunk[0] is None:
            # The prompt's first chunk (again, if a preemption restarted the prefill).
            group.partial_prompt_logprobs = []
        group.partial_prompt_logprobs.extend(chunk)
        if len(group.partial_prompt_logprobs) < len(group.prompt_token_ids):
            return
        params = group.sampling_params
        complete = group.partial_prompt_logprobs
        group.partial_prompt_logprobs = []
        if params.detokenize and self.tokenizer_info is not None:
            decode_prompt_logprobs(
                self.tokenizer_info,
                group.prompt_token_ids,
                complete,
                params.skip_special_tokens,
                params.spaces_between_special_tokens,
            )
        group.prompt_logprobs = complete

    def _process_group(self, group: SequenceGroup, group_output: SequenceGroupOutput) -> None:
        params = group.sampling_params
        if params.use_beam_search:
            process_beam_step(self, group, group_output.samples)
            return
        by_parent: dict[int, list[SequenceOutput]] = defaultdict(list)
        for sample in group_output.samples:
            by_parent[sample.parent_seq_id].append(sample)
        # (sequence, the parent it came from); a parent continues with its last sample.
        children: list[tuple[Sequence, Sequence]] = []
        for parent in group.get_seqs(SequenceStatus.RUNNING):
            samples = by_parent.get(parent.seq_id)
            if not samples:
                raise RuntimeError(f"no sample for running sequence {parent.seq_id}")
            # Extra samples (best_of on the first step) become forks of the parent; the
            # fork from the j-th draw is sample parent + 1 + j (the sampler drew it from that
            # sample's seeded stream: sampler.draw_sample_indices).
            for j, sample in enumerate(samples[:-1]):
                child = parent.fork(self.new_seq_id())
                child.data.sample_index = parent.data.sample_index + 1 + j
                self.append_token(child, sample, params)
                children.append((child, parent))
            self.append_speculated(parent, samples[-1], params)
            children.append((parent, parent))
        # Forks share the parent's blocks copy-on-write; fork before freeing anything.
        for seq, parent in children:
            if seq is not parent:
                group.add(seq)
                if not seq.is_finished():
                    self.scheduler.fork_seq(parent, seq)
        for seq, parent in children:
            if seq is parent and seq.is_finished():
                self.scheduler.free_seq(seq)

    def fork_seq(self, parent: Sequence, child: Sequence) -> None:
        """Give `child` its share of `parent`'s KV blocks (copy-on-write)."""
        self.scheduler.fork_seq(parent, child)

    def free_seq(self, seq: Sequence) -> None:
        """Release the KV blocks of `seq`."""
        self.scheduler.free_seq(seq)

    def append_speculated(
        self, seq: Sequence, sample: SequenceOutput, params: SamplingParams
    ) -> None:
        """Append a sample: after a speculative step its accepted drafts first, one at a time
        (each checked against the stop conditions: nothing is emitted past a stop), then the
        token the target sampled after them. The accepted drafts' KV is in the cache."""
        if sample.accepted:
            for token, logprobs in sample.accepted:
                self.append_token(seq, SequenceOutput(seq.seq_id, token, logprobs), params)
                if seq.is_finished():
                    return
            # Positions len-1 .. of the accepted drafts were written by the step.
            seq.data.update_num_computed_tokens(len(sample.accepted))
        self.append_token(seq, sample, params)

    def append_token(self, seq: Sequence, sample: SequenceOutput, params: SamplingParams) -> None:
        """Append a sampled token to `seq`, detokenize it, fill the decoded text of its logprob
        entry (vLLM: the sampled token's text is the text it added, so the decoded tokens join
        to the output text), and check the stop conditions."""
        info = self.tokenizer_info
        if not params.detokenize or info is None:
            seq.append_token_id(sample.output_token, sample.logprobs)
            check_stop(seq, params, 0, self.max_model_len)
            return
        skip = params.skip_special_tokens
        spaces = params.spaces_between_special_tokens
        want_text = params.logprobs is not None
        if want_text:
            # Top-k alternatives decode against the state before this token.
            for token_id, logprob in sample.logprobs.items():
                if token_id != sample.output_token and logprob.decoded_token is None:
                    logprob.decoded_token = decode_candidate(info, seq, token_id, skip, spaces)
        seq.append_token_id(sample.output_token, sample.logprobs)
        new_text = detokenize_incrementally(info, seq, skip, spaces)
        seq.output_text += new_text
        if want_text:
            sample.logprobs[sample.output_token].decoded_token = new_text
        check_stop(seq, params, len(new_text), self.max_model_len)
        if seq.is_finished() and not isinstance(seq.stop_reason, str):
            # A cut inside a multi-byte character: the held-back bytes are part of the
            # output (a stop string's cut already dropped everything after it).
            stop_token = seq.status == SequenceStatus.FINISHED_STOPPED
            drop = stop_token and not params.include_stop_str_in_output
            held = flush_detokenizer(info, seq, skip, spaces, drop)
            seq.output_text += held
            if want_text and held:
                logprob = sample.logprobs[sample.output_token]
                logprob.decoded_token = (logprob.decoded_token or "") + held
