"""Stop conditions, in vLLM V0's order, checked after each appended token (torch-free)."""

from __future__ import annotations

from vllm.engine.detokenizer import check_stop_strings
from vllm.sampling_params import SamplingParams
from vllm.sequence import Sequence, SequenceStatus


def check_stop(
    seq: Sequence, params: SamplingParams, new_char_count: int, max_model_len: int
) -> None:
    """Finish `seq` if its newest token ends it. Nothing but the length limits applies before
    min_tokens; then EOS (unless ignore_eos), stop_token_ids (stop_reason = the id), stop
    strings (stop_reason = the string; the text is cut before it unless
    include_stop_str_in_output), the context length and max_tokens (finish_reason "length").

    As in vLLM, the text a stopping EOS / stop token added (e.g. with skip_special_tokens
    off, or an ordinary token used as a stop id) is removed unless include_stop_str_in_output.
    """
    if seq.get_output_len() >= params.min_tokens:
        last = seq.get_last_token_id()
        if not params.ignore_eos and last == seq.eos_token_id:
            _drop_new_text(seq, params, new_char_count)
            seq.status = SequenceStatus.FINISHED_STOPPED
            return
        if last in params.stop_token_ids:
            _drop_new_text(seq, params, new_char_count)
            seq.status = SequenceStatus.FINISHED_STOPPED
            seq.stop_reason = last
            return
        if params.stop:
            stop_str = check_stop_strings(
                seq, new_char_count, params.stop, params.include_stop_str_in_output
            )
            if stop_str is not None:
                seq.status = SequenceStatus.FINISHED_STOPPED
                seq.stop_reason = stop_str
                return
    # vLLM checks these after min_tokens too; min_tokens <= max_tokens is validated, and the
    # context limit must hold regardless.
    if seq.get_len() > max_model_len:
        seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED
        return
    if params.max_tokens is not None and seq.get_output_len() >= params.max_tokens:
        seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED


def _drop_new_text(seq: Sequence, params: SamplingParams, new_char_count: int) -> None:
    if new_char_count and not params.include_stop_str_in_output:
        seq.output_text = seq.output_text[:-new_char_count]


def max_output_len(seq: Sequence, params: SamplingParams, max_model_len: int) -> int:
    """The most output tokens `seq` can ever have (the max_tokens or the context limit)."""
    context_limit = max_model_len + 1 - seq.get_prompt_len()
    if params.max_tokens is None:
        return context_limit
    return min(params.max_tokens, context_limit)
