"""The internal Python surface vLLM 0.5 users' code and tests touch: RequestTracker (vLLM's
own test, adapted), load_chat_template, the OpenAIServing* constructors with vLLM 0.5.5's
arguments, AsyncLLMEngine's keywords and loggers."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import pytest

from vllm import AsyncEngineArgs, AsyncLLMEngine, SamplingParams
from vllm.engine.async_llm_engine import RequestTracker
from vllm.engine.metrics import StatLoggerBase, Stats
from vllm.entrypoints.chat_utils import load_chat_template
from vllm.outputs import RequestOutput

KIND = "llama-gqa-tied"


def test_request_tracker():
    tracker = RequestTracker()
    stream_1 = tracker.add_request("1")
    assert tracker.new_requests_event.is_set()
    new, aborted = tracker.get_new_and_aborted_requests()
    assert not tracker.new_requests_event.is_set()
    assert [r["request_id"] for r in new] == ["1"] and not aborted
    assert not stream_1.finished and "1" in tracker and len(tracker) == 1

    stream_2 = tracker.add_request("2", prompt="x")
    stream_3 = tracker.add_request("3")
    new, aborted = tracker.get_new_and_aborted_requests()
    assert [r["request_id"] for r in new] == ["2", "3"] and new[0]["prompt"] == "x"
    assert not stream_2.finished and not stream_3.finished

    with pytest.raises(KeyError):  # ids are unique
        tracker.add_request("1")
    assert not tracker.new_requests_event.is_set()

    tracker.abort_request("1")
    new, aborted = tracker.get_new_and_aborted_requests()
    assert aborted == {"1"} and not new and stream_1.finished

    stream_4 = tracker.add_request("4")
    tracker.abort_request("4")
    new, aborted = tracker.get_new_and_aborted_requests()
    # Added and aborted before the engine saw it: neither reaches the engine.
    assert not aborted and not new and stream_4.finished

    stream_5 = tracker.add_request("5")
    tracker.process_request_output(RequestOutput("2", "output", [], None, [], finished=True))
    new, aborted = tracker.get_new_and_aborted_requests()
    assert not aborted and [r["request_id"] for r in new] == ["5"]
    assert stream_2.finished and not stream_5.finished

    async def drain(stream):
        return [item async for item in stream]

    assert [o.request_id for o in asyncio.run(drain(stream_2))] == ["2"]
    tracker.propagate_exception(RuntimeError("boom"))
    assert stream_3.finished and stream_5.finished and len(tracker) == 0
    with pytest.raises(RuntimeError, match="boom"):
        asyncio.run(drain(stream_3))


def test_request_logger(caplog):
    import logging

    from vllm.entrypoints.logger import RequestLogger

    with caplog.at_level(logging.INFO, logger="vllm"):
        RequestLogger(max_log_len=5).log_inputs(
            "r1", "Hello world", list(range(20)), SamplingParams(max_tokens=3)
        )
    assert "Received request r1: prompt: 'Hello', params: SamplingParams(" in caplog.text
    assert "prompt_token_ids: [0, 1, 2, 3, 4], lora_request: None" in caplog.text


def test_load_chat_template(tmp_path):
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    path = tmp_path / "t.jinja"
    path.write_text(template)
    assert load_chat_template(str(path)) == template
    assert load_chat_template(Path(path)) == template
    assert load_chat_template("{{ messages }}") == "{{ messages }}"
    assert load_chat_template("{{ 'a' }}\\n") == "{{ 'a' }}\n"  # escapes read, as vLLM
    assert load_chat_template(None) is None
    with pytest.raises(ValueError, match="looks like a file path"):
        load_chat_template("../../examples/does_not_exist")


class _Count(StatLoggerBase):
    def __init__(self) -> None:
        super().__init__(local_interval=1.0)
        self.tokens = 0

    def log(self, stats: Stats) -> None:
        self.tokens += stats.num_generation_tokens_iter

    def info(self, type: str, obj: object) -> None:
        pass


def test_serving_constructors_and_engine_keywords(tiny_model_dirs, caplog):
    from vllm.entrypoints.logger import RequestLogger
    from vllm.entrypoints.openai.serving_chat import OpenAIServingChat
    from vllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
    from vllm.entrypoints.openai.serving_engine import LoRAModulePath

    counter = _Count()
    args = AsyncEngineArgs(
        model=tiny_model_dirs[KIND],
        kv_cache_space=0.02,
        swap_space=0.01,
        disable_log_stats=False,
        max_log_len=40,  # vLLM 0.5's AsyncEngineArgs fields
        engine_use_ray=False,
        worker_use_ray=False,
        tokenizer_pool_size=0,
    )
    engine = AsyncLLMEngine.from_engine_args(
        args, start_engine_loop=True, usage_context=None, stat_loggers={"count": counter}
    )
    try:
        assert engine.engine.stat_loggers == {"count": counter} and engine.max_log_len == 40
        model_config = asyncio.run(engine.get_model_config())
        # vLLM 0.5.5's call forms.
        completion = OpenAIServingCompletion(
            engine,
            model_config,
            ["tiny"],
            lora_modules=None,
            prompt_adapters=None,
            request_logger=RequestLogger(max_log_len=10),
            return_tokens_as_token_ids=True,
        )
        chat = OpenAIServingChat(
            engine,
            model_config,
            ["tiny"],
            "bot",
            lora_modules=None,
            prompt_adapters=None,
            request_logger=None,
            chat_template="{{ messages[0]['content'] }}",
        )
        assert completion.served_model_names == ["tiny"] and completion.return_tokens_as_token_ids
        assert chat.response_role == "bot" and chat.chat_template == "{{ messages[0]['content'] }}"
        models = asyncio.run(completion.show_available_models())
        assert [(m.id, m.root) for m in models.data] == [("tiny", "tiny")]
        with pytest.raises(ValueError, match="lora_modules"):
            OpenAIServingCompletion(
                engine,
                model_config,
                ["tiny"],
                lora_modules=["x"],
                prompt_adapters=None,
                request_logger=None,
            )
        # vLLM 0.5's LoRAModulePath entries become the served adapters (listed with a parent).
        with_lora = OpenAIServingCompletion(
            engine, model_config, ["tiny"], lora_modules=[LoRAModulePath("ad", "/some/dir")]
        )
        listed = asyncio.run(with_lora.show_available_models()).data
        assert [(m.id, m.parent) for m in listed] == [("tiny", None), ("ad", "tiny")]

        async def run() -> str:
            final = None
            async for out in engine.generate(
                inputs="Hello", sampling_params=SamplingParams(max_tokens=3), request_id="r"
            ):
                final = out
            assert final is not None
            return final.outputs[0].text

        assert asyncio.run(run())
        assert counter.tokens == 3
        counter.tokens = 0

        class StayingClient:  # a raw request whose client never leaves
            async def receive(self) -> dict:
                await asyncio.sleep(3600)
                return {"type": "http.disconnect"}

        from vllm.entrypoints.openai.protocol import CompletionRequest

        async def through_handler() -> dict:
            request = CompletionRequest(model="tiny", prompt="Hello", max_tokens=3)
            response = await completion.create_completion(request, StayingClient())
            return json.loads(response.body)

        with caplog.at_level(logging.INFO, logger="vllm"):
            body = asyncio.run(through_handler())
        # The handler's request_logger saw it (prompt cut to max_log_len=10).
        assert "Received request cmpl-" in caplog.text and "prompt: 'Hello'" in caplog.text
        assert body["choices"][0]["logprobs"] is None and body["usage"]["completion_tokens"] == 3

        async def lower_level() -> list[int]:
            stream = await engine.add_request("r2", "Hello", SamplingParams(max_tokens=2))
            return [len(out.outputs[0].token_ids) async for out in stream]

        assert asyncio.run(lower_level())[-1] == 2
        engine.remove_logger("count")
        engine.add_logger("count", counter)
        assert not engine.engine_use_ray and not engine.worker_use_ray
        assert asyncio.run(engine.get_decoding_config()).guided_decoding_backend == "xgrammar"
    finally:
        engine.shutdown()


def test_llm_engine_add_request_forms(tiny_model_dirs):
    from vllm import EngineArgs, LLMEngine, TokensPrompt

    engine = LLMEngine.from_engine_args(
        EngineArgs(model=tiny_model_dirs[KIND], kv_cache_space=0.02, swap_space=0.01)
    )
    params = SamplingParams(temperature=0, max_tokens=4)
    ids = engine.get_tokenizer().encode("Hello there")
    engine.add_request("a", "Hello there", params)  # vLLM's example form
    engine.add_request("b", TokensPrompt(prompt_token_ids=ids), params, 123.0)  # 0.5's form
    engine.add_request("c", inputs={"prompt": "Hello there"}, params=params)
    engine.add_request("d", None, params, ids)  # the older prompt_token_ids slot
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out.outputs[0].token_ids
    assert outs["a"] == outs["b"] == outs["c"] == outs["d"] and len(outs["a"]) == 4
    with pytest.raises(TypeError, match="sampling_params"):
        engine.add_request("e", "x", None)
    engine.shutdown()
