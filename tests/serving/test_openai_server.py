"""The OpenAI-compatible server at PP = 1 and 2, driven by the official `openai` client.

One server per pipeline size (module-scoped, in a thread on a free local port); greedy
outputs are compared with `LLM.generate` / `LLM.chat` on the same model and settings."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.utils import tiny_models
from tests.utils.server_utils import ServerThread, tiny_openai_server
from vllm import LLM, SamplingParams

KIND = "llama-gqa-tied"
MODEL = "tiny"
PROMPTS = tiny_models.PROMPTS
SETTINGS = dict(kv_cache_space=0.05, swap_space=0.01)
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def reference(tiny_model_dirs):
    llm = LLM(tiny_model_dirs[KIND], **SETTINGS)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module", params=[1, 2], ids=["pp1", "pp2"])
def server(request, tiny_model_dirs):
    yield from tiny_openai_server(request, tiny_model_dirs[KIND], MODEL, **SETTINGS)


def metrics(srv: ServerThread) -> dict[str, float]:
    """Every sample of /metrics (parsed by prometheus_client), histogram buckets left out."""
    text = httpx.get(srv.url + "/metrics", timeout=10).text
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("vllm:") and not sample.name.endswith("_bucket"):
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return values


def metric(values: dict[str, float], name: str, **labels: str) -> float:
    key = ",".join(f"{k}={v}" for k, v in sorted({"model_name": MODEL, **labels}.items()))
    return values.get(f"{name}{{{key}}}", 0.0)


def wait_idle(srv: ServerThread, timeout: float = 30.0) -> None:
    """Until the scheduler holds no request and every KV block is free (bounded)."""
    scheduler = srv.engine.engine.scheduler
    deadline = time.time() + timeout
    while time.time() < deadline:
        bm = scheduler.block_manager
        if (
            not scheduler.has_unfinished_seqs()
            and not scheduler.in_flight
            and bm.get_num_free_gpu_blocks() == bm.num_total_gpu_blocks
            and not srv.engine._streams
        ):
            return
        time.sleep(0.05)
    raise AssertionError(
        f"requests left: waiting={len(scheduler.waiting)} running={len(scheduler.running)} "
        f"in_flight={scheduler.in_flight}"
    )


def test_models_health_version(server):
    client = server.client()
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/version").json()["version"]


def test_completions_greedy_equal_llm_generate(server, reference):
    expected = reference.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16))
    got = server.client().completions.create(
        model=MODEL, prompt=PROMPTS, max_tokens=16, temperature=0
    )
    assert [c.index for c in got.choices] == list(range(len(PROMPTS)))
    assert [c.text for c in got.choices] == [o.outputs[0].text for o in expected]
    assert got.usage.completion_tokens == sum(len(o.outputs[0].token_ids) for o in expected)
    assert got.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in expected)
    # Token ids as the prompt give the same text.
    ids = expected[1].prompt_token_ids
    again = server.client().completions.create(
        model=MODEL, prompt=ids, max_tokens=16, temperature=0
    )
    assert again.choices[0].text == expected[1].outputs[0].text


def test_streaming_completion_concatenates_to_the_whole(server, reference):
    client = server.client()
    kwargs = dict(model=MODEL, prompt=PROMPTS[2], max_tokens=24, temperature=0)
    whole = client.completions.create(**kwargs)
    chunks = list(
        client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    expected = reference.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=24))
    assert text == expected[0].outputs[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_chat_greedy_equals_llm_chat_streamed_or_not(server, reference):
    client = server.client()
    expected = reference.chat(CHAT, SamplingParams(temperature=0, max_tokens=20))[0]
    whole = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=20, temperature=0)
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == expected.outputs[0].text
    assert whole.usage.prompt_tokens == len(expected.prompt_token_ids)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected.outputs[0].text
    assert chunks[-1].usage.completion_tokens == len(expected.outputs[0].token_ids)


def test_raw_sse_format_ends_with_done(server):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 3, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in resp.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"


def test_completion_cut_inside_a_multibyte_character_keeps_its_bytes(server):
    """max_tokens cuts the output inside a character (only the first token of an emoji's
    bytes is allowed): the text, whole or streamed, equals decoding the token ids."""
    tokenizer = server.engine.engine.get_tokenizer()
    head = tokenizer.encode("\U0001f600", add_special_tokens=False)[0]  # 3 of its 4 bytes
    kw = dict(
        model=MODEL, prompt=PROMPTS[0], max_tokens=3, temperature=0,
        extra_body={"allowed_token_ids": [head]},
    )  # fmt: skip
    expected = tokenizer.decode([head] * 3)
    assert expected.endswith("\ufffd")
    choice = server.client().completions.create(**kw).choices[0]
    assert (choice.text, choice.finish_reason) == (expected, "length")
    chunks = server.client().completions.create(stream=True, **kw)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected


def test_chat_echo_puts_the_continued_message_first(server):
    """vLLM's chat echo: a reply that continues the last message (same role, no generation
    prompt) starts with that message's content, streamed or not."""
    messages = CHAT + [{"role": "assistant", "content": "The capital is"}]
    kw = dict(
        model=MODEL, messages=messages, max_tokens=4, temperature=0,
        extra_body={"add_generation_prompt": False},
    )  # fmt: skip
    plain = server.client().chat.completions.create(**kw).choices[0].message
    kw["extra_body"] = {"add_generation_prompt": False, "echo": True}
    echoed = server.client().chat.completions.create(**kw).choices[0].message
    assert echoed.role == "assistant"
    assert echoed.content == "The capital is" + plain.content
    chunks = list(server.client().chat.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == echoed.content


def test_n_choices_seeded_streamed_equals_whole(server):
    client = server.client()
    kwargs = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=10, temperature=1.0, n=3, seed=11)
    whole = client.completions.create(**kwargs)
    assert sorted(c.index for c in whole.choices) == [0, 1, 2]
    assert len({c.text for c in whole.choices}) > 1
    parts: dict[int, str] = {}
    for chunk in client.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            parts[choice.index] = parts.get(choice.index, "") + choice.text
    assert parts == {c.index: c.text for c in whole.choices}
    chat = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=5, temperature=1.0, n=2, seed=3
    )
    assert sorted(c.index for c in chat.choices) == [0, 1]


def test_logprobs_match_the_engine(server, reference):
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=3)
    expected = reference.generate(PROMPTS[1], params)[0].outputs[0]
    got = server.client().completions.create(
        model=MODEL, prompt=PROMPTS[1], max_tokens=8, temperature=0, logprobs=3
    )
    lp = got.choices[0].logprobs
    assert "".join(lp.tokens) == got.choices[0].text == expected.text
    for mine, theirs, tid in zip(lp.token_logprobs, expected.logprobs, expected.token_ids):
        assert abs(mine - theirs[tid].logprob) < 1e-5
    assert all(3 <= len(top) <= 4 for top in lp.top_logprobs)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    chat = server.client().chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 for c in content)
    assert "".join(c.token for c in content) == chat.choices[0].message.content


BAD = [
    (dict(temperature=-1.0), "temperature", "temperature must be non-negative"),
    (dict(extra_body={"top_k": 0}), "top_k", "top_k must be -1"),
    (dict(logprobs=50), "logprobs", "Requested sample logprobs of 50"),
    (dict(extra_body={"min_p": 2.0}), "min_p", "min_p must be in [0, 1]"),
    (dict(max_tokens=0), "max_tokens", "max_tokens must be at least 1"),
    (dict(prompt=[1, 10**9]), "prompt", "out of vocabulary"),
]


@pytest.mark.parametrize("kwargs,param,message", BAD, ids=[b[1] for b in BAD])
def test_bad_parameter_is_a_400_naming_it(server, kwargs, param, message):
    request = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        server.client().completions.create(**request)
    body = info.value.body
    assert info.value.status_code == 400
    assert body["object"] == "error" and body["type"] == "BadRequestError"
    assert body["param"] == param and body["code"] == 400
    assert message in body["message"]


def test_bad_requests_do_not_disturb_concurrent_ones(server, reference):
    expected = reference.generate(PROMPTS[:4], SamplingParams(temperature=0, max_tokens=32))
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)

    async def good(prompt: str) -> str:
        stream = await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=32, temperature=0, stream=True
        )
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def bad(i: int) -> int:
        await asyncio.sleep(0.01 * i)
        try:
            await client.chat.completions.create(
                model=MODEL, messages=CHAT, max_tokens=5, top_p=0.0 if i % 2 else 1.0,
                extra_body={"repetition_penalty": 5.0},
            )  # fmt: skip
        except openai.BadRequestError as exc:
            return exc.status_code
        return 200

    async def main() -> tuple[list[str], list[int]]:
        goods = [asyncio.create_task(good(p)) for p in PROMPTS[:4]]
        codes = await asyncio.gather(*(bad(i) for i in range(6)))
        return await asyncio.gather(*goods), codes

    texts, codes = asyncio.run(main())
    assert codes == [400] * 6
    assert texts == [o.outputs[0].text for o in expected]
    wait_idle(server)


def test_too_long_prompt_is_a_400(server):
    with pytest.raises(openai.BadRequestError) as info:
        server.client().completions.create(model=MODEL, prompt=[7] * 600, max_tokens=2)
    assert info.value.body["param"] == "prompt"
    assert "maximum context length is 512 tokens" in info.value.body["message"]
    wait_idle(server)


def test_wrong_model_and_malformed_body(server):
    with pytest.raises(openai.NotFoundError):
        server.client().completions.create(model="nope", prompt="Hi", max_tokens=2)
    resp = httpx.post(
        server.url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": "x"}
    )
    assert resp.status_code == 400 and resp.json()["param"] == "max_tokens"


def test_client_disconnect_mid_stream_aborts_the_request(server):
    wait_idle(server)
    before = metrics(server)
    body = {
        "model": MODEL,
        "prompt": PROMPTS[0],
        "max_tokens": 400,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as resp:
        lines = resp.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert all(line.startswith("data: ") or not line for line in got)
        assert server.engine.engine.scheduler.has_unfinished_seqs()
    # The connection is closed: the engine drops the request well before 400 tokens.
    wait_idle(server)
    after = metrics(server)
    assert metric(after, "vllm:num_requests_running") == 0
    assert metric(after, "vllm:num_requests_waiting") == 0
    generated = metric(after, "vllm:generation_tokens_total") - metric(
        before, "vllm:generation_tokens_total"
    )
    assert 0 < generated < 400
    assert metric(after, "vllm:request_success_total", finished_reason="length") == metric(
        before, "vllm:request_success_total", finished_reason="length"
    )


def test_client_disconnect_while_waiting_for_a_whole_response(server):
    wait_idle(server)
    body = {"model": MODEL, "prompt": "A", "max_tokens": 450, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=0.3)
    wait_idle(server)


def test_metrics_counters_move(server):
    wait_idle(server)
    before = metrics(server)
    tokens = httpx.post(server.url + "/tokenize", json={"prompt": PROMPTS[3]}).json()
    client = server.client()
    client.completions.create(
        model=MODEL, prompt=PROMPTS[3], max_tokens=7, temperature=0, extra_body={"ignore_eos": True}
    )
    after = metrics(server)

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("vllm:prompt_tokens_total") == tokens["count"]
    assert delta("vllm:generation_tokens_total") == 7
    assert delta("vllm:request_success_total", finished_reason="length") == 1
    for name in (
        "vllm:time_to_first_token_seconds_count",
        "vllm:e2e_request_latency_seconds_count",
        "vllm:request_prompt_tokens_count",
    ):
        assert delta(name) == 1, name
    assert delta("vllm:time_per_output_token_seconds_count") == 6
    assert delta("vllm:request_generation_tokens_sum") == 7
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:num_requests_swapped", "vllm:gpu_cache_usage_perc",
                 "vllm:num_preemptions_total"):  # fmt: skip
        assert name + "{model_name=tiny}" in after, name
    assert metric(after, "vllm:gpu_cache_usage_perc") == 0.0


def test_tokenize_detokenize(server, reference):
    tok = reference.get_tokenizer()
    got = httpx.post(server.url + "/tokenize", json={"model": MODEL, "prompt": "Hello world"})
    assert got.json()["tokens"] == tok.encode("Hello world")
    assert got.json()["max_model_len"] == 512
    back = httpx.post(server.url + "/detokenize", json={"tokens": got.json()["tokens"]})
    assert back.json()["prompt"] == "Hello world"
    chat = httpx.post(server.url + "/tokenize", json={"messages": CHAT}).json()
    expected = reference.chat(CHAT, SamplingParams(max_tokens=1))[0]
    assert chat["count"] == len(expected.prompt_token_ids)
    bad = httpx.post(server.url + "/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and "out of vocabulary" in bad.json()["message"]


def test_api_key(server):
    keyed = ServerThread(server.engine, api_key="sekret")
    try:
        with pytest.raises(openai.AuthenticationError):
            keyed.client(api_key="wrong").models.list()
        assert keyed.client(api_key="sekret").models.list().data[0].id == MODEL
        assert httpx.get(keyed.url + "/health").status_code == 200  # not under /v1
    finally:
        keyed.stop(shutdown_engine=False)


def test_profiling_routes_only_with_a_trace_dir(server, tmp_path, monkeypatch):
    """As vLLM: POST /start_profile and /stop_profile exist when VLLM_TORCH_PROFILER_DIR is
    set when the app is built, and profile every stage between two engine steps."""
    assert httpx.post(server.url + "/start_profile", timeout=10).status_code == 404
    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", str(tmp_path))
    profiled = ServerThread(server.engine)
    try:
        assert httpx.post(profiled.url + "/start_profile", timeout=60).status_code == 200
        done = profiled.client().completions.create(
            model=MODEL, prompt=PROMPTS[0], max_tokens=3, temperature=0.0
        )
        assert done.usage.completion_tokens == 3
        assert httpx.post(profiled.url + "/stop_profile", timeout=120).status_code == 200
    finally:
        profiled.stop(shutdown_engine=False)
    pp = server.engine.engine.parallel_config.pipeline_parallel_size
    tables = sorted(p.name for p in tmp_path.glob("*-ops.txt"))
    assert tables == [f"stage{s}-rank{s}-ops.txt" for s in range(pp)]
