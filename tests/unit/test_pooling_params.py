"""PoolingParams and PoolerConfig (torch-free): vLLM's defaults, merging and messages; the
pooling defaults read from sentence-transformers files."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from vllm.pooling_params import PoolingParams
from vllm.transformers_utils.pooler_config import (
    PoolerConfig,
    default_pooler_config,
    sentence_transformers_pooling,
)

pytestmark = pytest.mark.fast


def model(pooler: PoolerConfig, **kwargs) -> SimpleNamespace:
    fields = {"is_matryoshka": False, "matryoshka_dimensions": None, "served_model_name": "m"}
    return SimpleNamespace(pooler_config=pooler, **{**fields, **kwargs})


def test_task_defaults_and_pooler_config_merge():
    embed = PoolingParams()
    embed.verify("embed", model(PoolerConfig(pooling_type="MEAN", normalize=False)))
    assert (embed.task, embed.normalize) == ("embed", False)  # the model's config wins
    own = PoolingParams(normalize=True)
    own.verify("embed", model(PoolerConfig(normalize=False)))
    assert own.normalize is True  # the request's value wins over the model's
    plain = PoolingParams()
    plain.verify("embed", model(PoolerConfig()))
    assert plain.normalize is True  # vLLM's default for embeddings
    classify = PoolingParams(softmax=False)  # the deprecated name
    classify.verify("classify", model(PoolerConfig()))
    assert classify.use_activation is False and classify.softmax is None


def test_refusals_name_the_parameter():
    with pytest.raises(ValueError, match=r"Task classify only supports \['use_activation'\]"):
        PoolingParams(normalize=True).verify("classify", model(PoolerConfig()))
    with pytest.raises(ValueError, match="does not support matryoshka representation"):
        PoolingParams(dimensions=8).verify("embed", model(PoolerConfig()))
    with pytest.raises(ValueError, match=r"only supports \[8, 16\] matryoshka dimensions"):
        PoolingParams(dimensions=4).verify(
            "embed", model(PoolerConfig(), is_matryoshka=True, matryoshka_dimensions=[8, 16])
        )
    with pytest.raises(ValueError, match="You cannot overwrite"):
        PoolingParams(task="embed").verify("classify")
    with pytest.raises(ValueError, match="does not support \\['step_tag_id'\\]"):
        PoolingParams(step_tag_id=3).verify("embed", model(PoolerConfig()))
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        PoolingParams(truncate_prompt_tokens=-2)
    with pytest.raises(TypeError, match="normalize must be a bool"):
        PoolingParams(normalize="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="Unknown pooling task"):
        PoolingParams(task="generate")
    with pytest.raises(ValueError, match="pooling_type 'SUM' is not supported"):
        PoolerConfig(pooling_type="SUM")
    with pytest.raises(ValueError, match="unknown fields \\['pooling'\\]"):
        PoolerConfig.from_any('{"pooling": "MEAN"}')


def test_step_pooling_takes_its_tags_from_the_model():
    params = PoolingParams()
    params.verify("encode", model(PoolerConfig(pooling_type="STEP", step_tag_id=7)))
    assert params.step_tag_id == 7


def test_sentence_transformers_files(tmp_path):
    assert sentence_transformers_pooling(str(tmp_path)) is None
    modules = [
        {"idx": 1, "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(
        json.dumps({"pooling_mode_cls_token": False, "pooling_mode_lasttoken": True})
    )
    found = sentence_transformers_pooling(str(tmp_path))
    assert found == PoolerConfig(pooling_type="LAST", normalize=True)
    # The user's settings over the files' over vLLM's defaults.
    merged = PoolerConfig(pooling_type="MEAN").merged_over(
        found.merged_over(default_pooler_config("embed", encoder_only=False))
    )
    assert (merged.pooling_type, merged.normalize) == ("MEAN", True)
    assert default_pooler_config("embed", encoder_only=True).pooling_type == "CLS"
    assert default_pooler_config("reward", encoder_only=False).pooling_type == "ALL"
