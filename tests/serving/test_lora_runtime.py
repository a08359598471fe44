"""Runtime LoRA adapters on the OpenAI server, as vLLM: with VLLM_ALLOW_RUNTIME_LORA_UPDATING,
`POST /v1/load_lora_adapter` loads an adapter on every stage (PP 2, mp) and serves it at once
(listed in /v1/models with its parent, chosen by `model=`, greedy text equal to HF + PEFT);
`POST /v1/unload_lora_adapter` stops serving it. vLLM's status codes and messages: 400 for an
adapter already loaded, a bad adapter (rank, JSON, missing field), 404 for a directory without
an adapter and for unloading an unknown name; vLLM's messages for a rank over max_lora_rank,
DoRA, adapter bias and modules_to_save. Both routes need the API key like the others.
Many adapters loaded and used at once (more than max_cpu_loras) each give their own text, and
bad loads meanwhile break no request. (Without the variable the routes are absent:
tests/serving/test_lora_server.py.)"""

from __future__ import annotations

import asyncio
import json
import shutil

import httpx
import openai
import pytest

from tests.utils import lora_adapters, tiny_models
from tests.utils.server_utils import ServerThread
from vllm import AsyncEngineArgs, AsyncLLMEngine
from vllm.entrypoints.openai.lora_modules import LoRAModulePath, lora_requests

KIND = "llama-gqa-untied"
BASE = "tiny-llama"
KEY = "sekret"
MAX_TOKENS = 8
PROMPTS = tiny_models.PROMPTS[:2]


@pytest.fixture(scope="module")
def adapters(tiny_model_dirs, tmp_path_factory) -> dict[str, str]:
    root = str(tmp_path_factory.mktemp("lora_runtime"))
    return lora_adapters.make_adapters(tiny_model_dirs[KIND], root, ["a4", "c8"])


@pytest.fixture(scope="module")
def server(tiny_model_dirs, adapters):
    """One server: PP 2 (mp), `a4` served from the start, runtime updates allowed, API key."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
        args = AsyncEngineArgs(
            model=tiny_model_dirs[KIND],
            served_model_name=BASE,
            pipeline_parallel_size=2,
            distributed_executor_backend="mp",
            enable_lora=True,
            max_loras=2,
            max_cpu_loras=2,
            max_lora_rank=8,
            kv_cache_space=0.05,
            swap_space=0.01,
        )
        engine = AsyncLLMEngine.from_engine_args(args)
        loras = lora_requests([LoRAModulePath("a4", adapters["a4"])])
        for lora in loras:
            engine.engine.add_lora(lora)
        srv = ServerThread(engine, api_key=KEY, served_model_names=[BASE], lora_requests=loras)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def expected(tiny_model_dirs, adapters) -> dict[str | None, list[str]]:
    """adapter name (None: the base model) -> HF + PEFT greedy text of each prompt."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dirs[KIND])
    texts = {}
    for name in (None, "a4", "c8"):
        path = adapters[name] if name else None
        ids = lora_adapters.hf_lora_greedy(tiny_model_dirs[KIND], path, PROMPTS, MAX_TOKENS)
        texts[name] = [tokenizer.decode(i, skip_special_tokens=True) for i in ids]
    assert texts["a4"] != texts[None] and texts["c8"] != texts[None]
    return texts


def _client(server: ServerThread) -> openai.OpenAI:
    return server.client(api_key=KEY)


def _load(server: ServerThread, name: str, path: str) -> str:
    body = {"lora_name": name, "lora_path": path}
    return _client(server).post("load_lora_adapter", cast_to=str, body=body)


def _unload(server: ServerThread, name: str) -> str:
    return _client(server).post("unload_lora_adapter", cast_to=str, body={"lora_name": name})


def _texts(server: ServerThread, model: str) -> list[str]:
    out = _client(server).completions.create(
        model=model, prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0.0
    )
    return [c.text for c in sorted(out.choices, key=lambda c: c.index)]


def test_load_serve_unload(server, adapters, expected) -> None:
    assert _load(server, "c8", adapters["c8"]) == "Success: LoRA adapter 'c8' added successfully."
    cards = _client(server).models.list().data
    assert [c.id for c in cards] == [BASE, "a4", "c8"]  # a loaded adapter comes last
    assert cards[-1].parent == BASE and cards[-1].root == adapters["c8"]
    assert _texts(server, "c8") == expected["c8"]
    assert _texts(server, "a4") == expected["a4"]
    assert _texts(server, BASE) == expected[None]
    # Chat and the Responses API run it too (the same chat template: the same text).
    chat = _client(server).chat.completions.create(
        model="c8", messages=[{"role": "user", "content": "Hi"}], max_tokens=6, temperature=0.0
    )
    assert chat.model == "c8"
    response = _client(server).responses.create(
        model="c8", input="Hi", max_output_tokens=6, temperature=0.0
    )
    assert response.model == "c8"
    assert response.output_text == chat.choices[0].message.content
    base_chat = _client(server).chat.completions.create(
        model=BASE, messages=[{"role": "user", "content": "Hi"}], max_tokens=6, temperature=0.0
    )
    assert base_chat.choices[0].message.content != chat.choices[0].message.content

    assert _unload(server, "c8") == "Success: LoRA adapter 'c8' removed successfully."
    assert [c.id for c in _client(server).models.list().data] == [BASE, "a4"]
    with pytest.raises(openai.NotFoundError, match="The model `c8` does not exist."):
        _texts(server, "c8")
    with pytest.raises(openai.NotFoundError, match="The lora adapter 'c8' cannot be found."):
        _unload(server, "c8")
    # Loaded again (a new id): the same text.
    _load(server, "c8", adapters["c8"])
    assert _texts(server, "c8") == expected["c8"]
    _unload(server, "c8")


def test_load_inplace_replaces_the_adapter(server, adapters, expected) -> None:
    _load(server, "swap", adapters["c8"])
    assert _texts(server, "swap") == expected["c8"]
    body = {"lora_name": "swap", "lora_path": adapters["a4"], "load_inplace": True}
    assert "success" in _client(server).post("load_lora_adapter", cast_to=str, body=body).lower()
    assert _texts(server, "swap") == expected["a4"]
    assert [c.id for c in _client(server).models.list().data].count("swap") == 1
    _unload(server, "swap")


def test_unload_while_a_request_runs(server, adapters) -> None:
    """The adapter leaves /v1/models at once; the request already running with it finishes
    with it (the engine keeps it until no request uses it)."""
    client = _client(server)
    params = dict(prompt=PROMPTS[0], max_tokens=48, temperature=0.0)
    _load(server, "busy", adapters["c8"])
    alone = client.completions.create(model="busy", **params).choices[0].text
    assert alone != client.completions.create(model=BASE, **params).choices[0].text
    chunks = iter(client.completions.create(model="busy", stream=True, **params))
    text = next(chunks).choices[0].text
    assert _unload(server, "busy") == "Success: LoRA adapter 'busy' removed successfully."
    assert "busy" not in {c.id for c in client.models.list().data}
    text += "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == alone


# vLLM's own cases: a field of adapter_config.json changed -> 400 with vLLM's message.
BADREQUEST_CASES = [
    ({"r": 1024}, "is greater than max_lora_rank"),
    ({"bias": "all"}, "Adapter bias cannot be used without bias_enabled"),
    ({"use_dora": True}, "does not yet support DoRA"),
    ({"modules_to_save": ["lm_head"]}, "only supports modules_to_save being None"),
]


@pytest.mark.parametrize("change,message", BADREQUEST_CASES)
def test_bad_adapter_configs(server, adapters, tmp_path, change, message) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(adapters["c8"], bad)
    config = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(openai.BadRequestError, match=message):
        _load(server, "bad", str(bad))
    assert "bad" not in {c.id for c in _client(server).models.list().data}


def test_errors(server, adapters, tmp_path) -> None:
    with pytest.raises(
        openai.BadRequestError, match="The lora adapter 'a4' has already been loaded."
    ):
        _load(server, "a4", adapters["c8"])
    with pytest.raises(openai.NotFoundError, match="No adapter found"):
        _load(server, "notfound", "/not/an/adapter")
    invalid = tmp_path / "invalid_json"
    invalid.mkdir()
    (invalid / "adapter_config.json").write_text("this is not json")
    with pytest.raises(openai.BadRequestError):
        _load(server, "invalid-json", str(invalid))
    with pytest.raises(openai.BadRequestError, match="Both 'lora_name' and 'lora_path'"):
        _load(server, "nopath", "")
    # None of them is served; the served ones still are.
    assert [c.id for c in _client(server).models.list().data] == [BASE, "a4"]


@pytest.mark.parametrize("route", ["load_lora_adapter", "unload_lora_adapter"])
def test_routes_need_the_api_key(server, adapters, route) -> None:
    body = {"lora_name": "nokey", "lora_path": adapters["c8"]}
    url = f"{server.url}/v1/{route}"
    assert httpx.post(url, json=body, timeout=30).status_code == 401
    wrong = {"Authorization": "Bearer wrong"}
    assert httpx.post(url, json=body, headers=wrong, timeout=30).status_code == 401
    assert "nokey" not in {c.id for c in _client(server).models.list().data}


def test_many_adapters_at_once_and_bad_loads_break_nothing(server, adapters, expected) -> None:
    """Six adapters loaded and used concurrently (max_cpu_loras=2: stages evict and reload
    them), a4-served requests running throughout, bad loads in between: every request gets
    its adapter's text."""

    async def run() -> None:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)

        async def complete(model: str) -> list[str]:
            out = await client.completions.create(
                model=model, prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0.0
            )
            return [c.text for c in sorted(out.choices, key=lambda c: c.index)]

        async def load_and_use(i: int) -> None:
            source = "c8" if i % 2 else "a4"
            name = f"adapter_{i}"
            await client.post(
                "load_lora_adapter",
                cast_to=str,
                body={"lora_name": name, "lora_path": adapters[source]},
            )
            for _ in range(2):
                assert await complete(name) == expected[source], name

        async def bad_loads() -> None:
            for _ in range(5):
                with pytest.raises(openai.NotFoundError):
                    await client.post(
                        "load_lora_adapter",
                        cast_to=str,
                        body={"lora_name": "notfound", "lora_path": "/not/an/adapter"},
                    )

        async def served_throughout() -> None:
            for _ in range(3):
                assert await complete("a4") == expected["a4"]

        await asyncio.gather(*(load_and_use(i) for i in range(6)), bad_loads(), served_throughout())
        for i in range(6):
            await client.post(
                "unload_lora_adapter", cast_to=str, body={"lora_name": f"adapter_{i}"}
            )
        await client.close()

    asyncio.run(run())
    assert [c.id for c in _client(server).models.list().data] == [BASE, "a4"]
