"""BERT / RoBERTa / XLM-RoBERTa stage modules against HF transformers (fp32).

The modules run directly on a hand-packed batch (prompts of different lengths back to back, as
the engine packs prefills), whole and as two chained stage modules (a PP split): last hidden
states and classifier logits equal HF's within 1e-5 (max-abs and cosine)."""

from __future__ import annotations

import pytest
import torch

from tests.utils import tiny_encoders as te
from vllm.config import ModelConfig
from vllm.model_executor.input_metadata import InputMetadata
from vllm.model_executor.models.utils import StageLayout
from vllm.model_executor.weight_utils import load_stage_model

TOL = 1e-5
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def encoder_dirs(tmp_path_factory):
    return te.encoder_dirs(str(tmp_path_factory.mktemp("tiny_encoders")))


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
    """The stage modules chained on one packed batch: last hidden states [T, hidden]."""
    lens = [len(e["input_ids"]) for e in encs]
    ids = torch.tensor([t for e in encs for t in e["input_ids"]])
    types = None
    if "token_type_ids" in encs[0]:
        types = torch.tensor([t for e in encs for t in e["token_type_ids"]])
    positions = torch.cat([torch.arange(n) for n in lens])
    md = packed_metadata(lens)
    with torch.inference_mode():
        hidden = stages[0](ids, positions, [], md, token_type_ids=types)
        for stage in stages[1:]:
            hidden = stage(None, positions, [], md, hidden_states=hidden)
    return hidden


@pytest.mark.parametrize("kind", list(te.KINDS))
def test_stage_modules_equal_hf(kind, encoder_dirs):
    from transformers import AutoTokenizer

    model_dir = encoder_dirs[kind]
    config = ModelConfig(model=model_dir, dtype="float32")
    n = config.get_num_layers()
    whole = [load_stage_model(config, StageLayout(0, n, True, True), CPU)]
    split = [
        load_stage_model(config, StageLayout(0, 1, True, False), CPU),
        load_stage_model(config, StageLayout(1, n, False, True), CPU),
    ]
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
                logits = stages[-1].classify(hidden[firsts])
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
