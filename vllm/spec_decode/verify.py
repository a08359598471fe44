"""The last stage's acceptance of draft tokens (torch-free; runs after the sampler).

Each position of a speculative decode was sampled by the ordinary sampler as if the drafts
before it had been generated (`sampling_metadata._verify_rows`). A draft is accepted while it
equals the token sampled at its position; the first position where they differ yields the
sampled token instead, and when every draft is accepted the last position's token comes as a
bonus. Greedy requests thus get exactly their non-speculative tokens. For sampled requests this
is rejection sampling with a one-hot draft distribution (prompt lookup proposes tokens, not
distributions): the draft is accepted with probability p(draft), and a rejection yields a
token drawn from p restricted to the other tokens, i.e. from the residual max(0, p - q)
normalised -- the target's distribution exactly (Leviathan et al., 2023). A seeded request
draws each position from the stream of that position, so its tokens are the ones it would
get without speculation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.sequence import SamplerOutput, SequenceGroupOutput, SequenceOutput

if TYPE_CHECKING:
    from vllm.model_executor.sampling_metadata import VerifiedSeq


def accept_drafts(output: SamplerOutput, verified: list[int | list[VerifiedSeq]]) -> SamplerOutput:
    """One output per scheduled group from the sampler's output per sampling group: a plain
    group's as it is; a speculative decode's with, per sequence, its accepted drafts and the
    token after them (`SequenceOutput.accepted`)."""
    merged: SamplerOutput = []
    for entry in verified:
        if isinstance(entry, int):
            merged.append(output[entry])
            continue
        samples: list[SequenceOutput] = []
        error: str | None = None
        for seq in entry:
            outs = [output[index] for index in seq.positions]
            error = error or next((o.error for o in outs if o.error is not None), None)
            if error is not None:
                continue
            picked = [o.samples[0] for o in outs]  # one sample per one-row group
            num_accepted = 0
            while (
                num_accepted < len(seq.drafts)
                and picked[num_accepted].output_token == seq.drafts[num_accepted]
            ):
                num_accepted += 1
            last = picked[num_accepted]
            accepted = [(s.output_token, s.logprobs) for s in picked[:num_accepted]]
            samples.append(SequenceOutput(seq.seq_id, last.output_token, last.logprobs, accepted))
        if error is not None:
            # The request's own sampling work raised: placeholders keep the stages in step.
            samples = [SequenceOutput(seq.seq_id, 0, {}) for seq in entry]
        merged.append(SequenceGroupOutput(samples, error=error))
    return merged
