"""The OpenAI server with LoRA adapters (vLLM's `--enable-lora --lora-modules`): two adapters
and the base model served at once at PP = 2 (mp), each request's `model` picking its adapter;
greedy text equals HF + PEFT, streamed and not; `/v1/models` lists the adapters with the base
model as their parent; an unknown model is vLLM's 404; the runtime adapter routes are absent
without VLLM_ALLOW_RUNTIME_LORA_UPDATING; the flags parse in both of vLLM's forms.
"""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest

from tests.utils import lora_adapters, tiny_models
from tests.utils.server_utils import ServerThread
from vllm import AsyncEngineArgs, AsyncLLMEngine
from vllm.entrypoints.openai.api_server import make_arg_parser
from vllm.entrypoints.openai.lora_modules import lora_requests

KIND = "llama-gqa-untied"
BASE = "tiny-llama"
MAX_TOKENS = 12
PROMPTS = tiny_models.PROMPTS[:2]


@pytest.fixture(scope="module")
def adapters(tiny_model_dirs, tmp_path_factory) -> dict[str, str]:
    root = str(tmp_path_factory.mktemp("lora_server"))
    return lora_adapters.make_adapters(tiny_model_dirs[KIND], root, ["a4", "b8"])


@pytest.fixture(scope="module")
def server(tiny_model_dirs, adapters):
    parser = make_arg_parser()
    args = parser.parse_args(
        [
            "--model", tiny_model_dirs[KIND], "--served-model-name", BASE, "-pp", "2",
            "--distributed-executor-backend", "mp", "--enable-lora", "--max-loras", "2",
            "--max-lora-rank", "8", "--kv-cache-space", "0.05", "--swap-space", "0.01",
            "--lora-modules", f"a4={adapters['a4']}",
            f'{{"name": "b8", "path": "{adapters["b8"]}"}}',
        ]
    )  # fmt: skip
    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs.from_cli_args(args))
    loras = lora_requests(args.lora_modules)
    for lora in loras:
        engine.engine.add_lora(lora)
    with pytest.MonkeyPatch.context() as env:
        env.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
        srv = ServerThread(engine, served_model_names=[BASE], lora_requests=loras)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def expected(tiny_model_dirs, adapters):
    """model name -> HF + PEFT greedy text of each prompt."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dirs[KIND])
    texts = {}
    for name, path in [(BASE, None), ("a4", adapters["a4"]), ("b8", adapters["b8"])]:
        ids = lora_adapters.hf_lora_greedy(tiny_model_dirs[KIND], path, PROMPTS, MAX_TOKENS)
        texts[name] = [tokenizer.decode(i, skip_special_tokens=True) for i in ids]
    return texts


def test_models_lists_adapters_with_parent(server, adapters) -> None:
    cards = {m.id: m for m in server.client().models.list().data}
    assert set(cards) == {BASE, "a4", "b8"}
    assert cards["a4"].parent == BASE and cards["b8"].parent == BASE
    assert cards["a4"].root == adapters["a4"]
    assert getattr(cards[BASE], "parent", None) is None


def _complete(server: ServerThread, model: str, prompt: str, stream: bool) -> tuple[str, str]:
    client = server.client()
    if not stream:
        out = client.completions.create(
            model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0
        )
        return out.choices[0].text, out.model
    chunks = list(
        client.completions.create(
            model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0, stream=True
        )
    )
    return "".join(c.choices[0].text for c in chunks if c.choices), chunks[0].model


def test_adapters_and_base_at_once(server, expected) -> None:
    jobs = [(m, i, s) for m in (BASE, "a4", "b8") for i in range(len(PROMPTS)) for s in (0, 1)]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda j: _complete(server, j[0], PROMPTS[j[1]], bool(j[2])), jobs))
    for (model, index, stream), (text, answered_as) in zip(jobs, results):
        assert text == expected[model][index], (model, index, stream)
        assert answered_as == model
    assert expected["a4"] != expected[BASE] and expected["b8"] != expected[BASE]


def test_chat_with_adapter(server) -> None:
    out = server.client().chat.completions.create(
        model="b8", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0.0
    )
    assert out.model == "b8"


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_unknown_model_is_404(server, route) -> None:
    body: dict[str, object] = {"model": "nope", "max_tokens": 2}
    if route == "completions":
        body["prompt"] = "Hi"
    else:
        body["messages"] = [{"role": "user", "content": "Hi"}]
    response = httpx.post(f"{server.url}/v1/{route}", json=body, timeout=30)
    assert response.status_code == 404
    error = response.json()  # vLLM's (flat) ErrorResponse
    assert error["message"] == "The model `nope` does not exist."
    assert error["type"] == "NotFoundError"


@pytest.mark.parametrize("route", ["load_lora_adapter", "unload_lora_adapter"])
def test_runtime_routes_absent_by_default(server, adapters, route) -> None:
    # vLLM's rule: only VLLM_ALLOW_RUNTIME_LORA_UPDATING adds them (test_lora_runtime.py).
    body = {"lora_name": "c", "lora_path": adapters["a4"]}
    assert httpx.post(f"{server.url}/v1/{route}", json=body, timeout=30).status_code == 404


@pytest.mark.parametrize(
    "value,name,base",
    [
        ("x=/some/dir", "x", None),
        ('{"name": "y", "path": "/d", "base_model_name": "m"}', "y", "m"),
    ],
)
def test_lora_modules_flag_forms(value: str, name: str, base: str | None) -> None:
    args = make_arg_parser().parse_args(["--enable-lora", "--lora-modules", value])
    (module,) = args.lora_modules
    assert (module.name, module.base_model_name) == (name, base)
    with pytest.raises(SystemExit):
        make_arg_parser().parse_args(["--lora-modules", "no-equals-sign"])
