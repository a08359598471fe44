"""LLM: vLLM's offline API. Pipeline parallelism works here too (vLLM V0 refused it)."""

from __future__ import annotations

import contextlib
import gc
import itertools
import warnings
from collections.abc import Iterator
from collections.abc import Sequence as SequenceABC
from typing import Any, ClassVar

from tqdm.auto import tqdm

from vllm.engine.arg_utils import EngineArgs
from vllm.engine.llm_engine import LLMEngine
from vllm.entrypoints.llm_pooling import PoolingMixin
from vllm.inputs import is_token_list, parse_prompt
from vllm.outputs import RequestOutput
from vllm.sampling_params import RequestOutputKind, SamplingParams

PromptType = str | dict[str, Any]


class LLM(PoolingMixin):
    """Generate text for batches of prompts with continuous batching over a paged KV cache;
    with a pooling model, embed, classify and score them (`PoolingMixin`).

    `LLM(model="smollm2", pipeline_parallel_size=2)` splits the decoder layers over two Ray
    workers. Keyword arguments are EngineArgs fields (vLLM's names).
    """

    # vLLM 0.5: the legacy `prompts=` / `prompt_token_ids=` keywords warn only inside
    # `with LLM.deprecate_legacy_api():`.
    DEPRECATE_LEGACY: ClassVar[bool] = False

    @classmethod
    @contextlib.contextmanager
    def deprecate_legacy_api(cls) -> Iterator[None]:
        cls.DEPRECATE_LEGACY = True
        try:
            yield
        finally:
            cls.DEPRECATE_LEGACY = False

    def __init__(self, model: str = "smollm2", **kwargs: Any) -> None:
        kwargs.setdefault("disable_log_stats", True)
        engine_args = EngineArgs(model=model, **kwargs)
        self.llm_engine = LLMEngine.from_engine_args(engine_args)
        self.request_counter = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.get_tokenizer()

    def generate(
        self,
        prompts: PromptType | SequenceABC[PromptType] | None = None,
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        prompt_token_ids: list[int] | list[list[int]] | None = None,
        use_tqdm: bool = True,
        lora_request: Any = None,
        *,
        inputs: PromptType | SequenceABC[PromptType] | None = None,
    ) -> list[RequestOutput]:
        """Run all prompts to completion; outputs come back in input order.

        A prompt is a string, a `TextPrompt` / `TokensPrompt` dict, or a list of token ids;
        pass one or a list of them (`inputs=` is vLLM 0.5's keyword for the same thing). The
        legacy `prompt_token_ids=` takes one list of ids or a list of them.
        `sampling_params` is one SamplingParams for all or a list with one per prompt
        (default: SamplingParams())."""
        if self.DEPRECATE_LEGACY:
            legacy = [
                name
                for name, value in (("prompts", prompts), ("prompt_token_ids", prompt_token_ids))
                if value is not None
            ]
            if legacy:
                warnings.warn(
                    DeprecationWarning(
                        f"The keyword arguments {set(legacy)} are deprecated and will be "
                        "removed in a future update. Please use the 'inputs' parameter instead."
                    ),
                    stacklevel=2,
                )
        if inputs is not None:
            if prompts is not None:
                raise ValueError("Pass prompts or inputs, not both.")
            prompts = inputs
        items = self._normalize_prompts(prompts, prompt_token_ids)
        params_list = _final_only(self._normalize_params(sampling_params, len(items)))
        loras = self._normalize_loras(lora_request, len(items))
        # Validate everything first: a bad prompt must not leave half the batch queued.
        request_ids: list[str] = []
        try:
            for (text, ids), params, lora in zip(items, params_list, loras):
                request_id = str(next(self.request_counter))
                self.llm_engine.add_request(
                    request_id, text, params, prompt_token_ids=ids, lora_request=lora
                )
                request_ids.append(request_id)
        except Exception:
            self.llm_engine.abort_request(request_ids)
            raise
        return self._run_engine(request_ids, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        lora_request: Any = None,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation (or a list of them) and
        generate a reply for each (with `lora_request`'s adapter, as generate)."""
        if isinstance(messages, str) or not isinstance(messages, (list, tuple)):
            raise TypeError(
                "messages must be a list of message dicts ({'role': ..., 'content': ...}) or a "
                f"list of such conversations, got {type(messages).__name__}; for a plain "
                "string prompt use generate()."
            )
        tokenizer = self.get_tokenizer()
        if tokenizer is None:
            raise ValueError("chat() needs a tokenizer (skip_tokenizer_init=True was set).")
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = [
            tokenizer.apply_chat_template(
                conv, tokenize=False, add_generation_prompt=add_generation_prompt
            )
            for conv in conversations
        ]
        # The template already holds the BOS token where the model wants one.
        ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        return self.generate(
            [{"prompt_token_ids": i, "prompt": p} for i, p in zip(ids, prompts)],
            sampling_params,
            use_tqdm=use_tqdm,
            lora_request=lora_request,
        )

    @staticmethod
    def _normalize_prompts(
        prompts: Any, prompt_token_ids: Any
    ) -> list[tuple[str | None, list[int] | None]]:
        if prompts is None and prompt_token_ids is None:
            raise ValueError("Either prompts or prompt_token_ids must be provided.")
        if prompt_token_ids is not None:
            # vLLM's legacy form: a list of ids is one prompt, a list of lists is a batch;
            # with text prompts too, the two lists pair up (the ids are used, the text kept).
            ids_list = [prompt_token_ids] if is_token_list(prompt_token_ids) else prompt_token_ids
            if not isinstance(ids_list, (list, tuple)):
                raise TypeError("prompt_token_ids must be a list of ints or a list of such lists.")
            if prompts is None:
                return [(None, list(ids)) for ids in ids_list]
            texts = [prompts] if isinstance(prompts, str) else list(prompts)
            if len(texts) != len(ids_list):
                raise ValueError("The lengths of prompts and prompt_token_ids must be the same.")
            return [(text, list(ids)) for text, ids in zip(texts, ids_list)]
        if isinstance(prompts, (str, dict)) or is_token_list(prompts):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise TypeError(
                f"prompts must be a prompt or a list of prompts, got {type(prompts).__name__}."
            )
        items: list[tuple[str | None, list[int] | None]] = []
        for prompt in prompts:
            if not isinstance(prompt, (str, dict)) and not is_token_list(prompt):
                raise TypeError(
                    "prompts must be strings or dicts (TextPrompt, TokensPrompt) or lists of "
                    f"token ids, got {type(prompt).__name__}."
                )
            items.append(parse_prompt(prompt))
        return items

    @staticmethod
    def _normalize_loras(lora_request: Any, count: int) -> list[Any]:
        """One LoRARequest (or None) for all prompts, or a list with one per prompt."""
        if isinstance(lora_request, (list, tuple)):
            if len(lora_request) != count:
                raise ValueError("The lengths of prompts and lora_request must be the same.")
            return list(lora_request)
        return [lora_request] * count

    @staticmethod
    def _normalize_params(params: Any, count: int) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * count
        if isinstance(params, SamplingParams):
            return [params] * count
        if isinstance(params, (list, tuple)):
            if len(params) != count:
                raise ValueError("The lengths of prompts and sampling_params must be the same.")
            return list(params)
        raise TypeError(
            f"sampling_params must be a SamplingParams or a list of them, got "
            f"{type(params).__name__}."
        )

    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list[Any]:
        engine = self.llm_engine
        wanted = set(request_ids)
        finished: dict[str, Any] = {}
        bar = tqdm(
            total=len(request_ids),
            desc="Processed prompts",
            dynamic_ncols=True,
            disable=not use_tqdm,
        )
        in_toks = out_toks = 0
        with bar, _gc_frozen(), _abort_unfinished_on_error(engine, request_ids, finished):
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if not output.finished or output.request_id not in wanted:
                        continue
                    finished[output.request_id] = output
                    in_toks += len(output.prompt_token_ids)
                    if isinstance(output, RequestOutput):  # a pooling output has none
                        out_toks += sum(len(o.token_ids) for o in output.outputs)
                    bar.update(1)
                    elapsed = bar.format_dict["elapsed"] or 1e-9
                    bar.set_postfix_str(
                        f"est. speed input: {in_toks / elapsed:.2f} toks/s, "
                        f"output: {out_toks / elapsed:.2f} toks/s",
                        refresh=False,
                    )
        return [finished[r] for r in request_ids if r in finished]

    def start_profile(self) -> None:
        """Start torch.profiler on every pipeline stage. Set VLLM_TORCH_PROFILER_DIR first;
        `stop_profile` writes each stage's trace there (open it in https://ui.perfetto.dev)."""
        self.llm_engine.start_profile()

    def stop_profile(self) -> list[str]:
        """Stop profiling; returns the paths of each stage's table of ops by time."""
        return self.llm_engine.stop_profile()

    def shutdown(self) -> None:
        """Stop the engine's workers now (otherwise done when the LLM is garbage collected)."""
        self.llm_engine.shutdown()

    def __del__(self) -> None:
        engine = getattr(self, "llm_engine", None)
        if engine is not None:
            try:
                engine.shutdown()
            except Exception:  # interpreter teardown
                pass


def _final_only(params_list: list[SamplingParams]) -> list[SamplingParams]:
    """The same parameters with output_kind=FINAL_ONLY (as vLLM's LLM sets): generate() only
    returns finished requests, so the engine need not build a RequestOutput per request per
    step. The caller's objects are left unchanged."""
    copies: dict[int, SamplingParams] = {}
    result = []
    for params in params_list:
        if id(params) not in copies:
            copy = params.clone()
            copy.output_kind = RequestOutputKind.FINAL_ONLY
            copies[id(params)] = copy
        result.append(copies[id(params)])
    return result


@contextlib.contextmanager
def _abort_unfinished_on_error(
    engine: LLMEngine, request_ids: list[str], finished: dict[str, Any]
) -> Iterator[None]:
    """If generate() is left by an exception (Ctrl-C included), its unfinished requests are
    aborted: nobody will collect them, and the next generate() must not run them."""
    try:
        yield
    except BaseException:
        unfinished = [r for r in request_ids if r not in finished]
        if unfinished and not engine.is_dead:
            engine.abort_request(unfinished)
        raise


@contextlib.contextmanager
def _gc_frozen() -> Iterator[None]:
    """Keep the objects that exist before the run out of the cyclic GC while it runs.

    The model, tokenizer and libraries are ~350k objects; each full collection walks all of
    them (0.1-0.25 s on this kind of CPU) and lands in the middle of a step. Frozen, a
    collection walks only the run's own objects. They are unfrozen after the run, so garbage
    among them is still collected later.

    A host application that froze objects itself (`gc.get_freeze_count() > 0`) owns the
    permanent generation: `gc.unfreeze()` cannot tell its objects from ours and would undo
    its freeze, so then nothing is frozen or unfrozen here."""
    if gc.get_freeze_count() > 0:
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
