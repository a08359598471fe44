"""Ray Data's embedding task (vllm.batch, `task_type="embed"`) at PP=2: a column of texts in,
a column of vectors out, every row exactly once, each vector equal to HF transformers' (the
last token of AutoModel's last hidden state, L2-normalised) within 1e-5."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("ray.data")

from tests.utils import tiny_models  # noqa: E402
from vllm.batch import EMBED_OUTPUT_COLUMNS, build_processor, read_outputs, write_dataset  # noqa: E402

NUM_ROWS = 8
ENGINE = dict(kv_cache_space=0.05, swap_space=0.01)


def _texts() -> list[str]:
    base = tiny_models.PROMPTS
    return [f"{base[i % len(base)]} {i}" for i in range(NUM_ROWS)]


def _hf_embeddings(model_dir: str, texts: list[str]) -> list[np.ndarray]:
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for text in texts:
            ids = torch.tensor([tokenizer.encode(text)])
            hidden = model(ids).last_hidden_state[0, -1]  # [hidden]
            out.append(torch.nn.functional.normalize(hidden, dim=-1).numpy())
    return out


def test_embed_column_at_pp2(ray_session, tiny_model_dirs, tmp_path):
    import ray.data

    model_dir = tiny_model_dirs["llama-gqa-untied"]
    texts = _texts()
    ds = ray.data.from_items([{"id": i, "prompt": t} for i, t in enumerate(texts)])
    out_path = str(tmp_path / "embeddings.parquet")
    with build_processor(
        model_dir,
        task_type="embed",
        pipeline_parallel_size=2,
        batch_size=4,
        engine_kwargs=ENGINE,
        device="cpu",
    ) as processor:
        write_dataset(processor(ds), out_path)
    df = read_outputs(out_path)
    assert set(EMBED_OUTPUT_COLUMNS) <= set(df.columns)
    assert sorted(df["id"].tolist()) == list(range(NUM_ROWS)), "each row exactly once"
    want = _hf_embeddings(model_dir, texts)
    for row in df.itertuples():
        assert row.error == "", row.error
        assert row.prompt == texts[row.id]
        vector = np.asarray(row.embeddings, dtype=np.float64)
        assert vector.shape == want[row.id].shape
        assert np.abs(vector - want[row.id]).max() < 1e-5
