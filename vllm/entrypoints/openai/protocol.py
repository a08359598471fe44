"""The OpenAI API's request and response bodies (pydantic), with vLLM's extra sampling fields.

Requests turn into SamplingParams with `to_sampling_params`; a bad value raises the
SamplingParams ValueError (vLLM's wording), which the server returns as a 400 naming the
parameter. Unknown fields are logged and ignored, as vLLM does; the OpenAI fields this server
knows but does not implement are refused with a 400 naming them (structured_fields.py).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator
from pydantic_core import PydanticCustomError

from vllm.entrypoints.openai.openai_fields import (
    check_metadata,
    check_reasoning_effort,
    check_service_tier,
    check_store,
    check_verbosity,
)
from vllm.entrypoints.openai.structured_fields import (
    check_unsupported,
    structured_outputs_from_request,
)
from vllm.logger import init_logger
from vllm.sampling_params import RequestOutputKind, SamplingParams

logger = init_logger(__name__)


def random_uuid() -> str:
    return uuid.uuid4().hex


class OpenAIBaseModel(BaseModel):
    """Keeps unknown fields aside (`model_extra`) and logs them as vLLM does: clients send
    newer OpenAI fields than the server knows, and a dropped one must at least be visible."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    @model_validator(mode="wrap")
    @classmethod
    def _log_extra_fields(cls, data: Any, handler: Any) -> Any:
        result = handler(data)
        if isinstance(data, dict):
            names = set(cls.model_fields)
            names |= {f.alias for f in cls.model_fields.values() if f.alias}
            extra = data.keys() - names
            if extra:
                logger.warning(
                    "The following fields were present in the request but ignored: %s", extra
                )
        return result


class ErrorResponse(OpenAIBaseModel):
    """OpenAI's error body."""

    object: str = "error"
    message: str
    type: str
    param: str | None = None
    code: int


# The batch-file lines of `vllm run-batch` and /v1/batches (batch_lines.py), where vLLM has them.
class BatchRequestInput(OpenAIBaseModel):
    """One line of a batch input file."""

    custom_id: str
    method: str
    url: str
    body: dict[str, Any]


class BatchResponseData(OpenAIBaseModel):
    """The HTTP answer a batch line got: its status, an id, the body when it succeeded."""

    status_code: int = 200
    request_id: str
    body: dict[str, Any] | None = None


class BatchRequestOutput(OpenAIBaseModel):
    """One line of a batch output (or error) file: a failed line has `response.body` None and
    the error body in `error`; a line that was not JSON has `custom_id` None."""

    id: str
    custom_id: str | None
    response: BatchResponseData | None
    error: Any | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.response is not None and self.response.status_code == 200


class ModelPermission(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"modelperm-{random_uuid()}")
    object: str = "model_permission"
    created: int = Field(default_factory=lambda: int(time.time()))
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class ModelCard(OpenAIBaseModel):
    id: str
    object: str = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "vllm"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    permission: list[ModelPermission] = Field(default_factory=lambda: [ModelPermission()])


class ModelList(OpenAIBaseModel):
    object: str = "list"
    data: list[ModelCard] = Field(default_factory=list)


class LoadLoRAAdapterRequest(OpenAIBaseModel):
    """`POST /v1/load_lora_adapter` (vLLM's): serve the PEFT adapter at `lora_path` as the
    model `lora_name` (`load_inplace`: replacing the adapter served under that name)."""

    lora_name: str
    lora_path: str
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(OpenAIBaseModel):
    """`POST /v1/unload_lora_adapter` (vLLM's): stop serving the adapter `lora_name`."""

    lora_name: str
    lora_int_id: int | None = None


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int | None = 0


class JsonSchemaResponseFormat(OpenAIBaseModel):
    """`response_format.json_schema`: OpenAI's structured outputs."""

    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIBaseModel):
    """`response_format`: text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaResponseFormat | None = None


class _SamplingFields(OpenAIBaseModel):
    """Fields shared by completions and chat: OpenAI's, then vLLM's extras."""

    model: str | None = None
    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    # Outside int64 (what vLLM's torch.long bound allows) it is a 400 naming it, from
    # SamplingParams' int64 check.
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    # vLLM's extras
    use_beam_search: bool = False
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    length_penalty: float = 1.0
    early_stopping: bool = False
    stop_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    prompt_logprobs: int | None = None
    # Structured outputs: OpenAI's response_format, vLLM's object and its older extras.
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    return_tokens_as_token_ids: bool | None = None  # vLLM: per request, as the server flag
    _structured_param: str = PrivateAttr(default="structured_outputs")

    @model_validator(mode="before")
    @classmethod
    def validate_stream_options(cls, data: Any) -> Any:
        """vLLM's check (and message): stream_options only with stream=true."""
        if isinstance(data, dict) and data.get("stream_options") and not data.get("stream"):
            raise ValueError("Stream options can only be defined when `stream=True`.")
        if isinstance(data, dict) and data.get("prompt_logprobs") and data.get("stream"):
            # vLLM's rule: the prompt's logprobs come in the whole response only.
            raise ValueError("`prompt_logprobs` are not available when `stream=True`.")
        return data

    def _params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        temp: float,
        tool_schema: dict[str, Any] | None = None,
        prompt_logprobs: int | None = None,
    ) -> Any:
        check_unsupported(self.model_extra or {})
        structured, self._structured_param = structured_outputs_from_request(self, tool_schema)
        for token, bias in (self.logit_bias or {}).items():
            # OpenAI's range (vLLM clamps; a value outside it is a client's mistake).
            if not -100.0 <= bias <= 100.0:
                raise ParameterError(
                    f"logit_bias values must be in [-100, 100], got {bias} for token {token}.",
                    "logit_bias",
                )
        if self.stream and self.best_of is not None and self.best_of != self.n:
            raise ParameterError("best_of must equal n when streaming.", "best_of")
        if self.stream and self.use_beam_search:
            raise ParameterError("Streaming is not supported with beam search.", "stream")
        kind = RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY
        return SamplingParams(
            n=self.n,
            best_of=self.best_of,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            temperature=temp if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            use_beam_search=self.use_beam_search,
            length_penalty=self.length_penalty,
            early_stopping=self.early_stopping,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=(
                self.prompt_logprobs if self.prompt_logprobs is not None else prompt_logprobs
            ),
            logit_bias=self.logit_bias,
            allowed_token_ids=self.allowed_token_ids,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            output_kind=kind,
            structured_outputs=structured,
        )

    @property
    def structured_param(self) -> str:
        """The field that set the request's constraint (after `to_sampling_params`)."""
        return self._structured_param


class ParameterError(ValueError):
    """A request field the server refuses (not a SamplingParams error)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    def to_sampling_params(self) -> SamplingParams:
        if self.suffix:
            raise ParameterError("suffix is not supported by this server.", "suffix")
        # vLLM: with echo, the prompt tokens get logprobs too (the first one None).
        echo_logprobs = self.logprobs if self.echo else None
        return self._params(self.max_tokens, self.logprobs, 1.0, None, echo_logprobs)


# Every field of OpenAI's chat message types (system, user, assistant, tool, function).
_MESSAGE_FIELDS = frozenset(
    {"role", "content", "name", "tool_calls", "tool_call_id", "function_call", "refusal", "audio"}
)


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = 0
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM: the reply continues the last message
    add_special_tokens: bool = False  # vLLM: the template already holds them
    echo: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = True
    # OpenAI fields that change no token here: honoured as OpenAI means them (a template
    # kwarg, the one tier and verbosity this server has, hints) or a 400 (openai_fields.py).
    reasoning_effort: str | None = None
    verbosity: str | None = None
    service_tier: str | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    prompt_cache_key: str | None = None  # a routing hint: one server has nothing to route
    safety_identifier: str | None = None  # an end-user id for abuse monitoring, as `user`

    @field_validator("messages")
    @classmethod
    def _no_unknown_message_fields(cls, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """A message field OpenAI's message types do not have is refused (pydantic's
        `extra_forbidden`, as vLLM's typed messages refuse it)."""
        for i, message in enumerate(messages):
            extra = sorted(str(k) for k in message if k not in _MESSAGE_FIELDS)
            if extra:
                raise PydanticCustomError(
                    "extra_forbidden",
                    "Extra inputs are not permitted: messages[{index}] has {fields}",
                    {"index": i, "fields": ", ".join(extra)},
                )
        return messages

    def to_sampling_params(self, tool_schema: dict[str, Any] | None = None) -> SamplingParams:
        """`tool_schema`: the JSON schema a `required` or named tool_choice imposes."""
        if self.continue_final_message and self.add_generation_prompt:
            raise ParameterError(  # vLLM's check and message
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                "continue_final_message",
            )
        check_reasoning_effort(self.reasoning_effort)
        check_verbosity(self.verbosity)
        check_service_tier(self.service_tier)
        check_store(self.store)
        check_metadata(self.metadata)
        if self.top_logprobs and not self.logprobs:
            raise ParameterError("top_logprobs needs logprobs=true.", "top_logprobs")
        # 0 is a value (refused as below 1), not "no limit".
        max_tokens = (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        # vLLM 0.5's chat default temperature.
        return self._params(max_tokens, logprobs, 0.7, tool_schema)


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


# vLLM's `prompt_logprobs` in a response: per prompt token (None for the first), the
# token ids' {"logprob", "rank", "decoded_token"}.
PromptLogprobsJSON = list[dict[int, dict[str, Any]] | None]


def prompt_logprobs_json(steps: list[Any] | None) -> PromptLogprobsJSON | None:
    """A RequestOutput's prompt_logprobs as vLLM's server returns them."""
    if steps is None:
        return None
    return [
        None
        if step is None
        else {
            tid: {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
            for tid, lp in step.items()
        }
        for step in steps
    ]


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    prompt_logprobs: PromptLogprobsJSON | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"cmpl-{random_uuid()}")
    object: str = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None


class ChatLogProb(OpenAIBaseModel):
    token: str
    logprob: float = -9999.0
    bytes: list[int] | None = None


class ChatLogProbsContent(ChatLogProb):
    top_logprobs: list[ChatLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIBaseModel):
    content: list[ChatLogProbsContent] | None = None


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: ToolCall.new_id())
    type: Literal["function"] = "function"
    function: FunctionCall

    @staticmethod
    def new_id() -> str:
        return f"chatcmpl-tool-{random_uuid()}"


class DeltaFunctionCall(OpenAIBaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(OpenAIBaseModel):
    """One piece of a streamed tool call: the first has id, type and name, later ones append
    to `arguments` (matched by `index`)."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] = Field(default_factory=list)


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"chat-{random_uuid()}")
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobsJSON | None = None


class ChatCompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None


class TokenizeRequest(OpenAIBaseModel):
    """POST /tokenize: `prompt` text, or chat `messages` through the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    # Refused unless the server runs with --trust-request-chat-template (as in vLLM).
    chat_template: str | None = None


class TokenizeResponse(OpenAIBaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str
