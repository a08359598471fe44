"""The pooling routes of the OpenAI-compatible server against HF transformers.

Two servers for the module (threads on free local ports, PP=1): a tiny LLaMA served as a
last-token embedder (`runner="pooling", convert="embed"`, Matryoshka declared in its config)
and a tiny BERT cross-encoder (`BertForSequenceClassification`, one label: /score, /rerank,
/classify; pairs carry token types 0/1). The oracle is HF: `AutoModel`'s last hidden state at
each text's last token, L2-normalised, and the classifier's logit through a sigmoid on the
tokenizer's pair encoding. `/v1/embeddings` is driven by the official `openai` client (its
default asks for base64 and decodes it).
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import time
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from tests.utils import tiny_models
from tests.utils.server_utils import ServerThread
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.engine.async_llm_engine import AsyncLLMEngine

MODEL = "tiny-embed"
SCORER = "tiny-scorer"
TEXTS = tiny_models.PROMPTS[:5]
DOCS = [
    "Paris is the capital of France.",
    "The quick brown fox.",
    "def fibonacci(n): return n",
    "Stars are far away.",
]
DUMMY_CHAT_TEMPLATE = (
    "{% for message in messages %}{{message['role'] + ': ' + message['content'] + '\\n'}}"
    "{% endfor %}"
)
SETTINGS = dict(kv_cache_space=0.05, swap_space=0.01, disable_log_stats=False)


# -- models and the HF oracle -----------------------------------------------------------------


@pytest.fixture(scope="module")
def embed_dir(tiny_model_dirs, tmp_path_factory) -> str:
    """The tiny LLaMA, declared Matryoshka (so `dimensions` is allowed)."""
    out = str(tmp_path_factory.mktemp("embed") / "model")
    shutil.copytree(tiny_model_dirs["llama-gqa-untied"], out)
    path = os.path.join(out, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["is_matryoshka"] = True
    with open(path, "w") as f:
        json.dump(config, f)
    return out


@pytest.fixture(scope="module")
def scorer_dir(tmp_path_factory) -> str:
    """A tiny BertForSequenceClassification with one label (a cross-encoder) and its
    WordPiece tokenizer (token_type_ids 0/1 for a pair)."""
    from tests.utils import tiny_encoders

    root = tmp_path_factory.mktemp("scorer")
    tokenizer_dir = str(root / "tokenizer")
    tiny_encoders.build_wordpiece_tokenizer(tokenizer_dir)
    return tiny_encoders.build_encoder("bert-cls", str(root / "model"), tokenizer_dir)


@pytest.fixture(scope="module")
def hf_embed(embed_dir):
    """ids -> HF's embedding (last token of AutoModel's last hidden state, normalised)."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(embed_dir, dtype=torch.float32).eval()

    def embed(ids: list[int], dims: int | None = None, normalize: bool = True) -> np.ndarray:
        with torch.inference_mode():
            hidden = model(torch.tensor([ids])).last_hidden_state[0, -1]  # [hidden]
        if dims is not None:
            hidden = hidden[:dims]
        if not normalize:
            return hidden.numpy()
        return torch.nn.functional.normalize(hidden, dim=-1).numpy()

    return embed


@pytest.fixture(scope="module")
def hf_score(scorer_dir):
    """ids -> HF's sigmoid(logit) of the one-label classifier."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(scorer_dir, dtype=torch.float32)
    model.eval()

    def score(encoded: Any) -> float:
        inputs = {k: torch.tensor([v]) for k, v in encoded.items()}
        with torch.inference_mode():
            return float(torch.sigmoid(model(**inputs).logits[0, 0]))

    return score


@pytest.fixture(scope="module")
def bert_tokenizer(scorer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(scorer_dir)


@pytest.fixture(scope="module")
def tokenizer(embed_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(embed_dir)


def _server(model_dir: str, name: str, chat_template: str | None = None, **settings) -> Any:
    args = AsyncEngineArgs(
        model=model_dir, served_model_name=name, disable_log_requests=True, **settings
    )
    return ServerThread(AsyncLLMEngine.from_engine_args(args), chat_template=chat_template)


@pytest.fixture(scope="module")
def embed_server(embed_dir):
    srv = _server(
        embed_dir, MODEL, DUMMY_CHAT_TEMPLATE, runner="pooling", convert="embed", **SETTINGS
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def score_server(scorer_dir):
    srv = _server(scorer_dir, SCORER, runner="pooling", **SETTINGS)
    yield srv
    srv.stop()


def post(srv: ServerThread, path: str, body: dict) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, timeout=60)


def close(a, b, atol: float = 1e-5) -> None:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    assert a.shape == b.shape
    assert np.abs(a - b).max() < atol, np.abs(a - b).max()
    cos = float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))
    assert cos > 1 - 1e-5, cos


# -- /v1/embeddings -----------------------------------------------------------------------------


def test_embeddings_through_the_openai_client(embed_server, tokenizer, hf_embed):
    client = embed_server.client()
    ids = [tokenizer.encode(t) for t in TEXTS]
    # The client's default: it asks for base64 and decodes the float32 bytes itself.
    decoded = client.embeddings.create(model=MODEL, input=TEXTS)
    floats = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    raw = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="base64")
    assert decoded.model == MODEL and decoded.object == "list"
    assert [d.index for d in floats.data] == list(range(len(TEXTS)))
    for i, token_ids in enumerate(ids):
        want = hf_embed(token_ids)
        close(floats.data[i].embedding, want)
        close(decoded.data[i].embedding, want)
        vector = np.frombuffer(base64.b64decode(raw.data[i].embedding), dtype="<f4")
        close(vector, want)
    total = sum(len(t) for t in ids)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == total


def test_embeddings_of_token_ids_and_one_string(embed_server, tokenizer, hf_embed):
    client = embed_server.client()
    ids = [tokenizer.encode(t) for t in TEXTS[:3]]
    many = client.embeddings.create(model=MODEL, input=ids, encoding_format="float")
    one = client.embeddings.create(model=MODEL, input=ids[1], encoding_format="float")
    text = client.embeddings.create(model=MODEL, input=TEXTS[2], encoding_format="float")
    for i, token_ids in enumerate(ids):
        close(many.data[i].embedding, hf_embed(token_ids))
    close(one.data[0].embedding, hf_embed(ids[1]))
    close(text.data[0].embedding, hf_embed(ids[2]))
    assert one.usage.prompt_tokens == len(ids[1])


def test_dimensions_truncate_then_normalize(embed_server, tokenizer, hf_embed):
    client = embed_server.client()
    out = client.embeddings.create(
        model=MODEL, input=TEXTS[:2], dimensions=16, encoding_format="float"
    )
    for i, text in enumerate(TEXTS[:2]):
        assert len(out.data[i].embedding) == 16
        close(out.data[i].embedding, hf_embed(tokenizer.encode(text), dims=16))


def test_vllm_extras_normalize_and_truncate(embed_server, tokenizer, hf_embed):
    ids = tokenizer.encode(TEXTS[2])
    body = {"model": MODEL, "input": TEXTS[2], "truncate_prompt_tokens": 5}
    out = post(embed_server, "/v1/embeddings", body).json()
    close(out["data"][0]["embedding"], hf_embed(ids[-5:]))  # the last 5 tokens kept
    assert out["usage"]["prompt_tokens"] == 5
    raw = post(embed_server, "/v1/embeddings", {"input": TEXTS[0], "normalize": False}).json()
    vector = np.asarray(raw["data"][0]["embedding"])
    assert abs(np.linalg.norm(vector) - 1.0) > 1e-3  # the raw hidden state
    close(vector / np.linalg.norm(vector), hf_embed(tokenizer.encode(TEXTS[0])))


# Adapted from vLLM's tests/entrypoints/openai/test_embedding.py (its model is on the hub):
# chat messages embed as their rendered template does, token-id usage, truncation limits.
def test_conversation_embedding_equals_its_rendered_prompt(embed_server, tokenizer):
    messages = [
        {"role": "user", "content": "The cat sat on the mat."},
        {"role": "assistant", "content": "A feline was resting on a rug."},
        {"role": "user", "content": "Stars twinkle brightly in the night sky."},
    ]
    chat = post(embed_server, "/v1/embeddings", {"messages": messages, "encoding_format": "float"})
    assert chat.status_code == 200, chat.text
    prompt = tokenizer.apply_chat_template(
        messages, chat_template=DUMMY_CHAT_TEMPLATE, add_generation_prompt=False, tokenize=False
    )
    client = embed_server.client()
    plain = client.embeddings.create(
        model=MODEL,
        input=prompt,
        encoding_format="float",
        extra_body={"add_special_tokens": False},  # as the chat form
    )
    assert chat.json()["data"] == plain.model_dump(mode="json")["data"]
    assert chat.json()["usage"]["prompt_tokens"] == plain.usage.prompt_tokens


def test_token_usage_and_truncation_limits(embed_server):
    client = embed_server.client()
    ids = [[4, 5, 7, 9, 20], [15, 29, 499], [24, 24, 24, 24, 24], [25, 32, 64, 77]]
    out = client.embeddings.create(model=MODEL, input=ids, encoding_format="float")
    assert len(out.data) == 4 and len(out.data[0].embedding) == 64
    assert out.usage.prompt_tokens == out.usage.total_tokens == 17
    long_ids = list(range(1, 22))
    cut = client.embeddings.create(
        model=MODEL, input=long_ids, extra_body={"truncate_prompt_tokens": 10}
    )
    assert cut.usage.prompt_tokens == 10
    import openai

    with pytest.raises(openai.BadRequestError, match="truncate_prompt_tokens"):
        client.embeddings.create(
            model=MODEL, input="x", extra_body={"truncate_prompt_tokens": 8193}
        )


def test_pooling_route_gives_the_pooler_output(embed_server, tokenizer, hf_embed):
    ids = tokenizer.encode(TEXTS[1])
    raw = post(embed_server, "/pooling", {"input": TEXTS[1], "normalize": False})
    assert raw.status_code == 200, raw.text
    body = raw.json()
    assert body["object"] == "list" and body["data"][0]["object"] == "pooling"
    # "encode" on a last-token embedder, not normalised: the hidden state as it is.
    close(body["data"][0]["data"], hf_embed(ids, normalize=False), atol=1e-4)
    assert body["usage"]["prompt_tokens"] == len(ids)
    embed = post(embed_server, "/pooling", {"input": [ids], "task": "embed"}).json()
    close(embed["data"][0]["data"], hf_embed(ids))
    packed = post(
        embed_server, "/pooling", {"input": TEXTS[1], "task": "embed", "encoding_format": "base64"}
    ).json()
    vector = np.frombuffer(base64.b64decode(packed["data"][0]["data"]), dtype="<f4")
    close(vector, hf_embed(ids))
    refused = post(embed_server, "/pooling", {"input": "x", "task": "classify"})
    assert refused.status_code == 400 and refused.json()["param"] == "task"


def test_pooling_requests_are_counted_in_the_metrics(embed_server, tokenizer):
    from prometheus_client.parser import text_string_to_metric_families

    def samples() -> dict[str, float]:
        text = httpx.get(embed_server.url + "/metrics", timeout=10).text
        return {
            f"{s.name}{sorted(s.labels.items())}": s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name.startswith("vllm:")
        }

    label = [("model_name", MODEL)]
    success = f"vllm:request_success_total{sorted([*label, ('finished_reason', 'stop')])}"
    prompt_tokens = f"vllm:prompt_tokens_total{label}"
    before = samples()
    client = embed_server.client()
    client.embeddings.create(model=MODEL, input=TEXTS[:3], encoding_format="float")
    tokens = sum(len(tokenizer.encode(t)) for t in TEXTS[:3])
    deadline = time.time() + 10
    while time.time() < deadline:  # the stats of the last step land just after its outputs
        after = samples()
        if after.get(success, 0) - before.get(success, 0) >= 3:
            break
        time.sleep(0.1)
    assert after.get(success, 0) - before.get(success, 0) == 3
    assert after.get(prompt_tokens, 0) - before.get(prompt_tokens, 0) == tokens


def test_embedding_score_is_the_cosine_of_embeddings(embed_server, tokenizer, hf_embed):
    body = {"model": MODEL, "text_1": TEXTS[0], "text_2": TEXTS[1:4]}
    out = post(embed_server, "/score", body).json()
    query = hf_embed(tokenizer.encode(TEXTS[0]))
    for item, text in zip(out["data"], TEXTS[1:4]):
        want = float(query @ hf_embed(tokenizer.encode(text)))
        assert abs(item["score"] - want) < 1e-5


# -- /score, /rerank, /classify on a cross-encoder -----------------------------------------------


def _pair(tokenizer, a: str, b: str) -> Any:
    """[CLS] a [SEP] b [SEP] with token types 0/1, as the tokenizer builds it."""
    return dict(tokenizer(a, text_pair=b))


def test_score_one_to_one_one_to_n_and_n_to_n(score_server, bert_tokenizer, hf_score):
    one = post(score_server, "/score", {"text_1": DOCS[0], "text_2": DOCS[1]}).json()
    assert one["data"][0]["score"] == pytest.approx(
        hf_score(_pair(bert_tokenizer, DOCS[0], DOCS[1])), abs=1e-5
    )
    fan = post(score_server, "/score", {"text_1": "capital", "text_2": DOCS}).json()
    pairs = post(score_server, "/v1/score", {"text_1": DOCS[:3], "text_2": DOCS[1:]}).json()
    for item, doc in zip(fan["data"], DOCS):
        ids = _pair(bert_tokenizer, "capital", doc)
        assert item["score"] == pytest.approx(hf_score(ids), abs=1e-5)
    for item, a, b in zip(pairs["data"], DOCS[:3], DOCS[1:]):
        assert item["score"] == pytest.approx(hf_score(_pair(bert_tokenizer, a, b)), abs=1e-5)
    assert [d["index"] for d in pairs["data"]] == [0, 1, 2]
    tokens = sum(len(_pair(bert_tokenizer, "capital", d)["input_ids"]) for d in DOCS)
    assert fan["usage"]["prompt_tokens"] == fan["usage"]["total_tokens"] == tokens


def test_rerank_orders_by_score_with_top_n(score_server, bert_tokenizer, hf_score):
    want = [hf_score(_pair(bert_tokenizer, "capital", d)) for d in DOCS]
    order = sorted(range(len(DOCS)), key=lambda i: -want[i])
    body = {"model": SCORER, "query": "capital", "documents": DOCS}
    full = post(score_server, "/rerank", body).json()
    assert [r["index"] for r in full["results"]] == order
    for r in full["results"]:
        assert r["relevance_score"] == pytest.approx(want[r["index"]], abs=1e-5)
        assert r["document"]["text"] == DOCS[r["index"]]
    top = post(score_server, "/v1/rerank", {**body, "top_n": 2, "return_documents": False})
    top_results = top.json()["results"]
    assert [r["index"] for r in top_results] == order[:2]
    assert all("document" not in r for r in top_results)
    assert post(score_server, "/v2/rerank", body).json()["results"] == full["results"]


def test_classify_probs_and_label(score_server, bert_tokenizer, hf_score):
    out = post(score_server, "/classify", {"model": SCORER, "input": DOCS[:3]}).json()
    for item, doc in zip(out["data"], DOCS[:3]):
        assert item["num_classes"] == 1 and item["label"] == "LABEL_0"
        assert item["probs"][0] == pytest.approx(hf_score(dict(bert_tokenizer(doc))), abs=1e-5)
    raw = post(score_server, "/classify", {"input": DOCS[0], "use_activation": False}).json()
    logit = raw["data"][0]["probs"][0]
    assert 1 / (1 + np.exp(-logit)) == pytest.approx(out["data"][0]["probs"][0], abs=1e-5)


# -- bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": []}, "input"),
        ({"input": [[1, 2], "text"]}, "input"),
        ({"input": [10**9]}, "input"),
        ({"input": "x", "encoding_format": "hex"}, "encoding_format"),
        ({"input": "x", "truncate_prompt_tokens": 10**6}, "truncate_prompt_tokens"),
        ({"input": "x", "priority": 1}, "priority"),
        ({"input": "x", "dimensions": 0}, "dimensions"),
        ({"input": "x " * 600}, "input"),
    ],
)
def test_bad_embedding_requests_are_400s_naming_the_parameter(embed_server, body, param):
    response = post(embed_server, "/v1/embeddings", {"model": MODEL, **body})
    assert response.status_code == 400, response.text
    assert response.json()["param"] == param, response.json()


def test_routes_a_model_does_not_run(embed_server, score_server):
    refused = post(score_server, "/v1/embeddings", {"input": "x"})
    assert refused.status_code == 400
    assert refused.json()["message"] == "The model does not support Embeddings API"
    refused = post(embed_server, "/classify", {"input": "x"})
    assert refused.json()["message"] == "The model does not support Classification API"
    lengths = post(score_server, "/score", {"text_1": DOCS[:2], "text_2": DOCS[:3]})
    assert lengths.status_code == 400
    assert lengths.json()["message"] == "Input lengths must be either 1:1, 1:N or N:N"
    missing = post(score_server, "/rerank", {"query": "q"})
    assert missing.status_code == 400 and missing.json()["param"] == "documents"
    unknown = post(embed_server, "/v1/embeddings", {"model": "nope", "input": "x"})
    assert unknown.status_code == 404


def test_a_generative_model_refuses_the_pooling_routes(tiny_model_dirs):
    """The app over a stand-in engine (the routes refuse before they reach it) whose model
    config is the real one of a generative model."""
    from types import SimpleNamespace

    from fastapi.testclient import TestClient
    from transformers import AutoTokenizer

    from vllm.config import ModelConfig
    from vllm.entrypoints.openai.api_server import build_app

    model_dir = tiny_model_dirs["llama-gqa-tied"]
    config = ModelConfig(model=model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    engine = SimpleNamespace(
        engine=SimpleNamespace(
            model_config=config,
            served_model_name="gen",
            scheduler_config=SimpleNamespace(max_model_len=512, max_num_seqs=8),
            scheduler=SimpleNamespace(prompt_limit=512),
            get_tokenizer=lambda: tokenizer,
        )
    )
    client = TestClient(build_app(engine))
    for path, body, api in [
        ("/v1/embeddings", {"input": "x"}, "Embeddings"),
        ("/pooling", {"input": "x"}, "Pooling"),
        ("/classify", {"input": "x"}, "Classification"),
        ("/score", {"text_1": "a", "text_2": "b"}, "Score"),
        ("/rerank", {"query": "a", "documents": ["b"]}, "Rerank (Score)"),
    ]:
        response = client.post(path, json=body)
        assert response.status_code == 400, path
        assert response.json()["message"] == f"The model does not support {api} API"
