"""Sampling parameters for text generation, with vLLM's (V0, ~0.5.x) fields and messages.

Scripts written against vLLM construct ``SamplingParams`` with the same keywords (or the same
positional order), get the same normalisation and see the same ``ValueError`` texts. This module
imports no torch: the scheduler, the sequence bookkeeping and their tests use it.
"""

from __future__ import annotations

import copy
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum
from functools import cached_property
from typing import Any, Literal, overload

from vllm.structured_output.params import GuidedDecodingParams, StructuredOutputsParams

__all__ = [
    "GuidedDecodingParams",
    "RequestOutputKind",
    "SamplingParams",
    "SamplingType",
    "StructuredOutputsParams",
]

# The engine holds integer parameters in int64 tensors (top-k filtering, seeded generators,
# token ids): a larger value passed validation once and killed the engine in the sampler.
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
# Fields checked against the int64 range (seed also against its lower bound).
_INT64_FIELDS = (
    "n", "best_of", "top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs",
    "truncate_prompt_tokens",
)  # fmt: skip

# Temperatures below this are greedy decoding; vLLM uses the same threshold, so a script that
# passes temperature=1e-6 gets greedy outputs here too.
_SAMPLING_EPS = 1e-5

# A logits processor maps (output_token_ids, logits) -- or (prompt_token_ids, output_token_ids,
# logits) -- to new logits. Typed loosely so that this module needs no torch.
LogitsProcessor = Callable[..., Any]

# Boolean switches: a string such as "False" would be truthy, so only bools and ints pass.
_FLAG_FIELDS = (
    "use_beam_search", "include_stop_str_in_output", "ignore_eos", "detokenize",
    "skip_special_tokens", "spaces_between_special_tokens",
)  # fmt: skip
_FLOAT_FIELDS = (
    "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p",
    "min_p", "length_penalty",
)  # fmt: skip
# vLLM's __repr__ lists these, in this order (detokenize and logits_processors are left out).
_REPR_FIELDS = (
    "n", "best_of", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "temperature", "top_p", "top_k", "min_p", "seed", "use_beam_search", "length_penalty",
    "early_stopping", "stop", "stop_token_ids", "include_stop_str_in_output", "ignore_eos",
    "max_tokens", "min_tokens", "logprobs", "prompt_logprobs", "skip_special_tokens",
    "spaces_between_special_tokens", "truncate_prompt_tokens",
)  # fmt: skip


class SamplingType(IntEnum):
    """How the sampler picks the next token for a sequence group."""

    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2
    BEAM = 3


class RequestOutputKind(IntEnum):
    """What each RequestOutput of a request carries (vLLM's names).

    CUMULATIVE: everything generated so far, every step. DELTA: only the tokens and text that
    are new since the request's previous output. FINAL_ONLY: one output, when it finishes
    (what `LLM.generate` uses: it never looks at the partial ones, so none are built)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


class SamplingParamsTypeError(TypeError, ValueError):
    """A sampling parameter of the wrong type.

    vLLM itself raises ValueError for a non-int ``n`` but TypeError for a non-int ``top_k``;
    deriving from both lets callers written for either (or catching ValueError to turn bad
    requests into 400s) handle every type error here.
    """


@overload
def _as_int(name: str, value: Any, *, optional: Literal[False] = False) -> int: ...


@overload
def _as_int(name: str, value: Any, *, optional: bool) -> int | None: ...


def _as_int(name: str, value: Any, *, optional: bool = False) -> int | None:
    """Return ``value`` as a plain int (numpy ints accepted); bools and floats are rejected."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise SamplingParamsTypeError(f"{name} must be an int, but is of type {type(value)}")
    return int(value)


def _as_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise SamplingParamsTypeError(f"{name} must be a float, but is of type {type(value)}")
    return float(value)


def _as_list(name: str, value: Any) -> list[Any]:
    # A bare scalar or a dict would otherwise fail later with an error that does not name it.
    if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__iter__"):
        raise SamplingParamsTypeError(f"{name} must be a list, but is of type {type(value)}")
    return list(value)


@dataclass(repr=False)
class SamplingParams:
    """Sampling parameters for text generation (vLLM-compatible).

    Follows the OpenAI completions API, plus beam search. ``n`` outputs are returned out of
    ``best_of`` generated ones (default ``best_of = n``; it is the beam width with
    ``use_beam_search``). ``temperature`` below 1e-5 means greedy decoding. ``top_k=-1`` and
    ``top_p=1`` / ``min_p=0`` disable those filters. ``stop`` strings end generation and are cut
    from the text unless ``include_stop_str_in_output``; ``stop_token_ids`` end it and are kept.
    ``max_tokens=None`` generates up to the model's context length. ``logprobs`` and
    ``prompt_logprobs`` ask for that many top log-probabilities per token;
    ``truncate_prompt_tokens=k`` keeps only the last k prompt tokens. Invalid values raise
    ``ValueError`` with vLLM's message; wrong types raise ``SamplingParamsTypeError`` (both a
    ValueError and a TypeError).
    """

    n: int = 1
    # The constructor takes None (best_of, stop, stop_token_ids) or a single stop string;
    # __post_init__ normalizes them, and the annotations give the type they then have.
    best_of: int = None  # type: ignore[assignment]
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    stop: list[str] = None  # type: ignore[assignment]
    stop_token_ids: list[int] = None  # type: ignore[assignment]
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logits_processors: list[LogitsProcessor] | None = None
    truncate_prompt_tokens: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # A constraint on the output (JSON schema, regex, choice, grammar): vLLM's current name,
    # and the 0.6-era one (converted to the former).
    structured_outputs: StructuredOutputsParams | None = None
    guided_decoding: GuidedDecodingParams | None = None
    # vLLM's later fields (the OpenAI server's `logit_bias` and `allowed_token_ids`): a bias
    # added to the logit of each token id, and the only token ids that may be sampled. Their
    # ids are checked against the vocabulary when the request is added.
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    # Derived in __post_init__, not constructor arguments.
    output_text_buffer_length: int = field(default=0, init=False)
    _all_stop_token_ids: set[int] = field(default_factory=set, init=False)

    def __post_init__(self) -> None:
        self._normalize_structured_outputs()
        self._normalize()
        # The detokenizer holds back this many characters: they may be the start of a stop
        # string that must not reach the user.
        if self.stop and not self.include_stop_str_in_output:
            self.output_text_buffer_length = max(len(s) for s in self.stop) - 1
        self._verify_args()
        if self.use_beam_search:
            self._verify_beam_search()
        else:
            self._verify_non_beam_search()
            if self.temperature < _SAMPLING_EPS:
                # Greedy decoding ignores the filters; resetting them lets the sampler skip them.
                self.top_p = 1.0
                self.top_k = -1
                self.min_p = 0.0
                self._verify_greedy_sampling()
        # The engine adds the model's EOS id(s) here via update_from_generation_config.
        self._all_stop_token_ids = set(self.stop_token_ids)

    def _normalize_structured_outputs(self) -> None:
        guided = self.guided_decoding
        if isinstance(guided, dict):
            guided = GuidedDecodingParams(**guided)
        if guided is not None and not isinstance(guided, GuidedDecodingParams):
            raise SamplingParamsTypeError(
                f"guided_decoding must be a GuidedDecodingParams, but is of type {type(guided)}"
            )
        structured = self.structured_outputs
        if isinstance(structured, dict):
            structured = StructuredOutputsParams.from_dict(structured)
        if structured is not None and not isinstance(structured, StructuredOutputsParams):
            raise SamplingParamsTypeError(
                "structured_outputs must be a StructuredOutputsParams, but is of type "
                f"{type(structured)}"
            )
        if guided is not None:
            if structured is not None:
                raise ValueError(
                    "Cannot set both structured_outputs and guided_decoding; "
                    "guided_decoding is the older name of structured_outputs."
                )
            # An all-None GuidedDecodingParams (vLLM's default object) asks for nothing.
            if not all(
                getattr(guided, k) is None
                for k in ("json", "regex", "choice", "grammar", "json_object")
            ):
                structured = guided.to_structured_outputs()
        if structured is not None and structured.all_constraints_none():
            structured = None  # only options (e.g. disable_any_whitespace): nothing to match
        self.guided_decoding = guided
        self.structured_outputs = structured
        if structured is not None and self.use_beam_search:
            raise ValueError("structured_outputs is not supported with beam search.")

    def _normalize(self) -> None:
        self.n = _as_int("n", self.n)
        self.best_of = self.n if self.best_of is None else _as_int("best_of", self.best_of)
        for name in _FLOAT_FIELDS:
            setattr(self, name, _as_float(name, getattr(self, name)))
        self.top_k = _as_int("top_k", self.top_k)
        self.seed = _as_int("seed", self.seed, optional=True)
        if self.seed == -1:  # OpenAI-style clients send -1 for "no seed"
            self.seed = None
        self.max_tokens = _as_int("max_tokens", self.max_tokens, optional=True)
        self.min_tokens = _as_int("min_tokens", self.min_tokens)
        self.truncate_prompt_tokens = _as_int(
            "truncate_prompt_tokens", self.truncate_prompt_tokens, optional=True
        )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            # The chat API's logprobs=True means "the chosen token's logprob": one entry.
            if isinstance(value, bool):
                value = int(value)
            setattr(self, name, _as_int(name, value, optional=True))
        for name in _FLAG_FIELDS:
            value = getattr(self, name)
            # bool is Integral; numpy bools (dtype kind "b") are accepted too.
            is_np_bool = getattr(getattr(value, "dtype", None), "kind", None) == "b"
            if not isinstance(value, numbers.Integral) and not is_np_bool:
                raise SamplingParamsTypeError(
                    f"{name} must be a bool, but is of type {type(value)}"
                )
            setattr(self, name, bool(value))

        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = _as_list("stop", self.stop)
        if not all(isinstance(s, str) for s in self.stop):
            raise SamplingParamsTypeError("stop must be a string or a list of strings")
        ids = [] if self.stop_token_ids is None else _as_list("stop_token_ids", self.stop_token_ids)
        self.stop_token_ids = [_as_int("stop_token_ids", t) for t in ids]
        kind = self.output_kind
        if isinstance(kind, bool) or not isinstance(kind, numbers.Integral):
            raise SamplingParamsTypeError(
                f"output_kind must be a RequestOutputKind, but is of type {type(kind)}"
            )
        if kind not in tuple(RequestOutputKind):
            raise ValueError(
                f"output_kind must be one of {[k.name for k in RequestOutputKind]}, got {kind}."
            )
        self.output_kind = RequestOutputKind(kind)
        if self.logits_processors is not None:
            self.logits_processors = _as_list("logits_processors", self.logits_processors)
            if not all(callable(lp) for lp in self.logits_processors):
                raise SamplingParamsTypeError("logits_processors must be a list of callables")
        self._normalize_token_constraints()

    def _normalize_token_constraints(self) -> None:
        """`logit_bias` keys as int token ids (OpenAI sends them as strings), biases as
        finite floats; `allowed_token_ids` as a non-empty list of ints."""
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise SamplingParamsTypeError(
                    f"logit_bias must be a dict, but is of type {type(self.logit_bias)}"
                )
            bias: dict[int, float] = {}
            for key, value in self.logit_bias.items():
                try:
                    token_id = int(key)
                except (TypeError, ValueError) as exc:
                    raise ValueError(
                        "logit_bias: found token_id that is not an integer or string "
                        f"representing an integer: {key!r}"
                    ) from exc
                value = _as_float("logit_bias", value)
                if not math.isfinite(value):
                    raise ValueError(f"logit_bias must be finite, got {value} for {token_id}.")
                bias[token_id] = value
            self.logit_bias = bias or None
        if self.allowed_token_ids is not None:
            ids = _as_list("allowed_token_ids", self.allowed_token_ids)
            self.allowed_token_ids = [_as_int("allowed_token_ids", t) for t in ids]
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids is not None and empty!")

    def _verify_int64(self) -> None:
        """Every integer within what an int64 tensor holds (vLLM's protocol bounds seed the
        same way), so no value can overflow a tensor inside a stage."""
        for name in _INT64_FIELDS:
            value = getattr(self, name)
            if value is not None and not INT64_MIN <= value <= INT64_MAX:
                raise ValueError(
                    f"{name} must be in the int64 range [{INT64_MIN}, {INT64_MAX}], got {value}."
                )
        for token_id in self.stop_token_ids:
            if not 0 <= token_id <= INT64_MAX:
                raise ValueError(
                    f"stop_token_ids must be non-negative int64 token ids, got {token_id}."
                )

    def _verify_args(self) -> None:
        self._verify_int64()
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}.")
        if self.best_of < self.n:
            raise ValueError(
                "best_of must be greater than or equal to n, "
                f"got n={self.n} and best_of={self.best_of}."
            )
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(
                f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}."
            )
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        # vLLM lets nan/inf through and the sampler then produces garbage or crashes.
        if not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be a finite number, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < -1 or self.top_k == 0:
            raise ValueError(f"top_k must be -1 (disable), or at least 1, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.min_tokens < 0:
            raise ValueError(
                f"min_tokens must be greater than or equal to 0, got {self.min_tokens}."
            )
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                "min_tokens must be less than or equal to "
                f"max_tokens={self.max_tokens}, got {self.min_tokens}."
            )
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be non-negative, got {self.logprobs}.")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise ValueError(f"prompt_logprobs must be non-negative, got {self.prompt_logprobs}.")
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens < 1:
            raise ValueError(
                f"truncate_prompt_tokens must be >= 1, got {self.truncate_prompt_tokens}"
            )
        if any(not s for s in self.stop):
            raise ValueError("stop cannot contain an empty string.")
        if self.stop and not self.detokenize:
            raise ValueError(
                "stop strings are only supported when detokenize is True. "
                "Set detokenize=True to use stop."
            )

    def _verify_beam_search(self) -> None:
        if self.best_of == 1:
            raise ValueError(
                f"best_of must be greater than 1 when using beam search. Got {self.best_of}."
            )
        if self.temperature > _SAMPLING_EPS:
            raise ValueError("temperature must be 0 when using beam search.")
        if self.top_p < 1.0 - _SAMPLING_EPS:
            raise ValueError("top_p must be 1 when using beam search.")
        if self.top_k != -1:
            raise ValueError("top_k must be -1 when using beam search.")
        if self.output_kind == RequestOutputKind.DELTA:
            # Beams are re-forked every step: a beam's "new tokens" have no stable meaning.
            raise ValueError("output_kind=DELTA is not supported with beam search.")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(
                f"early_stopping must be True, False, or 'never', got {self.early_stopping}."
            )
        # vLLM lets a nan/inf length penalty through; it would corrupt the beam scores.
        if not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty}.")

    def _verify_non_beam_search(self) -> None:
        if self.early_stopping is not False:
            raise ValueError(
                "early_stopping is not effective and must be False when not using beam search."
            )
        if not 1.0 - _SAMPLING_EPS <= self.length_penalty <= 1.0 + _SAMPLING_EPS:
            raise ValueError(
                "length_penalty is not effective and must be the "
                "default value of 1.0 when not using beam search."
            )

    def _verify_greedy_sampling(self) -> None:
        # Several greedy samples of one prompt would all be identical.
        if self.best_of > 1:
            raise ValueError(f"best_of must be 1 when using greedy sampling. Got {self.best_of}.")

    def update_from_generation_config(
        self, generation_config: dict[str, Any], model_eos_token_id: int | None = None
    ) -> None:
        """Merge the EOS id(s) of the model's generation_config into the stop conditions."""
        if model_eos_token_id is not None:
            # min_tokens must also suppress the primary EOS, so it joins the full stop set.
            self._all_stop_token_ids.add(model_eos_token_id)
        eos_ids = generation_config.get("eos_token_id")
        if eos_ids is None:
            return
        eos_ids = {eos_ids} if isinstance(eos_ids, int) else set(eos_ids)
        # The primary EOS is checked separately by the engine; keep it out of stop_token_ids.
        eos_ids.discard(model_eos_token_id)
        if eos_ids:
            self._all_stop_token_ids.update(eos_ids)
            if not self.ignore_eos:
                self.stop_token_ids = list(eos_ids.union(self.stop_token_ids))

    @cached_property
    def sampling_type(self) -> SamplingType:
        if self.use_beam_search:
            return SamplingType.BEAM
        if self.temperature < _SAMPLING_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    @property
    def all_stop_token_ids(self) -> set[int]:
        """stop_token_ids plus the model's EOS id(s): tokens min_tokens must suppress."""
        return self._all_stop_token_ids

    @all_stop_token_ids.setter
    def all_stop_token_ids(self, value: set[int]) -> None:
        # vLLM 0.5 exposed a plain attribute, so engine code may assign it.
        self._all_stop_token_ids = set(value)

    def clone(self) -> SamplingParams:
        """Deep copy that shares the logits processors.

        Processors can hold arbitrary amounts of state (even models); every sequence group
        gets its own clone, so copying them would be slow and could break stateful ones.
        """
        memo = {id(lp): lp for lp in self.logits_processors or ()}
        return copy.deepcopy(self, memo=memo)

    def __repr__(self) -> str:
        body = ", ".join(f"{name}={getattr(self, name)}" for name in _REPR_FIELDS)
        if self.structured_outputs is not None:
            body += f", structured_outputs={self.structured_outputs}"
        return f"SamplingParams({body})"
