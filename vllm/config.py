"""Engine configuration: model, cache, parallelism, scheduler and device, validated on creation.

Imports no torch at module level: the scheduler and block manager read these classes and must
stay torch-free (dtypes are kept as strings and turned into torch dtypes in the worker).
"""

from __future__ import annotations

import copy
import logging
import os
from dataclasses import FrozenInstanceError, dataclass, field
from typing import Any, TypeVar

from vllm import envs
from vllm.spec_decode.config import SpeculativeConfig
from vllm.transformers_utils.pooler_config import (
    PoolerConfig,
    default_pooler_config,
    sentence_transformers_pooling,
)

__all__ = ["PoolerConfig"]

logger = logging.getLogger("vllm.config")

_GiB = 1 << 30
_DTYPES = ("auto", "float32", "float", "bfloat16", "float16", "half")
_CANONICAL_DTYPE = {"float": "float32", "half": "float16"}


# vLLM's method names this engine implements. "none" is this engine's explicit opt-out: a .gguf
# model is then dequantized at load to --dtype (vLLM itself has no off value: omitting the flag
# means "whatever the checkpoint is", which for a .gguf file is "gguf").
QUANTIZATION_METHODS = ("gguf",)
QUANTIZATION_OFF = "none"


class FrozenConfig:
    """A config that refuses writes once frozen (`freeze`, done when the `EngineConfig` is
    built). What changes while the engine runs (the pipeline's size and split, the KV block
    counts) is the executor's `PipelineShape`, not a field written here: in process the
    engine and its worker would share the object, so a write by one would change the other's
    copy under it."""

    _frozen = False

    def freeze(self) -> None:
        """From now on every attribute write raises FrozenInstanceError (an AttributeError)."""
        object.__setattr__(self, "_frozen", True)

    @property
    def frozen(self) -> bool:
        return self._frozen

    def __setattr__(self, name: str, value: Any) -> None:
        if self._frozen:
            raise FrozenInstanceError(
                f"cannot assign to field {name!r}: this {type(self).__name__} is frozen (configs "
                "do not change once the engine config is built; the running pipeline's size, "
                "layer split and block counts are the executor's PipelineShape)"
            )
        super().__setattr__(name, value)


_Config = TypeVar("_Config", bound=FrozenConfig)


def derive(config: _Config, **changes: Any) -> _Config:
    """A frozen copy of `config` with `changes`: the configs as the pipeline runs now, built
    from a `PipelineShape` whose values were checked there. Not run through __post_init__ again:
    that would read environment defaults (VLLM_PP_LAYER_PARTITION...) a second time."""
    unknown = sorted(set(changes) - set(vars(config)))
    if unknown:
        raise TypeError(f"{type(config).__name__} has no field(s) {unknown}")
    new = copy.copy(config)
    vars(new).update(changes)
    new.freeze()
    return new


def resolve_quantization(quantization: str | None, is_gguf: bool) -> str | None:
    """The method the engine runs: "gguf" or None (dense weights in --dtype).

    None (omitted) means "gguf" for a .gguf model and None otherwise; "none" forces dense
    weights. Raises ValueError naming `quantization` for an unknown value or a method the
    checkpoint cannot provide."""
    if quantization is None:
        return "gguf" if is_gguf else None
    if not isinstance(quantization, str):
        raise ValueError(f"quantization must be a string or None, got {quantization!r}.")
    method = quantization.lower()
    if method == QUANTIZATION_OFF:
        return None
    if method not in QUANTIZATION_METHODS:
        choices = ", ".join(repr(m) for m in (*QUANTIZATION_METHODS, QUANTIZATION_OFF))
        raise ValueError(
            f"quantization={quantization!r} is not supported; choose one of {choices} (or omit it)."
        )
    if method == "gguf" and not is_gguf:
        raise ValueError(
            "quantization='gguf' needs a .gguf model (a .gguf file, a directory holding one, "
            "or 'smollm2')."
        )
    return method


# vLLM's --convert values, and the older --task values (with the conversion each implies).
_CONVERT_TYPES = ["auto", "none", "embed", "classify", "reward"]
_TASKS = {
    "generate": "none",
    "embed": "embed",
    "embedding": "embed",
    "classify": "classify",
    "score": "classify",
    "reward": "reward",
}


@dataclass
class ModelConfig(FrozenConfig):
    """Which model to run and how: path, tokenizer, dtype, context length.

    `model` may be a HF directory (config.json + safetensors/.bin), a .gguf file, a directory
    holding one .gguf, or the alias "smollm2" (the bundled SmolLM2-135M-Instruct).
    `quantization`: vLLM's weight-only method; "gguf" (the default for a .gguf model) keeps the
    file's quantized blocks, "none" dequantizes them at load to `dtype`. Resolved in
    __post_init__ to "gguf" or None.
    """

    model: str
    tokenizer: str | None = None
    dtype: str = "auto"
    seed: int = 0
    # None: the model's context length (set in __post_init__).
    max_model_len: int = None  # type: ignore[assignment]
    trust_remote_code: bool = False
    max_logprobs: int = 20
    skip_tokenizer_init: bool = False
    quantization: str | None = None
    hf_config: Any = field(default=None, repr=False)
    # vLLM's runner selection: "generate", "pooling" or "auto" (from the architecture);
    # `convert` adapts a model to pooling ("embed", "classify", "reward"; "none"/"auto");
    # `task` is the older single switch ("generate", "embed", "classify", "score", "reward").
    runner: str = "auto"
    convert: str = "auto"
    task: str | None = None
    # How a pooling model pools (vLLM's --pooler-config; --override-pooler-config is its older
    # name): a PoolerConfig, a dict or JSON. Resolved over the model's defaults.
    pooler_config: Any = None
    override_pooler_config: Any = None
    served_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a non-empty string, got {self.model!r}.")
        from vllm.transformers_utils.gguf_config import is_gguf, resolve_model

        self.model = resolve_model(self.model)
        self.is_gguf = is_gguf(self.model)
        self.quantization = resolve_quantization(self.quantization, self.is_gguf)
        if self.tokenizer is None:
            self.tokenizer = self.model
        if self.hf_config is None:
            self.hf_config = _load_hf_config(self.model, self.is_gguf, self.trust_remote_code)
        from vllm.model_registry import check_architecture

        self.architecture = check_architecture(self.hf_config)
        self._resolve_runner()
        self.dtype = _resolve_dtype(self.dtype, self.hf_config)
        self.max_model_len = _derive_max_model_len(self.hf_config, self.max_model_len)
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be non-negative, got {self.max_logprobs}.")

    def _resolve_runner(self) -> None:
        """`runner_type` ("generate" / "pooling"), `convert_type` ("none", "embed",
        "classify", "reward"), `is_encoder_only`, `pooler_config` (resolved; None for a
        generator) and the Matryoshka facts, from the flags and the architecture."""
        from vllm.model_registry import ENCODER_ONLY_ARCHS, POOLING_ARCHS

        runner, convert = self.runner, self.convert
        if runner not in ("auto", "generate", "pooling"):
            raise ValueError(
                f"runner={runner!r} is not supported; choose one of ['auto', 'generate', "
                "'pooling']."
            )
        if convert not in _CONVERT_TYPES:
            raise ValueError(
                f"convert={convert!r} is not supported; choose one of {_CONVERT_TYPES}."
            )
        arch = self.architecture
        native = POOLING_ARCHS.get(arch)
        if self.task not in (None, "auto"):
            task = self.task
            if task not in _TASKS:
                raise ValueError(f"task={task!r} is not supported; choose one of {list(_TASKS)}.")
            if task == "generate":
                runner = "generate" if runner == "auto" else runner
            else:
                runner = "pooling" if runner == "auto" else runner
                if convert == "auto":
                    if task == "score":
                        convert = native or "embed"
                    else:
                        convert = _TASKS[task]
        if runner == "auto":
            converted = convert not in ("auto", "none")
            runner = "pooling" if native is not None or converted else "generate"
        if runner == "generate":
            if native is not None:
                raise ValueError(
                    f"Model architecture {arch!r} is a pooling model: it has no generation "
                    "head (use runner='pooling')."
                )
            if convert not in ("auto", "none"):
                raise ValueError(f"convert={convert!r} needs runner='pooling'.")
            convert = "none"
        elif convert in ("auto", "none"):
            convert = native or "embed"
        if native == "embed" and convert != "embed":
            raise ValueError(
                f"Model architecture {arch!r} has no classification head: convert={convert!r} "
                "is not supported for it (use convert='embed')."
            )
        if native is None and convert in ("classify", "reward"):
            raise ValueError(
                f"convert={convert!r} needs a *ForSequenceClassification checkpoint (a `score` "
                f"head); {arch!r} has none. Use convert='embed'."
            )
        self.runner_type: str = runner
        self.convert_type: str = convert
        self.is_encoder_only = arch in ENCODER_ONLY_ARCHS
        cfg = self.hf_config
        dims = getattr(cfg, "matryoshka_dimensions", None)
        self.matryoshka_dimensions: list[int] | None = list(dims) if dims else None
        self.is_matryoshka = bool(getattr(cfg, "is_matryoshka", False)) or dims is not None
        self.num_labels = int(getattr(cfg, "num_labels", 0) or 0) if convert != "embed" else 0
        if runner != "pooling":
            if self.pooler_config is not None or self.override_pooler_config is not None:
                raise ValueError("pooler_config is only for pooling models (runner='pooling').")
            return
        user = PoolerConfig.from_any(self.pooler_config)
        override = PoolerConfig.from_any(self.override_pooler_config)
        if override is not None:
            logger.warning("override_pooler_config is deprecated: use pooler_config.")
            user = override if user is None else user.merged_over(override)
        defaults = default_pooler_config(convert, self.is_encoder_only)
        if not self.is_gguf:
            st = sentence_transformers_pooling(self.model)
            if st is not None:
                defaults = st.merged_over(defaults)
        self.pooler_config = defaults if user is None else user.merged_over(defaults)
        self.override_pooler_config = None

    @property
    def is_pooling_model(self) -> bool:
        return self.runner_type == "pooling"

    @property
    def supported_tasks(self) -> list[str]:
        """The pooling tasks this model runs (vLLM's names); [] for a generator."""
        if self.runner_type != "pooling":
            return []
        if self.convert_type == "embed":
            return ["encode", "embed", "score", "token_embed"]
        if self.convert_type == "classify":
            tasks = ["encode", "classify", "token_classify"]
            return tasks + ["score"] if self.num_labels == 1 else tasks
        return ["encode", "token_classify"]

    def __getstate__(self) -> dict[str, Any]:
        # Workers get the HF config as plain attributes: unpickling a transformers config
        # would import transformers (~1.5 s) in every stage process for nothing.
        state = self.__dict__.copy()
        state["hf_config"] = PlainConfig.from_hf(self.hf_config)
        return state

    def get_num_layers(self) -> int:
        return self.hf_config.num_hidden_layers

    def get_hidden_size(self) -> int:
        return self.hf_config.hidden_size

    def get_vocab_size(self) -> int:
        return self.hf_config.vocab_size

    def get_num_attention_heads(self) -> int:
        return self.hf_config.num_attention_heads

    def get_num_kv_heads(self) -> int:
        return (
            getattr(self.hf_config, "num_key_value_heads", None) or self.get_num_attention_heads()
        )

    def get_gemm_shapes(self) -> tuple[list[tuple[int, int]], tuple[int, int]]:
        """(out, in) of one decoder layer's matmuls (as this engine fuses them) and of the
        lm_head: what one token costs in GEMM work (benchmarks, balanced PP splits)."""
        cfg = self.hf_config
        hidden = self.get_hidden_size()
        q = self.get_num_attention_heads() * self.get_head_size()
        kv = self.get_num_kv_heads() * self.get_head_size()
        ffn = getattr(cfg, "intermediate_size", None)
        top_k = getattr(cfg, "num_experts_per_tok", None)
        if ffn is not None and top_k:
            # MoE (Mixtral, Qwen3-MoE): a token runs its top_k experts' matmuls and the
            # router, not one dense MLP (layers that stay dense are counted as MoE too).
            expert = getattr(cfg, "moe_intermediate_size", None) or ffn
            experts = getattr(cfg, "num_local_experts", None) or cfg.num_experts
            layer = [(q + 2 * kv, hidden), (hidden, q), (experts, hidden)]
            layer += top_k * [(2 * expert, hidden), (hidden, expert)]
        elif ffn is not None:  # LLaMA: fused qkv, o, fused gate_up, down.
            layer = [(q + 2 * kv, hidden), (hidden, q), (2 * ffn, hidden), (hidden, ffn)]
        else:  # OPT: fused qkv, out, fc1, fc2.
            layer = [(3 * hidden, hidden), (hidden, hidden), (cfg.ffn_dim, hidden)]
            layer.append((hidden, cfg.ffn_dim))
        head_dim = getattr(cfg, "word_embed_proj_dim", None) or hidden
        return layer, (self.get_vocab_size(), head_dim)

    def get_lm_head_cost_in_layers(self) -> float:
        """The lm_head's matmul work per token, in decoder layers (for balanced PP splits)."""
        layer, (vocab, width) = self.get_gemm_shapes()
        return vocab * width / sum(n * k for n, k in layer)

    def get_pp_layer_sizes(self, parallel_config: ParallelConfig) -> list[int]:
        """Decoder layers per pipeline stage (validates the size and any user partition)."""
        from vllm.distributed.layer_split import get_pp_layer_sizes

        return get_pp_layer_sizes(
            self.get_num_layers(),
            parallel_config.pipeline_parallel_size,
            parallel_config.pp_layer_partition,
            self.get_lm_head_cost_in_layers(),
        )

    def verify_with_parallel_config(self, parallel_config: ParallelConfig) -> None:
        """The model splits over `tensor_parallel_size` ranks (vLLM's checks and messages)."""
        tp = parallel_config.tensor_parallel_size
        heads = self.get_num_attention_heads()
        if heads % tp != 0:
            raise ValueError(
                f"Total number of attention heads ({heads}) must be divisible by tensor "
                f"parallel size ({tp})."
            )
        kv = self.get_num_kv_heads()
        if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
            raise ValueError(
                f"Total number of key/value heads ({kv}) must be divisible by tensor parallel "
                f"size ({tp}), or tensor parallel size by it (KV heads are then replicated)."
            )
        cfg = self.hf_config
        ffn = getattr(cfg, "intermediate_size", None) or getattr(cfg, "ffn_dim", None)
        if ffn is not None and ffn % tp != 0:
            raise ValueError(
                f"The MLP's intermediate size ({ffn}) must be divisible by tensor parallel "
                f"size ({tp})."
            )
        moe_ffn = getattr(cfg, "moe_intermediate_size", None)  # Qwen3-MoE's experts
        if moe_ffn is not None and moe_ffn % tp != 0:
            raise ValueError(
                f"The MoE experts' intermediate size ({moe_ffn}) must be divisible by tensor "
                f"parallel size ({tp})."
            )

    def get_head_size(self) -> int:
        head_dim = getattr(self.hf_config, "head_dim", None)
        return head_dim or self.get_hidden_size() // self.get_num_attention_heads()


class PlainConfig:
    """A model config's fields as plain attributes (what stage workers read)."""

    def __init__(self, fields: dict[str, Any]) -> None:
        self.__dict__.update(fields)

    @classmethod
    def from_hf(cls, config: Any) -> PlainConfig:
        if isinstance(config, cls):
            return config
        return cls(config.to_dict())


def _load_hf_config(model: str, is_gguf: bool, trust_remote_code: bool) -> Any:
    if is_gguf:
        from vllm.transformers_utils.gguf_config import load_gguf_config

        return load_gguf_config(model)
    if not os.path.exists(model):
        raise ValueError(
            f"model {model!r} does not exist: pass a local HF model directory, a .gguf file, "
            "or 'smollm2' (this build has no model hub access)."
        )
    if not os.path.isfile(os.path.join(model, "config.json")):
        raise ValueError(f"model {model!r} has no config.json (and no .gguf file).")
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)


def _resolve_dtype(dtype: str, hf_config: Any) -> str:
    if not isinstance(dtype, str) or dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {list(_DTYPES)}, got {dtype!r}.")
    dtype = _CANONICAL_DTYPE.get(dtype, dtype)
    if dtype != "auto":
        return dtype
    # transformers >= 5 names it `dtype` (reading `torch_dtype` only triggers a warning).
    if hasattr(hf_config, "dtype"):
        config_dtype = hf_config.dtype
    else:
        config_dtype = getattr(hf_config, "torch_dtype", None)
    name = str(config_dtype).replace("torch.", "") if config_dtype is not None else "float32"
    return name if name in ("float32", "bfloat16", "float16") else "float32"


def _derive_max_model_len(hf_config: Any, max_model_len: int | None) -> int:
    derived = None
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        derived = getattr(hf_config, key, None)
        if derived is not None:
            break
    if derived is None:
        derived = 2048
    elif key == "max_position_embeddings":
        # vLLM's rule: linear / dynamic / yarn rope scaling stretch the context length. An
        # unknown rope type fails here, at once, naming it.
        from vllm.transformers_utils import rope_config

        rope_config.check_rope_type(rope_config.get_rope_parameters(hf_config)["rope_type"])
        derived = rope_config.max_positions_served(hf_config)
        if getattr(hf_config, "model_type", None) in ("roberta", "xlm-roberta"):
            # RoBERTa's positions start at padding_idx + 1 (HF's rule), so its table serves
            # that many fewer tokens: 514 positions are 512 tokens.
            derived -= int(getattr(hf_config, "pad_token_id", None) or 0) + 1
    if max_model_len is None:
        return derived
    if not isinstance(max_model_len, int) or max_model_len <= 0:
        raise ValueError(f"max_model_len must be a positive integer, got {max_model_len!r}.")
    if max_model_len > derived:
        msg = (
            f"User-specified max_model_len ({max_model_len}) is greater than the derived "
            f"max_model_len ({key}={derived} in model's config.json). This may lead to "
            "incorrect model outputs or CUDA errors."
        )
        from vllm import envs

        if not envs.get_bool("VLLM_ALLOW_LONG_MAX_MODEL_LEN"):
            raise ValueError(
                f"{msg} To allow overriding this maximum, set the env var "
                "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1"
            )
        logger.warning("%s Make sure the value is correct and within the model context size.", msg)
    return max_model_len


@dataclass
class CacheConfig(FrozenConfig):
    """Paged KV cache: block size and memory budgets (per pipeline stage).

    On CUDA the device cache is sized from profiled free memory times gpu_memory_utilization;
    on CPU from `kv_cache_space` GiB. `swap_space` GiB of host memory per stage backs swapping.
    """

    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    swap_space: float = 4.0
    kv_cache_space: float = 4.0
    num_gpu_blocks_override: int | None = None
    num_gpu_blocks: int | None = None
    num_cpu_blocks: int | None = None
    # Automatic prefix caching: full blocks are shared by hash of their tokens and prefix.
    enable_prefix_caching: bool = False
    # vLLM's fields with the only values this engine has: the KV cache in the model's dtype,
    # no CPU weight offload; sliding_window is the model's (set by `EngineConfig`).
    cache_dtype: str = "auto"
    cpu_offload_gb: float = 0
    sliding_window: int | None = None

    def metrics_info(self) -> dict[str, str]:
        """Every field (and swap_space_bytes) as a string: the labels of vLLM's
        `vllm:cache_config_info`."""
        info = {key: str(value) for key, value in self.__dict__.items()}
        info["swap_space_bytes"] = str(self.swap_space_bytes)
        return info

    def verify_memory(self, device: str, tensor_parallel_size: int) -> None:
        """Refuse budgets this node's memory cannot hold, before any worker starts.

        Swap space follows vLLM's rule (per node, counted for the TP ranks there): over 70% of
        the CPU memory is an error, over 40% a warning. A CPU KV cache larger than 90% of the
        memory could never be mapped either."""
        import psutil

        total = psutil.virtual_memory().total
        swap = self.swap_space_bytes * tensor_parallel_size
        msg = (
            f"{swap / _GiB:.2f} GiB out of the {total / _GiB:.2f} GiB total CPU memory is "
            "allocated for the swap space."
        )
        if swap > 0.7 * total:
            raise ValueError("Too large swap space. " + msg)
        if swap > 0.4 * total:
            logger.warning("Possibly too large swap space. %s", msg)
        if device == "cpu" and self.kv_cache_space_bytes > 0.9 * total:
            raise ValueError(
                f"Too large KV cache space. kv_cache_space={self.kv_cache_space:g} GiB per "
                f"stage does not fit in the {total / _GiB:.2f} GiB total CPU memory of this "
                "node; lower kv_cache_space."
            )

    def __post_init__(self) -> None:
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(
                f"block_size must be a power of two between 1 and 128, got {self.block_size}."
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"GPU memory utilization must be less than 1.0. Got {self.gpu_memory_utilization}."
            )
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be non-negative, got {self.swap_space}.")
        if self.kv_cache_space <= 0:
            raise ValueError(f"kv_cache_space must be positive, got {self.kv_cache_space}.")

    @property
    def swap_space_bytes(self) -> int:
        return int(self.swap_space * _GiB)

    @property
    def kv_cache_space_bytes(self) -> int:
        return int(self.kv_cache_space * _GiB)


@dataclass
class ParallelConfig(FrozenConfig):
    """Pipeline and tensor parallel sizes and how workers are launched."""

    pipeline_parallel_size: int = 1
    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    # Optional user split of decoder layers over stages, e.g. "8,8,7,7" (VLLM_PP_LAYER_PARTITION).
    pp_layer_partition: str | None = None
    # A failed stage is replaced up to this many times per engine; 0 = fail-stop (vLLM).
    max_stage_restarts: int = 3
    # After a stage replacement: "local" rebuilds only the lost stages' KV from the boundary
    # caches (`boundary_cache_enabled`), "full" re-prefills every request through every stage.
    stage_recovery: str = "local"
    # Base deadline of one micro-batch (VLLM_PP_STEP_TIMEOUT_S when None); see step_deadline_s.
    step_timeout_s: float = None  # type: ignore[assignment]
    # Re-split the layers from the stages' measured compute times (vllm/engine/reshape.py)
    # when the predicted step time drops by at least pp_rebalance_min_gain.
    pp_auto_rebalance: bool = False
    pp_rebalance_min_gain: float = 0.1

    def __post_init__(self) -> None:
        for name in ("pipeline_parallel_size", "tensor_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")
        if self.pp_layer_partition is None:
            self.pp_layer_partition = envs.get_str("VLLM_PP_LAYER_PARTITION") or None
        backend = self.distributed_executor_backend
        if backend is None:
            backend = _default_backend(self.world_size)
        if backend not in ("ray", "mp", "uni"):
            raise ValueError(
                f"distributed_executor_backend must be 'ray', 'mp' or 'uni', got {backend!r}."
            )
        if backend == "uni" and self.world_size > 1:
            raise ValueError(
                "distributed_executor_backend='uni' runs a single process; "
                f"world size {self.world_size} needs 'ray' or 'mp'."
            )
        self.distributed_executor_backend = backend
        if (
            not isinstance(self.max_stage_restarts, int)
            or isinstance(self.max_stage_restarts, bool)
            or self.max_stage_restarts < 0
        ):
            raise ValueError(
                f"max_stage_restarts must be an integer >= 0, got {self.max_stage_restarts!r}."
            )
        if self.stage_recovery not in ("local", "full"):
            raise ValueError(
                f"stage_recovery must be 'local' or 'full', got {self.stage_recovery!r}."
            )
        gain = self.pp_rebalance_min_gain
        if isinstance(gain, bool) or not isinstance(gain, (int, float)) or not 0 <= gain < 1:
            raise ValueError(f"pp_rebalance_min_gain must be in [0, 1), got {gain!r}.")
        if self.step_timeout_s is None:
            self.step_timeout_s = envs.get_float("VLLM_PP_STEP_TIMEOUT_S")
        if not self.step_timeout_s > 0:
            raise ValueError(f"step_timeout_s must be positive, got {self.step_timeout_s!r}.")

    @property
    def world_size(self) -> int:
        return self.pipeline_parallel_size * self.tensor_parallel_size

    @property
    def boundary_cache_enabled(self) -> bool:
        """Whether every non-last stage keeps the rows it sent downstream per KV slot (the
        boundary cache a stage-local rebuild replays from): stage_recovery "local", PP > 1
        and stages that may be replaced."""
        return (
            self.stage_recovery == "local"
            and self.pipeline_parallel_size > 1
            and self.max_stage_restarts > 0
        )

    @property
    def last_stage_driver_rank(self) -> int:
        """Global rank of the last stage's TP driver (rank = pp_rank x TP + tp_rank): it
        samples, returns the step's output and sends the sampled ids to the first stage."""
        return (self.pipeline_parallel_size - 1) * self.tensor_parallel_size

    def step_deadline_s(self, num_tokens: int) -> float:
        """How long one micro-batch of `num_tokens` tokens may take to come back: the base
        timeout plus an allowance per token (a long prefill legitimately takes longer)."""
        per_token = envs.get_float("VLLM_PP_STEP_TIMEOUT_PER_TOKEN_S")
        return self.step_timeout_s + per_token * num_tokens

    def comm_timeout_s(self, max_num_batched_tokens: int) -> float:
        """Timeout of the stages' process groups: a receive waits at most one whole step of
        the previous stage, so it can never block past the largest step's deadline."""
        return self.step_deadline_s(max_num_batched_tokens)


def _default_backend(world_size: int) -> str:
    """vLLM's choice, adapted: one rank runs in-process; several use Ray when it is installed
    (this engine's documented default: it also spans nodes via RAY_ADDRESS, and inside a Ray
    task/actor holding a placement group the ranks go into that group), else one local process
    per rank ('mp')."""
    if world_size == 1:
        return "uni"
    import importlib.util

    return "ray" if importlib.util.find_spec("ray") is not None else "mp"


@dataclass
class SchedulerConfig(FrozenConfig):
    """Batching limits per step, the preemption mode and chunked prefill.

    With `enable_chunked_prefill` a step takes the running decodes first, then prefill chunks
    up to `max_num_batched_tokens` (default 512, as in vLLM 0.5), so a prompt longer than the
    budget is prefilled over several steps and `max_num_batched_tokens` may be smaller than
    `max_model_len`."""

    # None: derived in __post_init__; the annotations give the type the fields then have.
    max_num_batched_tokens: int = None  # type: ignore[assignment]
    max_num_seqs: int = 256
    max_model_len: int = 2048
    preemption_mode: str | None = None
    enable_chunked_prefill: bool = False
    # Decodes scheduled ahead of their previous step's output (None: where supported).
    async_scheduling: bool | None = None
    # vLLM's: with chunked prefill, at most this many tokens of one prompt per step (0: no cap
    # beyond the step's budget), so a long prompt's chunks leave room for other requests; with
    # max_num_partial_prefills > 1 also the tokens left above which a prompt counts as long
    # (vLLM's default then: 4% of max_model_len).
    long_prefill_token_threshold: int = 0
    # vLLM's: with chunked prefill, how many prompts may be partially prefilled at once
    # (sharing a step's budget), and how many of them may be long (`vllm.core.partial_prefills`).
    max_num_partial_prefills: int = 1
    max_long_partial_prefills: int = 1
    # The tokens one prompt may take per step: the threshold the user set (0: none). A threshold
    # derived for max_num_partial_prefills only tells long prompts from short ones, as in vLLM
    # V0, which splits the step's budget between the prompts instead of capping each.
    prefill_token_cap: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens is None:
            if self.enable_chunked_prefill:
                self.max_num_batched_tokens = 512
            else:
                self.max_num_batched_tokens = max(self.max_model_len, 2048)
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}.")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}."
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than "
                f"max_model_len ({self.max_model_len}). This effectively limits the maximum "
                "sequence length to max_num_batched_tokens and makes vLLM reject longer "
                "sequences. Please increase max_num_batched_tokens or decrease max_model_len."
            )
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be greater than "
                f"or equal to max_num_seqs ({self.max_num_seqs})."
            )
        if self.long_prefill_token_threshold < 0:
            raise ValueError(
                "long_prefill_token_threshold must be >= 0, got "
                f"{self.long_prefill_token_threshold}."
            )
        self.prefill_token_cap = self.long_prefill_token_threshold
        self._verify_partial_prefills()
        if self.preemption_mode not in (None, "recompute", "swap"):
            raise ValueError(
                f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}."
            )

    def _verify_partial_prefills(self) -> None:
        """vLLM's rules and messages for the partial-prefill knobs; with several partial
        prefills and no threshold, vLLM's default threshold (4% of max_model_len)."""
        for name in ("max_num_partial_prefills", "max_long_partial_prefills"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}.")
        if self.max_num_partial_prefills < 1:
            raise ValueError(
                f"max_num_partial_prefills ({self.max_num_partial_prefills}) must be greater "
                "than or equal to 1."
            )
        if self.max_num_partial_prefills > 1:
            if not self.enable_chunked_prefill:
                raise ValueError(
                    "Chunked prefill must be enabled to set max_num_partial_prefills > 1."
                )
            if self.long_prefill_token_threshold == 0:
                self.long_prefill_token_threshold = int(self.max_model_len * 0.04)
            if self.long_prefill_token_threshold > self.max_model_len:
                raise ValueError(
                    f"long_prefill_token_threshold ({self.long_prefill_token_threshold}) cannot "
                    f"be greater than the max_model_len ({self.max_model_len})."
                )
            logger.info(
                "Concurrent partial prefills enabled with max_num_partial_prefills=%d, "
                "max_long_partial_prefills=%d, long_prefill_token_threshold=%d",
                self.max_num_partial_prefills,
                self.max_long_partial_prefills,
                self.long_prefill_token_threshold,
            )
        if not 1 <= self.max_long_partial_prefills <= self.max_num_partial_prefills:
            raise ValueError(
                f"max_long_partial_prefills ({self.max_long_partial_prefills}) must be greater "
                "than or equal to 1 and less than or equal to max_num_partial_prefills "
                f"({self.max_num_partial_prefills})."
            )

    @property
    def chunked_prefill_enabled(self) -> bool:
        """vLLM's attribute name for `enable_chunked_prefill`."""
        return self.enable_chunked_prefill


@dataclass
class DeviceConfig(FrozenConfig):
    """The device kind: "cpu" or "cuda" ("auto" picks CUDA when available)."""

    device: str = "auto"

    def __post_init__(self) -> None:
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}.")
        if self.device == "cpu":
            return
        import torch

        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        elif not torch.cuda.is_available():
            raise ValueError(
                "device='cuda' was requested but no CUDA GPU is available "
                f"(torch {torch.__version__}: torch.cuda.is_available() is False). "
                "Use device='cpu' or device='auto'."
            )


# vLLM's accepted --max-lora-rank values.
POSSIBLE_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass
class LoRAConfig(FrozenConfig):
    """Multi-LoRA serving (vLLM's `LoRAConfig`): `max_loras` adapters active in one batch (GPU
    slots), `max_cpu_loras` kept loaded per stage (default: max_loras), ranks up to
    `max_lora_rank`."""

    max_lora_rank: int = 16
    max_loras: int = 1
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        if self.max_lora_rank not in POSSIBLE_MAX_LORA_RANKS:
            raise ValueError(
                f"max_lora_rank ({self.max_lora_rank}) must be one of {POSSIBLE_MAX_LORA_RANKS}."
            )
        if self.max_loras < 1:
            raise ValueError(f"max_loras ({self.max_loras}) must be >= 1.")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        elif self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})"
            )


@dataclass(frozen=True)
class EngineConfig:
    """All of an engine's configs together: one object, passed by name from `EngineArgs` to
    the engine, its executor and the stage workers (vLLM's `VllmConfig`). Building it freezes
    every config in it: none changes afterwards (see `FrozenConfig`)."""

    model_config: ModelConfig
    cache_config: CacheConfig
    parallel_config: ParallelConfig
    scheduler_config: SchedulerConfig
    device_config: DeviceConfig
    # None: LoRA disabled (enable_lora=False).
    lora_config: LoRAConfig | None = None
    # None: no speculative decoding (vLLM's `speculative_config`).
    speculative_config: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        cache_config = self.cache_config
        if not cache_config.frozen:  # built now, not a copy of a built one (`replace`)
            hf_config = self.model_config.hf_config
            cache_config.sliding_window = getattr(hf_config, "sliding_window", None)
        for config in (
            self.model_config,
            self.cache_config,
            self.parallel_config,
            self.scheduler_config,
            self.device_config,
            self.lora_config,
        ):
            if config is not None:
                config.freeze()
