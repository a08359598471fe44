"""Sequences, sequence groups, the rows a stage runs and the outputs it returns.

Imports no torch: the scheduler, the block manager and the engine's bookkeeping are tested with
fake sequences in milliseconds, and every record here pickles cheaply to Ray workers.
"""

from __future__ import annotations

import collections
import copy
import enum
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from vllm.lora.request import LoRARequest
    from vllm.pooling_params import PoolingParams
    from vllm.sampling_params import SamplingParams


@dataclass
class Logprob:
    """Log-probability of one token, with its rank in the vocabulary and decoded text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def beam_search_score(cumulative_logprob: float, output_len: int, length_penalty: float) -> float:
    """HF's beam hypothesis score: cumulative logprob / (generated tokens ** length_penalty).

    The one definition of the score: the ranking of finished hypotheses, the stopping rule and
    the choice of the `n` outputs all use it. The length counts the generated tokens only
    (not the prompt) and includes a final EOS, as in HF's `generate(num_beams=k)`.
    """
    return cumulative_logprob / (max(output_len, 1) ** length_penalty)


# One dict per generated position: token id -> Logprob (the sampled token plus the top-k).
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


class SequenceStatus(enum.IntEnum):
    """Where a sequence is in its life: queued, running, swapped out, or finished (and why)."""

    WAITING = 0
    RUNNING = 1
    SWAPPED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5
    FINISHED_IGNORED = 6

    @staticmethod
    def is_finished(status: SequenceStatus) -> bool:
        return status >= SequenceStatus.FINISHED_STOPPED

    @staticmethod
    def get_finished_reason(status: SequenceStatus) -> str | None:
        """vLLM's `finish_reason` strings; an ignored (too long) prompt reports "length"."""
        return {
            SequenceStatus.FINISHED_STOPPED: "stop",
            SequenceStatus.FINISHED_LENGTH_CAPPED: "length",
            SequenceStatus.FINISHED_ABORTED: "abort",
            SequenceStatus.FINISHED_IGNORED: "length",
        }.get(status)


@dataclass
class RequestMetrics:
    """When things happened to a request (vLLM's fields; `time.time()` seconds).

    `first_token_time` is when its first generated token came back, `last_token_time` the
    latest; `time_in_queue` is first_scheduled_time - arrival_time; `finished_time` stays None
    until the request finishes."""

    arrival_time: float
    last_token_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    time_in_queue: float | None = None
    finished_time: float | None = None


class SequenceStage(enum.Enum):
    """PREFILL until every token of the sequence has its KV in the cache (possibly over several
    chunks), then DECODE: one new token per step."""

    PREFILL = enum.auto()
    DECODE = enum.auto()


@dataclass
class SequenceData:
    """The token ids of one sequence: what workers need to run and sample it.

    `_num_computed_tokens` counts the leading tokens whose KV is already in the cache (a
    chunked prefill's earlier chunks, or a prefix found in the prefix cache); the next step
    feeds the tokens after them (vLLM's names and semantics)."""

    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    # The sequence's EOS id: the sampler suppresses it (with the stop ids) during min_tokens.
    eos_token_id: int | None = None
    _num_computed_tokens: int = 0
    _stage: SequenceStage = SequenceStage.PREFILL
    # The sample's index within its request (0 for the first; a fork made from the k-th
    # extra draw of the first step gets k + 1): a seeded sample draws from the stream of
    # seed + index, as vLLM's parallel sampling, so its tokens never depend on which of its
    # siblings are still running (see sampling_metadata.sample_seed).
    sample_index: int = 0
    # Per prompt token segment ids of an encoder's pair input ([CLS] a [SEP] b [SEP]: 0s then
    # 1s, as the HF tokenizer builds them); None for everything else.
    token_type_ids: list[int] | None = None

    def get_num_computed_tokens(self) -> int:
        return self._num_computed_tokens

    def update_num_computed_tokens(self, num_new_computed_tokens: int) -> None:
        """A step wrote the KV of `num_new_computed_tokens` more tokens; the prefill ends when
        every token is computed."""
        # Never beyond the tokens that exist (a defensive bound: the KV of a token cannot be
        # written before the token is known).
        self._num_computed_tokens = min(
            self._num_computed_tokens + num_new_computed_tokens, self.get_len()
        )
        if self._stage == SequenceStage.PREFILL and self._num_computed_tokens == self.get_len():
            self._stage = SequenceStage.DECODE

    def reset_state_for_recompute(self) -> None:
        """Its KV was dropped: every token is prefilled again."""
        self._num_computed_tokens = 0
        self._stage = SequenceStage.PREFILL

    def get_num_uncomputed_tokens(self) -> int:
        return self.get_len() - self._num_computed_tokens

    @property
    def stage(self) -> SequenceStage:
        return self._stage

    def append_token_id(self, token_id: int, logprob: float) -> None:
        self.output_token_ids.append(token_id)
        self.cumulative_logprob += logprob

    def get_len(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def get_prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    def get_output_len(self) -> int:
        return len(self.output_token_ids)

    def get_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def get_last_token_id(self) -> int:
        if self.output_token_ids:
            return self.output_token_ids[-1]
        return self.prompt_token_ids[-1]


class Sequence:
    """One token stream (prompt plus generated tokens) with its text and detokenizer state."""

    def __init__(
        self,
        seq_id: int,
        prompt: str | None,
        prompt_token_ids: list[int],
        block_size: int,
        eos_token_id: int | None = None,
        token_type_ids: list[int] | None = None,
    ) -> None:
        self.seq_id = seq_id
        self.prompt = prompt
        self.block_size = block_size
        self.eos_token_id = eos_token_id
        self.data = SequenceData(
            list(prompt_token_ids), eos_token_id=eos_token_id, token_type_ids=token_type_ids
        )
        self.output_logprobs: SampleLogprobs = []
        self.output_text = ""
        self.status = SequenceStatus.WAITING
        self.stop_reason: int | str | None = None
        # Incremental detokenization state (see engine/detokenizer.py).
        self.tokens: list[str] | None = None
        self.prefix_offset = 0
        self.read_offset = 0
        # (characters of text, output tokens) already returned under output_kind=DELTA.
        self.delta_offsets = (0, 0)
        # What the first and last stages hold of this sequence (None: nothing), written by
        # the scheduler's step writer once the executor accepted the step that told them.
        self.held: HeldBySequence | None = None

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.data.prompt_token_ids

    @property
    def n_blocks(self) -> int:
        """KV blocks this sequence occupies once all its tokens are in the cache."""
        return math.ceil(self.get_len() / self.block_size)

    def append_token_id(self, token_id: int, logprobs: dict[int, Logprob]) -> None:
        assert token_id in logprobs, "the sampled token must carry its own logprob"
        self.output_logprobs.append(logprobs)
        self.data.append_token_id(token_id, logprobs[token_id].logprob)

    def get_len(self) -> int:
        return self.data.get_len()

    def get_prompt_len(self) -> int:
        return self.data.get_prompt_len()

    def get_output_len(self) -> int:
        return self.data.get_output_len()

    def get_token_ids(self) -> list[int]:
        return self.data.get_token_ids()

    def get_output_token_ids(self) -> list[int]:
        return self.data.output_token_ids

    def get_last_token_id(self) -> int:
        return self.data.get_last_token_id()

    def get_cumulative_logprob(self) -> float:
        return self.data.cumulative_logprob

    def get_beam_search_score(self, length_penalty: float = 1.0) -> float:
        """This sequence's beam-search hypothesis score (see `beam_search_score`)."""
        return beam_search_score(
            self.get_cumulative_logprob(), self.get_output_len(), length_penalty
        )

    def is_finished(self) -> bool:
        return SequenceStatus.is_finished(self.status)

    def fork(self, new_seq_id: int) -> Sequence:
        new_seq = copy.deepcopy(self)
        new_seq.seq_id = new_seq_id
        new_seq.held = None  # the stages know the parent, not the child
        return new_seq

    def fork_light(self, new_seq_id: int) -> Sequence:
        """A fork that copies only what the child will change and shares the rest.

        Beam search forks every surviving beam at every step; a deep copy of the whole history
        (token lists, one logprob dict per token) would cost O(length) objects per beam per
        step. The prompt ids and the existing logprob entries are never mutated after they
        are appended, so sharing them is safe."""
        new_seq = copy.copy(self)
        new_seq.seq_id = new_seq_id
        new_seq.held = None  # the stages know the parent, not the child
        new_seq.data = SequenceData(
            self.data.prompt_token_ids,
            list(self.data.output_token_ids),
            self.data.cumulative_logprob,
            self.data.eos_token_id,
            self.data._num_computed_tokens,
            self.data._stage,
            self.data.sample_index,
            self.data.token_type_ids,
        )
        new_seq.output_logprobs = list(self.output_logprobs)
        new_seq.tokens = None if self.tokens is None else list(self.tokens)
        return new_seq

    def reset_for_recompute(self) -> None:
        """Preempted by recompute: its whole token list is prefilled again when rescheduled."""
        self.status = SequenceStatus.WAITING
        self.data.reset_state_for_recompute()

    def is_prefill(self) -> bool:
        return self.data.stage == SequenceStage.PREFILL

    def get_num_new_tokens(self) -> int:
        """Tokens the next step feeds for this sequence: one when decoding, else every
        token whose KV is not in the cache yet."""
        if self.data.stage == SequenceStage.DECODE:
            return 1
        return self.data.get_num_uncomputed_tokens()

    def __repr__(self) -> str:
        return (
            f"Sequence(seq_id={self.seq_id}, status={self.status.name}, num_blocks={self.n_blocks})"
        )


class HeldBySequence(NamedTuple):
    """What the first and last stages hold of one sequence (vLLM V1 keeps such facts on its
    `Request`): the step records send only what lies beyond it."""

    # Token ids the stages hold (the engine's tokens plus any they append themselves for a
    # decode scheduled ahead).
    num_tokens: int
    # Leading block-table entries the stages hold, and the block manager's table epoch they
    # belong to (`BlockSpaceManager.table_epoch`: it changes when an entry is rewritten).
    num_blocks: int
    table_epoch: int


class Flight(NamedTuple):
    """One step of a group inside the pipeline."""

    # Tokens the step feeds (the chunk of a prefill; 1 for a decode).
    num_tokens: int
    # The step's number (`BatchQueue`'s).
    step_no: int
    # A speculative step: its sequences verify draft tokens, so how many tokens it yields
    # is known only when it is back (no step may be scheduled ahead of it).
    speculative: bool = False


class SequenceGroup:
    """The sequences generated from one prompt (one request): n/best_of samples or beams.

    It also carries the request's in-flight facts, as vLLM V1 keeps its output placeholders on
    its `Request`: written only by the scheduler (when it schedules the group, when a step
    comes back, on abort and on re-queue), read by it and its policies."""

    def __init__(
        self,
        request_id: str,
        seqs: list[Sequence],
        sampling_params: SamplingParams,
        arrival_time: float,
        lora_request: LoRARequest | None = None,
        pooling_params: PoolingParams | None = None,
    ) -> None:
        self.request_id = request_id
        # A pooling request (embed, classify, score, encode): its prompt runs through every
        # stage once and the last stage pools; `sampling_params` is then the engine's
        # one-token placeholder (scheduling treats it as a prompt that ends after prefill).
        self.pooling_params = pooling_params
        # What the last stage pooled for it (a torch tensor; set once, when it finishes).
        self.pooled_data: Any = None
        # The adapter the request runs with (None: the base model).
        self.lora_request = lora_request
        self.seqs_dict = {seq.seq_id: seq for seq in seqs}
        self.sampling_params = sampling_params
        self.metrics = RequestMetrics(arrival_time=arrival_time, last_token_time=arrival_time)
        self.prompt_logprobs: PromptLogprobs | None = None
        # Prompt logprobs of the prefill chunks received so far (complete: prompt_logprobs).
        self.partial_prompt_logprobs: PromptLogprobs = []
        # How many sequences of this group ever got preempted (reported by masstest).
        self.num_preemptions = 0
        # Set once the engine returned the group's finished RequestOutput: a step still in
        # flight when it finished (scheduled ahead, or aborted) comes back without another.
        self.final_output_returned = False
        # Its steps inside the pipeline, oldest first: until its last one is back the group
        # is in flight and is not rescheduled (unless ahead), preempted, swapped or freed.
        self.flights: collections.deque[Flight] = collections.deque()
        # Aborted while a step was in flight: its blocks are freed when the last step returns.
        self.abort_pending = False
        # Sequences that finished while a step was in flight (one scheduled ahead): their
        # blocks are freed when that step returns.
        self.deferred_free: list[Sequence] = []
        # The stages' generation (`StepWriter.generation`) in which the first and last stages
        # were sent this request in full; any other value: they do not hold it (never sent,
        # preempted since, or the stages forgot every request).
        self.held_generation = -1

    def is_in_flight(self) -> bool:
        """Whether a step of this group is inside the pipeline."""
        return bool(self.flights)

    def prefill_tokens_in_flight(self) -> int:
        """Prompt tokens of this group's prefill chunks inside the pipeline: with chunked
        pipelining several chunks of one prompt may be in flight at once (each stage runs
        them in step order), and the next one starts after all of them."""
        if not self.is_prefill():
            return 0
        return sum(flight.num_tokens for flight in self.flights)

    def clear_flights(self) -> None:
        """Forget every step in flight and what waited for them (the pipeline was emptied)."""
        self.flights.clear()
        self.abort_pending = False
        self.deferred_free = []

    @property
    def arrival_time(self) -> float:
        return self.metrics.arrival_time

    @property
    def prompt(self) -> str | None:
        return next(iter(self.seqs_dict.values())).prompt

    @property
    def prompt_token_ids(self) -> list[int]:
        return next(iter(self.seqs_dict.values())).prompt_token_ids

    def maybe_set_first_scheduled_time(self, now: float) -> None:
        """Record the first time the scheduler picked this group (a recompute keeps it)."""
        if self.metrics.first_scheduled_time is None:
            self.metrics.first_scheduled_time = now
            self.metrics.time_in_queue = now - self.arrival_time

    def record_token_time(self, now: float) -> None:
        """A step brought this group new tokens; finishing stamps `finished_time` too."""
        if self.metrics.first_token_time is None:
            self.metrics.first_token_time = now
        self.metrics.last_token_time = now
        if self.metrics.finished_time is None and self.is_finished():
            self.metrics.finished_time = now

    @property
    def lora_int_id(self) -> int:
        """The adapter's id, 0 for the base model."""
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    def is_prefill(self) -> bool:
        """Whether the group's (single) unfinished sequence still has prompt KV to compute."""
        seqs = self.get_unfinished_seqs()
        return bool(seqs) and seqs[0].is_prefill()

    def get_max_num_running_seqs(self) -> int:
        """The most sequences this group can have running at once (for the seq budget)."""
        if self.sampling_params.use_beam_search:
            return self.sampling_params.best_of
        if self.sampling_params.best_of > self.num_seqs():
            # Still in the prompt phase: it forks into best_of sequences after the first token.
            return self.sampling_params.best_of
        return self.num_unfinished_seqs()

    def get_seqs(self, status: SequenceStatus | None = None) -> list[Sequence]:
        if status is None:
            return list(self.seqs_dict.values())
        return [seq for seq in self.seqs_dict.values() if seq.status == status]

    def get_unfinished_seqs(self) -> list[Sequence]:
        return [seq for seq in self.seqs_dict.values() if not seq.is_finished()]

    def get_finished_seqs(self) -> list[Sequence]:
        return [seq for seq in self.seqs_dict.values() if seq.is_finished()]

    def num_seqs(self, status: SequenceStatus | None = None) -> int:
        return len(self.get_seqs(status))

    def num_unfinished_seqs(self) -> int:
        return len(self.get_unfinished_seqs())

    def find(self, seq_id: int) -> Sequence:
        if seq_id not in self.seqs_dict:
            raise ValueError(f"Sequence {seq_id} not found.")
        return self.seqs_dict[seq_id]

    def add(self, seq: Sequence) -> None:
        if seq.seq_id in self.seqs_dict:
            raise ValueError(f"Sequence {seq.seq_id} already exists.")
        self.seqs_dict[seq.seq_id] = seq

    def remove(self, seq_id: int) -> None:
        if seq_id not in self.seqs_dict:
            raise ValueError(f"Sequence {seq_id} not found.")
        del self.seqs_dict[seq_id]

    def is_finished(self) -> bool:
        return all(seq.is_finished() for seq in self.seqs_dict.values())

    def __repr__(self) -> str:
        return (
            f"SequenceGroup(request_id={self.request_id}, "
            f"sampling_params={self.sampling_params}, num_seqs={len(self.seqs_dict)})"
        )


@dataclass
class SequenceGroupMetadata:
    """What the model runner reads of one group for one step: a row the first or last stage's
    request table rebuilds from the step records (`vllm.worker.request_table`; a replay
    step's rows without the table). Never sent to a stage: the step records are.

    `is_prompt` groups feed `token_chunk_size` tokens after the ones already computed
    (`SequenceData.get_num_computed_tokens`): the whole prompt, one chunk of it (chunked
    prefill), or the part after a cached prefix (prefix caching); also after recompute-
    preemption. The others feed only their last token (a decode). `do_sample` is False for a
    prefill chunk that does not reach the end of the prompt: nothing is sampled for it.
    """

    request_id: str
    is_prompt: bool
    seq_data: dict[int, SequenceData]
    sampling_params: SamplingParams
    block_tables: dict[int, list[int]]
    token_chunk_size: int | None = None
    do_sample: bool = True
    # The request's LoRA adapter id (0: the base model).
    lora_int_id: int = 0
    # A pooling request's parameters (None: a generation request); the last stage pools its
    # hidden states instead of sampling.
    pooling_params: PoolingParams | None = None
    # A speculative decode: seq id -> the draft tokens it verifies (its last token and these
    # are fed at once, every position sampled; `vllm.spec_decode`). None: a plain step.
    draft_token_ids: dict[int, list[int]] | None = None

    def __post_init__(self) -> None:
        if self.token_chunk_size is None:
            if self.is_prompt:
                data = next(iter(self.seq_data.values()))
                self.token_chunk_size = data.get_num_uncomputed_tokens()
            else:
                self.token_chunk_size = 1


@dataclass
class SequenceOutput:
    """One sampled token for one sequence; `parent_seq_id` says which sequence it extends.

    After a speculative step, `accepted` holds the draft tokens the target model confirmed
    (each with its logprobs, in order): they come before `output_token`, which is the token
    the target sampled after them."""

    parent_seq_id: int
    output_token: int
    logprobs: dict[int, Logprob]
    accepted: list[tuple[int, dict[int, Logprob]]] | None = None


@dataclass
class SequenceGroupOutput:
    """The samples of one group in one step, plus its prompt logprobs on the prompt step."""

    samples: list[SequenceOutput]
    prompt_logprobs: PromptLogprobs | None = None
    # Set when the group's own sampling work raised (its logits processor...): the samples
    # are placeholders that keep the stages in step, and the engine fails the request.
    error: str | None = None
    # A pooling request's pooled data (a torch tensor, on the last chunk of its prompt).
    pooled: Any = None
    # With `error`: the request is not at fault (the last stage lost the hidden states of its
    # earlier chunks, being replaced meanwhile): it is recomputed, not failed.
    recompute: bool = False


# The last stage returns one SequenceGroupOutput per scheduled group, in schedule order.
SamplerOutput = list[SequenceGroupOutput]
