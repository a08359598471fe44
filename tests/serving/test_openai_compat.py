"""vLLM's smaller server features through the official `openai` client, at PP = 1 and 2:
logit_bias, allowed_token_ids, --return-tokens-as-token-ids, echo with prompt logprobs,
continuous_usage_stats, /v1/models root and vLLM's 400s for bad chat messages, seeds and
stream_options. Outputs are compared with `LLM.generate` on the same model."""

from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.utils import tiny_models
from tests.utils.server_utils import ServerThread, tiny_openai_server
from vllm import LLM, SamplingParams

KIND = "llama-gqa-tied"
MODEL = "tiny"
PROMPT = tiny_models.PROMPTS[1]
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


@pytest.fixture(scope="module")
def id_server(server):
    """A second app on the same engine, with --return-tokens-as-token-ids and
    --response-role bot."""
    srv = ServerThread(server.engine, return_tokens_as_token_ids=True, response_role="bot")
    yield srv
    srv.stop(shutdown_engine=False)


def greedy(reference: LLM, prompt: str = PROMPT, **kw) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=6, **kw)
    return list(reference.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids)


def test_logit_bias_completions_and_chat(server, reference):
    plain = greedy(reference)
    forced = plain[0] + 1 if plain[0] + 1 not in plain else plain[0] + 7
    expected = greedy(reference, logit_bias={forced: 100.0})
    assert expected == [forced] * 6  # +100 makes the token win every step
    client = server.client()
    got = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=6,
        temperature=0,
        logit_bias={str(forced): 100},
    )
    assert got.choices[0].text == reference.get_tokenizer().decode(expected)
    # -100 on the greedy first token: another token comes first (as offline).
    banned = greedy(reference, logit_bias={plain[0]: -100.0})
    assert banned[0] != plain[0]
    got = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logit_bias={str(plain[0]): -100}
    )
    assert got.choices[0].text == reference.get_tokenizer().decode(banned)
    chat = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=3, temperature=0, logit_bias={str(forced): 100}
    )
    assert chat.choices[0].message.content == reference.get_tokenizer().decode([forced] * 3)


@pytest.mark.parametrize(
    "bias,message",
    [
        ({"999999": 1.0}, "out-of-vocab"),
        ({"5": 101.0}, "[-100, 100]"),
        ({"x": 1.0}, "not an integer"),
    ],
    ids=["vocab", "range", "key"],
)
def test_logit_bias_refused_naming_it(server, bias, message):
    with pytest.raises(openai.BadRequestError) as info:
        server.client().completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=2, logit_bias=bias
        )
    assert info.value.body["param"] == "logit_bias"
    assert message in info.value.body["message"]


def test_allowed_token_ids(server, reference):
    plain = greedy(reference)
    allowed = sorted({plain[0] + 3, plain[1] + 5, 42})
    expected = greedy(reference, allowed_token_ids=allowed)
    assert set(expected) <= set(allowed) and expected != plain
    got = server.client().completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=6,
        temperature=0,
        extra_body={"allowed_token_ids": allowed},
    )
    assert got.choices[0].text == reference.get_tokenizer().decode(expected)
    # Sampled too: only allowed tokens, whatever the draw.
    sampled = server.client().completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=8,
        temperature=1.0,
        seed=3,
        logprobs=0,
        extra_body={"allowed_token_ids": allowed},
    )
    tokenizer = reference.get_tokenizer()
    allowed_text = {tokenizer.decode([t]) for t in allowed}
    assert set(sampled.choices[0].logprobs.tokens) <= allowed_text
    with pytest.raises(openai.BadRequestError) as info:
        server.client().completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=2, extra_body={"allowed_token_ids": [10**7]}
        )
    assert info.value.body["param"] == "allowed_token_ids"
    assert "out-of-vocab" in info.value.body["message"]
    with pytest.raises(ValueError, match="allowed_token_ids contains out-of-vocab"):
        reference.generate(PROMPT, SamplingParams(allowed_token_ids=[10**7]), use_tqdm=False)


def test_return_tokens_as_token_ids(id_server, reference):
    expected = greedy(reference)
    client = id_server.client()
    got = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2
    )
    lp = got.choices[0].logprobs
    assert lp.tokens == [f"token_id:{t}" for t in expected]
    assert all(k.startswith("token_id:") for top in lp.top_logprobs for k in top)
    chat = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=3, temperature=0, logprobs=True, top_logprobs=1
    )
    tokens = [c.token for c in chat.choices[0].logprobs.content]
    assert all(t.startswith("token_id:") for t in tokens) and len(tokens) == 3
    assert chat.choices[0].message.role == "bot"
    # vLLM's check: with echo, each top_logprobs' first key is the token itself, and the
    # ids decode to the text.
    echoed = client.completions.create(
        model=MODEL, prompt=PROMPT, echo=True, max_tokens=6, temperature=0, logprobs=1
    ).choices[0]
    tokens = echoed.logprobs.tokens
    assert tokens[1:] == [next(iter(top)) for top in echoed.logprobs.top_logprobs[1:]]
    ids = [int(t.removeprefix("token_id:")) for t in tokens]
    assert reference.get_tokenizer().decode(ids, skip_special_tokens=True) == echoed.text


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_echo_with_logprobs_gives_prompt_logprobs(server, reference, stream):
    params = SamplingParams(temperature=0, max_tokens=3, logprobs=1, prompt_logprobs=1)
    ref = reference.generate(PROMPT, params, use_tqdm=False)[0]
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=1, echo=True)
    client = server.client()
    if stream:
        chunks = [c for c in client.completions.create(**kwargs, stream=True) if c.choices]
        text = "".join(c.choices[0].text for c in chunks)
        tokens = [t for c in chunks for t in c.choices[0].logprobs.tokens]
        token_logprobs = [x for c in chunks for x in c.choices[0].logprobs.token_logprobs]
        top = [x for c in chunks for x in c.choices[0].logprobs.top_logprobs]
    else:
        got = client.completions.create(**kwargs).choices[0]
        text, lp = got.text, got.logprobs
        tokens, token_logprobs, top = lp.tokens, lp.token_logprobs, lp.top_logprobs
    n_prompt = len(ref.prompt_token_ids)
    assert text == PROMPT + ref.outputs[0].text
    assert len(tokens) == n_prompt + 3
    assert token_logprobs[0] is None and top[0] is None  # nothing predicts the first token
    for i in range(1, n_prompt):
        want = ref.prompt_logprobs[i][ref.prompt_token_ids[i]].logprob
        assert abs(token_logprobs[i] - want) < 1e-4
    for got_lp, step, tid in zip(
        token_logprobs[n_prompt:], ref.outputs[0].logprobs, ref.outputs[0].token_ids
    ):
        assert abs(got_lp - step[tid].logprob) < 1e-4


@pytest.mark.parametrize("logprobs", [0, 1])
def test_echo_logprobs_token_prompt(server, reference, logprobs):
    """vLLM's test_echo_logprob_completion: token-id prompts too, logprobs=0 and 1."""
    ids = [0, 0, 0, 0, 0]
    got = (
        server.client()
        .completions.create(
            model=MODEL, prompt=ids, max_tokens=5, temperature=0, echo=True, logprobs=logprobs
        )
        .choices[0]
    )
    assert got.text.startswith(reference.get_tokenizer().decode(ids))
    lp = got.logprobs
    assert len(lp.tokens) == len(lp.text_offset) == len(lp.token_logprobs) == 10
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(max(logprobs, 1) <= len(top) <= logprobs + 1 for top in lp.top_logprobs[1:])


def test_continuous_usage_stats(server):
    client = server.client()
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, stream=True,
            stream_options=options,
        )
    )  # fmt: skip
    with_choices = [c for c in chunks if c.choices]
    assert with_choices and all(c.usage is not None for c in with_choices)
    done = [c.usage.completion_tokens for c in with_choices]
    assert done == sorted(done) and done[-1] == 5
    assert chunks[-1].usage.completion_tokens == 5 and not chunks[-1].choices
    chat = list(
        client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=4, temperature=0, stream=True,
            stream_options=options,
        )
    )  # fmt: skip
    assert all(c.usage is not None for c in chat)
    assert chat[-1].usage.completion_tokens == 4
    assert chat[0].usage.prompt_tokens == chat[-1].usage.prompt_tokens > 0
    # Without it, no chunk but the last carries usage.
    plain = list(
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=3, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert [c.usage is not None for c in plain] == [False] * (len(plain) - 1) + [True]


def test_models_root_is_the_served_name(server):
    cards = server.client().models.list().data
    assert [(c.id, c.root) for c in cards] == [(MODEL, MODEL)]


def test_vllms_400s(server):
    client = server.client()
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "system", "content": "Be brief.", "extra_field": "0"}],  # type: ignore[list-item]
            max_tokens=2,
        )
    assert "extra_forbidden" in info.value.message
    for seed in (2**63, -(2**63) - 1):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, seed=seed)
        assert info.value.body["param"] == "seed" and "int64" in info.value.message
    ok = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, seed=2**63 - 1)
    assert ok.choices[0].message.content is not None
    for create, kwargs in (
        (client.chat.completions.create, dict(messages=CHAT)),
        (client.completions.create, dict(prompt=PROMPT)),
    ):
        with pytest.raises(openai.BadRequestError) as info:
            create(
                model=MODEL, max_tokens=2, stream=False,
                stream_options={"include_usage": True}, **kwargs,
            )  # fmt: skip
        assert "Stream options can only be defined when `stream=True`." in info.value.message
    # A message's known fields still pass (a tool call's id, a name).
    body = {
        "model": MODEL,
        "max_tokens": 2,
        "messages": [{"role": "user", "content": "Hi", "name": "ann"}],
    }
    assert httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).status_code == 200


def test_metrics_request_params_and_cache_config(server):
    server.client().completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=2, n=2, temperature=1.0, seed=0
    )
    text = httpx.get(server.url + "/metrics", timeout=10).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("vllm:request_params_n", "vllm:request_params_best_of"):
        count = [s for s in families[name].samples if s.name == name + "_count"]
        assert count and count[0].labels == {"model_name": MODEL} and count[0].value >= 1
    n_sum = [s for s in families["vllm:request_params_n"].samples if s.name.endswith("_sum")]
    assert n_sum[0].value >= 2
    (info,) = families["vllm:cache_config_info"].samples
    assert info.value == 1.0 and int(info.labels["num_gpu_blocks"]) > 0
    # vLLM 0.5.5's test reads these labels.
    for label in (
        "block_size", "cache_dtype", "cpu_offload_gb", "enable_prefix_caching",
        "gpu_memory_utilization", "num_cpu_blocks", "num_gpu_blocks",
        "num_gpu_blocks_override", "sliding_window", "swap_space_bytes",
    ):  # fmt: skip
        assert label in info.labels, label


def test_server_flags():
    from vllm.entrypoints.openai.api_server import make_arg_parser

    args = make_arg_parser().parse_args(
        ["--model", "m", "--return-tokens-as-token-ids", "--response-role", "bot"]
    )
    assert args.return_tokens_as_token_ids and args.response_role == "bot"
    defaults = make_arg_parser().parse_args(["--model", "m"])
    assert not defaults.return_tokens_as_token_ids and defaults.response_role == "assistant"


@pytest.mark.parametrize("prompt_logprobs", [-1, 0, 2, None])
def test_prompt_logprobs_in_responses(server, reference, prompt_logprobs):
    """vLLM's test_prompt_logprobs_completion / _chat: the whole response carries them."""
    client = server.client()
    extra = {} if prompt_logprobs is None else {"extra_body": {"prompt_logprobs": prompt_logprobs}}
    prompts = [PROMPT, "My name is"]
    if prompt_logprobs is not None and prompt_logprobs < 0:
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=MODEL, prompt=prompts, max_tokens=2, **extra)
        return
    got = client.completions.create(model=MODEL, prompt=prompts, max_tokens=2, **extra)
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, **extra)
    if prompt_logprobs is None:
        assert got.choices[0].prompt_logprobs is None and chat.prompt_logprobs is None
        return
    ref = reference.generate(
        PROMPT, SamplingParams(max_tokens=1, prompt_logprobs=prompt_logprobs), use_tqdm=False
    )[0]
    steps = got.choices[0].prompt_logprobs
    assert len(steps) == len(ref.prompt_token_ids) and steps[0] is None
    for step, want, tid in zip(steps[1:], ref.prompt_logprobs[1:], ref.prompt_token_ids[1:]):
        assert abs(step[str(tid)]["logprob"] - want[tid].logprob) < 1e-4
        assert prompt_logprobs <= len(step) <= prompt_logprobs + 1
    assert got.choices[1].prompt_logprobs and chat.prompt_logprobs
    if prompt_logprobs:  # vLLM refuses a truthy prompt_logprobs with stream=true
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=MODEL, prompt=PROMPT, stream=True, **extra)
        assert "not available when `stream=True`" in info.value.message
