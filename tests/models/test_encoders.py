"""BERT / RoBERTa / XLM-RoBERTa against HF transformers (fp32, within 1e-5 max-abs and cosine).

First the stage modules directly, on a hand-packed batch (prompts of different lengths back to
back, as the engine packs prefills), whole and as two chained stage modules (a PP split): last
hidden states and classifier logits equal HF's padded batch with its attention_mask. Then
through the engine: `LLM.embed` (CLS, MEAN) equals sentence-transformers' pooling of HF's
hidden states, `LLM.score` (1:1, 1:N, N:N) the sigmoid of AutoModelForSequenceClassification's
logit with the rerank order, `LLM.classify` its softmax; at PP 1, PP 2 and TP 2."""

from __future__ import annotations

import pytest
import torch

from tests.utils import tiny_encoders as te
from vllm.config import ModelConfig
from vllm.model_executor.input_metadata import InputMetadata
from vllm.model_executor.models.stage_chain import StageChain
from vllm.model_executor.models.utils import StageLayout
from vllm.model_executor.weight_utils import load_stage_model

TOL = 1e-5
CPU = torch.device("cpu")


# XLM-RoBERTa's embedder is RoBERTa's class under another name: its cross-encoder stands in.
KINDS = ["bert", "bert-cls", "roberta", "roberta-cls", "xlm-roberta-cls"]


@pytest.fixture(scope="module")
def encoder_dirs(tmp_path_factory):
    return te.encoder_dirs(str(tmp_path_factory.mktemp("tiny_encoders")), KINDS)


def packed_metadata(lens: list[int]) -> InputMetadata:
    """The metadata of a step of whole prompts of lengths `lens` (no KV slots: encoders)."""
    empty = torch.zeros(0, dtype=torch.long)
    return InputMetadata(
        num_prefills=len(lens),
        num_prefill_tokens=sum(lens),
        num_decode_tokens=0,
        slot_mapping=empty,
        prefill_seq_lens=torch.tensor(lens),
        decode_context_lens=empty,
        decode_block_tables=torch.zeros(0, 0, dtype=torch.long),
    )


def encodings(tokenizer) -> list[dict[str, list[int]]]:
    """Single sentences and (query, document) pairs, as the model's tokenizer encodes them."""
    singles = [dict(tokenizer(s)) for s in te.SENTENCES]
    return singles + [dict(tokenizer(te.QUERY, doc)) for doc in te.DOCUMENTS]


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    max_abs = (got - want).abs().max().item()
    cosine = torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0).item()
    assert max_abs <= TOL and 1 - cosine <= TOL, f"{what}: max-abs {max_abs}, cosine {cosine}"


def run_stages(stages, encs) -> torch.Tensor:
    """A stage module (or chain) on one packed batch: last hidden states [T, hidden]."""
    lens = [len(e["input_ids"]) for e in encs]
    ids = torch.tensor([t for e in encs for t in e["input_ids"]])
    types = None
    if "token_type_ids" in encs[0]:
        types = torch.tensor([t for e in encs for t in e["token_type_ids"]])
    positions = torch.cat([torch.arange(n) for n in lens])
    md = packed_metadata(lens)
    with torch.inference_mode():
        return stages(ids, positions, [], md, token_type_ids=types)


@pytest.mark.parametrize("kind", KINDS)
def test_stage_modules_equal_hf(kind, encoder_dirs):
    from transformers import AutoTokenizer

    model_dir = encoder_dirs[kind]
    config = ModelConfig(model=model_dir, dtype="float32")
    n = config.get_num_layers()
    whole = load_stage_model(config, StageLayout(0, n, True, True), CPU)
    # Two stage modules chained as one stage runs them (what a stage that took over its
    # neighbour's layers runs); the stream between them is what PP 2 sends.
    split = StageChain(
        [
            load_stage_model(config, StageLayout(0, 1, True, False), CPU),
            load_stage_model(config, StageLayout(1, n, False, True), CPU),
        ],
        (config.get_num_kv_heads(), config.get_head_size()),
    )
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    encs = encodings(tokenizer)
    lens = [len(e["input_ids"]) for e in encs]
    want, want_logits = te.hf_outputs(te.load_hf(model_dir), tokenizer, encs)
    firsts = torch.tensor([0] + lens[:-1]).cumsum(0)  # each sequence's [CLS] / <s> row
    for stages, layout in ((whole, "PP 1"), (split, "PP 2")):
        hidden = run_stages(stages, encs)
        for index, (got, ref) in enumerate(zip(torch.split(hidden, lens), want)):
            assert_close(got, ref, f"{kind} {layout} sequence {index}")
        if kind.endswith("-cls"):
            with torch.inference_mode():
                head = stages.parts[-1] if isinstance(stages, StageChain) else stages
                logits = head.classify_head(hidden[firsts])
            assert_close(logits, want_logits, f"{kind} {layout} logits")


def test_roberta_positions_follow_hf_per_prompt():
    """Counted within each packed prompt from padding_idx + 1; a padding token inside a
    prompt sits at padding_idx and is not counted (HF's create_position_ids_from_input_ids)."""
    from transformers.models.roberta.modeling_roberta import RobertaEmbeddings

    from vllm.model_executor.models.roberta import roberta_position_ids

    pad = 1
    prompts = [[0, 7, 8, 2], [0, 9, pad, 5, 2], [0, 2], [0, 6, 6, 6, 6, 6, 2]]
    ids = torch.tensor([t for p in prompts for t in p])
    got = roberta_position_ids(ids, [len(p) for p in prompts], pad)
    want = torch.cat(
        [RobertaEmbeddings.create_position_ids_from_input_ids(torch.tensor([p]), pad)[0]
         for p in prompts]
    )  # fmt: skip
    assert got.tolist() == want.tolist()


def test_encoder_attention_refuses_decodes_and_cached_context(encoder_dirs):
    config = ModelConfig(model=encoder_dirs["bert"], dtype="float32")
    stage = load_stage_model(config, StageLayout(1, 2, False, False), CPU)
    hidden = torch.randn(5, config.get_hidden_size())
    positions = torch.arange(5)
    decoding = packed_metadata([4])
    decoding.num_decode_tokens = 1
    with pytest.raises(ValueError, match="never decode"):
        stage(None, positions, [], decoding, hidden_states=hidden)
    chunk = packed_metadata([5])
    chunk.prefill_context_lens = torch.tensor([3])
    chunk._prefill_context_list = [3]
    with pytest.raises(ValueError, match="whole prompt in one step"):
        stage(None, positions, [], chunk, hidden_states=hidden)


def test_bad_token_types_and_long_prompts_are_value_errors(encoder_dirs):
    config = ModelConfig(model=encoder_dirs["bert"], dtype="float32")
    stage = load_stage_model(config, StageLayout(0, 1, True, False), CPU)
    ids = torch.tensor([2, 50, 3])
    md = packed_metadata([3])
    with pytest.raises(ValueError, match=r"token_type_ids must lie in \[0, 2\)"):
        stage(ids, torch.arange(3), [], md, token_type_ids=torch.tensor([0, 2, 0]))
    max_positions = config.hf_config.max_position_embeddings
    with pytest.raises(ValueError, match="max_position_embeddings"):
        stage(ids, torch.arange(3) + max_positions - 2, [], md)


def test_relative_position_embeddings_are_refused():
    from vllm.model_executor.models.bert import BertModel

    config = te.encoder_config("bert", _FakeTokenizer())
    config.position_embedding_type = "relative_key"
    with pytest.raises(ValueError, match="Only 'absolute' position_embedding_type"):
        BertModel(config, StageLayout(0, 1, True, True))


class _FakeTokenizer:
    pad_token_id = 0

    def __len__(self) -> int:
        return 100


# ---- through the engine: LLM.embed / score / classify at PP 1, PP 2 and TP 2 ---------------


def hf_reference(model_dir: str, texts: list[str], pairs: list[str] | None = None):
    """HF's last hidden states of each text (or (text, pair)) and the classifier's logits."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if pairs is None:
        encs = [dict(tokenizer(t)) for t in texts]
    else:
        encs = [dict(tokenizer(t, p)) for t, p in zip(texts, pairs)]
    return te.hf_outputs(te.load_hf(model_dir), tokenizer, encs)


def st_pool(hidden: torch.Tensor, pooling: str) -> torch.Tensor:
    """sentence-transformers' pooling of one sequence's hidden states, then normalised."""
    pooled = hidden[0] if pooling == "CLS" else hidden.mean(dim=0)
    return torch.nn.functional.normalize(pooled, dim=-1)


def check_embeddings(llm, model_dir: str, pooling: str) -> None:
    outputs = llm.embed(te.SENTENCES, use_tqdm=False)
    hidden, _ = hf_reference(model_dir, te.SENTENCES)
    assert len(outputs) == len(te.SENTENCES)
    for index, (output, ref) in enumerate(zip(outputs, hidden)):
        assert len(output.prompt_token_ids) == ref.shape[0]
        got = torch.tensor(output.outputs.embedding)
        assert_close(got, st_pool(ref, pooling), f"{pooling} embedding {index}")


def check_scores(llm, model_dir: str) -> None:
    """1:N, N:N and 1:1 scores equal sigmoid(HF's logit) of each pair; the rerank order
    (documents by descending score) is HF's."""
    _, logits = hf_reference(model_dir, [te.QUERY] * len(te.DOCUMENTS), te.DOCUMENTS)
    want = torch.sigmoid(logits[:, 0])  # [N]
    one_to_n = llm.score(te.QUERY, te.DOCUMENTS, use_tqdm=False)
    n_to_n = llm.score([te.QUERY] * len(te.DOCUMENTS), te.DOCUMENTS, use_tqdm=False)
    (one,) = llm.score(te.QUERY, te.DOCUMENTS[2], use_tqdm=False)
    for outputs in (one_to_n, n_to_n):
        assert_close(torch.tensor([o.outputs.score for o in outputs]), want, "scores")
    assert abs(one.outputs.score - want[2].item()) <= TOL
    got_order = sorted(range(len(one_to_n)), key=lambda i: -one_to_n[i].outputs.score)
    assert got_order == torch.argsort(want, descending=True).tolist()


def make_llm(model_dir: str, **kwargs):
    from vllm import LLM

    return LLM(model_dir, dtype="float32", disable_log_stats=True, **kwargs)


@pytest.mark.parametrize("kind", ["bert", "roberta"])
def test_embed_cls_pooling_equals_hf(kind, encoder_dirs):
    """vLLM's default for BERT-family embedders: the [CLS] / <s> row, normalised."""
    llm = make_llm(encoder_dirs[kind])
    try:
        assert llm.llm_engine.model_config.pooler_config.pooling_type == "CLS"
        check_embeddings(llm, encoder_dirs[kind], "CLS")
        if kind == "roberta":
            check_roberta_length_limit(llm)
    finally:
        llm.shutdown()


def check_roberta_length_limit(llm) -> None:
    """Positions from padding_idx + 1: a table of P rows serves P - padding_idx - 1 tokens.
    A prompt of that length embeds; one token more is refused up front, and the engine
    serves on."""
    config = llm.llm_engine.model_config
    hf_config = config.hf_config
    limit = hf_config.max_position_embeddings - hf_config.pad_token_id - 1
    assert config.max_model_len == limit
    ids = [hf_config.bos_token_id] + [300] * (limit - 2) + [hf_config.eos_token_id]
    (full,) = llm.embed({"prompt_token_ids": ids}, use_tqdm=False)
    assert len(full.outputs.embedding) == hf_config.hidden_size
    with pytest.raises(ValueError, match="maximum model length"):
        llm.embed({"prompt_token_ids": ids + [300]}, use_tqdm=False)
    (after,) = llm.embed("Paris", use_tqdm=False)
    assert len(after.outputs.embedding) == hf_config.hidden_size


@pytest.mark.parametrize("kind", ["bert-cls", "xlm-roberta-cls"])
def test_cross_encoder_scores_equal_hf(kind, encoder_dirs):
    llm = make_llm(encoder_dirs[kind])
    try:
        check_scores(llm, encoder_dirs[kind])
    finally:
        llm.shutdown()


def test_classify_equals_hf_softmax(encoder_dirs):
    model_dir = encoder_dirs["roberta-cls"]
    llm = make_llm(model_dir)
    try:
        outputs = llm.classify(te.SENTENCES, use_tqdm=False)
    finally:
        llm.shutdown()
    _, logits = hf_reference(model_dir, te.SENTENCES)
    got = torch.tensor([o.outputs.probs for o in outputs])
    assert_close(got, torch.softmax(logits, dim=-1), "class probabilities")


@pytest.mark.parametrize(
    "kind, parallel, pooler",
    [
        ("bert-cls", {"pipeline_parallel_size": 2}, None),
        ("bert", {"tensor_parallel_size": 2}, "MEAN"),
    ],
    ids=["bert-cls-pp2", "bert-mean-tp2"],
)
def test_pipeline_and_tensor_parallel_equal_hf(kind, parallel, pooler, encoder_dirs):
    """Two stages (embeddings and token types on the first, the classifier on the last) score
    pairs as HF does; two TP ranks (vocabulary rows, q/k/v heads, MLP columns sharded) embed
    with MEAN pooling (the engine's pooler_config) as sentence-transformers does."""
    extra = {"pooler_config": {"pooling_type": pooler}} if pooler else {}
    llm = make_llm(encoder_dirs[kind], distributed_executor_backend="mp", **parallel, **extra)
    try:
        if kind.endswith("-cls"):
            check_scores(llm, encoder_dirs[kind])
        else:
            check_embeddings(llm, encoder_dirs[kind], pooler)
    finally:
        llm.shutdown()
