"""Beam search on the engine side, with HF transformers' semantics (torch-free).

Each step the sampler returns, for a beam group, its top candidates over all (beam, token)
pairs ordered by cumulative logprob (see `num_beam_candidates` in the sampler). Like HF's
`generate(num_beams=k)`:
- the best `k` candidates that do not finish become the next running beams;
- a finishing candidate (EOS, stop token/string, length) enters the pool of finished
  hypotheses only if it ranks among the first `k` candidates, scored
  `cumulative_logprob / generated_len ** length_penalty` (the EOS counts towards the length);
  the pool keeps the best `k`, and with early_stopping=True a full pool takes no more;
- the search ends when no candidate can continue, when the pool is full and
  early_stopping=True, or when the best running beam (at its current length, or at the
  longest possible length for early_stopping="never" with length_penalty > 0) cannot beat
  the worst finished hypothesis. The running beams are then dropped.

Deviation from vLLM V0, on purpose: V0 divided by the length including the prompt and let
finishing candidates of any rank into the pool, so its beams differ from HF's; here they match.
Every surviving beam is a light fork of its parent (shared KV blocks, copy-on-write); parents
are freed after all forks so their blocks stay referenced.
"""

from __future__ import annotations

from typing import Protocol

from vllm.engine.stop_checker import max_output_len
from vllm.sampling_params import SamplingParams
from vllm.sequence import (
    Sequence,
    SequenceGroup,
    SequenceOutput,
    SequenceStatus,
    beam_search_score,
)


class BeamSearchHost(Protocol):
    """What beam search needs from the engine, and nothing more: new sequence ids, appending
    a sampled token (detokenize + stop checks), and the KV-block side of forking and freeing.
    Kept narrow so beam search never reaches into the scheduler itself."""

    max_model_len: int

    def new_seq_id(self) -> int: ...

    def append_token(
        self, seq: Sequence, sample: SequenceOutput, params: SamplingParams
    ) -> None: ...

    def fork_seq(self, parent: Sequence, child: Sequence) -> None: ...

    def free_seq(self, seq: Sequence) -> None: ...


def process_beam_step(
    host: BeamSearchHost, group: SequenceGroup, samples: list[SequenceOutput]
) -> None:
    """Advance one beam group by one step (see the module docstring)."""
    params = group.sampling_params
    width = params.best_of
    length_penalty = params.length_penalty
    parents = {seq.seq_id: seq for seq in group.get_seqs(SequenceStatus.RUNNING)}
    if not samples:
        raise RuntimeError(f"no beam candidates for request {group.request_id}")
    pool = group.get_finished_seqs()

    running: list[tuple[Sequence, Sequence]] = []
    finishing: list[Sequence] = []
    for position, sample in enumerate(samples):
        if position >= width and len(running) >= width:
            break  # later candidates can neither run nor enter the pool
        parent = parents[sample.parent_seq_id]
        child = parent.fork_light(host.new_seq_id())
        host.append_token(child, sample, params)
        if child.is_finished():
            if position < width:
                finishing.append(child)
        elif len(running) < width:
            running.append((child, parent))

    pool_full = len(pool) >= width
    if finishing and not (params.early_stopping is True and pool_full):
        # Sorted is stable: on equal scores the older hypotheses stay first, as in HF's topk.
        merged = sorted(
            pool + finishing, key=lambda s: s.get_beam_search_score(length_penalty), reverse=True
        )
        kept = {seq.seq_id for seq in merged[:width]}
        for seq in pool:
            if seq.seq_id not in kept:
                group.remove(seq.seq_id)
        for seq in finishing:
            if seq.seq_id in kept:
                group.add(seq)  # finished: it never gets KV blocks of its own
        pool = merged[:width]

    if _search_done(host, params, running, pool):
        running = []
    # Fork the survivors before freeing the parents, so shared blocks are never released.
    for child, parent in running:
        group.add(child)
        host.fork_seq(parent, child)
    for parent in parents.values():
        group.remove(parent.seq_id)
        host.free_seq(parent)


def _search_done(
    host: BeamSearchHost,
    params: SamplingParams,
    running: list[tuple[Sequence, Sequence]],
    pool: list[Sequence],
) -> bool:
    """HF's stopping rule for the whole search (after the pool update of this step)."""
    width = params.best_of
    length_penalty = params.length_penalty
    early_stopping = params.early_stopping
    if not running:
        return True
    if len(pool) < width:
        return False
    if early_stopping is True:
        return True
    best = running[0][0]
    if early_stopping == "never" and length_penalty > 0.0:
        # Longer is better: the best beam could still grow to the longest allowed length.
        length = max_output_len(best, params, host.max_model_len)
    else:
        length = best.get_output_len()
    best_possible = beam_search_score(best.get_cumulative_logprob(), length, length_penalty)
    worst_finished = min(seq.get_beam_search_score(length_penalty) for seq in pool)
    return not best_possible > worst_finished
