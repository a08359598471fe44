"""EngineArgs: every engine option with vLLM's names, defaults and CLI flags."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from vllm.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from vllm.logger import init_logger
from vllm.spec_decode.config import SpeculativeConfig

logger = init_logger("vllm.engine.arg_utils")

RUNNER_TYPES = ("auto", "generate", "pooling")
CONVERT_TYPES = ("auto", "none", "embed", "classify", "reward")


def _first_served_name(name: str | list[str] | None) -> str | None:
    if isinstance(name, (list, tuple)):
        return str(name[0]) if name else None
    return name


@dataclass
class EngineArgs:
    """Arguments for LLMEngine / LLM (`LLM(model=..., **kwargs)` takes the same names)."""

    # enable_chunked_prefill when not given. Offline, a bigger step batches more and a first
    # token matters less: off, as it has always been here.
    CHUNKED_PREFILL_DEFAULT: ClassVar[bool] = False

    model: str = "smollm2"
    tokenizer: str | None = None
    skip_tokenizer_init: bool = False
    trust_remote_code: bool = False
    dtype: str = "auto"
    quantization: str | None = None
    seed: int = 0
    max_model_len: int | None = None
    pipeline_parallel_size: int = 1
    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    pp_layer_partition: str | None = None
    pp_auto_rebalance: bool = False
    pp_rebalance_min_gain: float = 0.1
    block_size: int = 16
    swap_space: float = 4.0
    kv_cache_space: float = 4.0
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int = 256
    max_logprobs: int = 20
    preemption_mode: str | None = None
    # None: the default of the entry point (CHUNKED_PREFILL_DEFAULT: off offline, on serving).
    enable_chunked_prefill: bool | None = None
    long_prefill_token_threshold: int = 0
    max_num_partial_prefills: int = 1
    max_long_partial_prefills: int = 1
    enable_prefix_caching: bool = False
    async_scheduling: bool | None = None
    device: str = "auto"
    disable_log_stats: bool = False
    max_stage_restarts: int = 3
    stage_recovery: str = "local"
    step_timeout_s: float | None = None
    # Accepted for vLLM compatibility: there are no CUDA graphs to skip on this engine.
    enforce_eager: bool = False
    # The model name in the API and the metrics' model_name label (default: model).
    # One name or several (vLLM's --served-model-name takes a list; the first is the
    # metrics' label and every one is accepted as the request's model).
    served_model_name: str | list[str] | None = None
    # vLLM 0.5's older spellings: worker_use_ray is distributed_executor_backend="ray";
    # tokenizer_pool_size is accepted (tokenizing runs in the server's own thread pool).
    worker_use_ray: bool = False
    tokenizer_pool_size: int = 0
    # Multi-LoRA (vLLM's names and defaults).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # Pooling models (vLLM 0.10.2+'s names): the runner, the conversion of the checkpoint,
    # the older task switch and the pooler's settings (`override_pooler_config`: its older
    # name, deprecated).
    runner: str = "auto"
    convert: str = "auto"
    task: str | None = None
    pooler_config: object = None
    override_pooler_config: object = None
    # Speculative decoding: vLLM's dict (or its JSON text from --speculative-config), and
    # vLLM 0.5's keywords it replaced (accepted as aliases).
    speculative_config: object = None
    speculative_model: str | None = None
    num_speculative_tokens: int | None = None
    ngram_prompt_lookup_max: int | None = None
    ngram_prompt_lookup_min: int | None = None
    speculative_disable_by_batch_size: int | None = None
    speculative_draft_tensor_parallel_size: int | None = None

    def __post_init__(self) -> None:
        if self.runner not in RUNNER_TYPES:
            raise ValueError(
                f"runner={self.runner!r} is not supported; choose one of {list(RUNNER_TYPES)}."
            )
        if self.convert not in CONVERT_TYPES:
            raise ValueError(
                f"convert={self.convert!r} is not supported; choose one of {list(CONVERT_TYPES)}."
            )

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """vLLM's flag spellings (hyphenated; underscores accepted too)."""
        d = EngineArgs

        def add(flag: str, *aliases: str, **kwargs: object) -> None:
            names = [flag, "--" + flag[2:].replace("-", "_"), *aliases]
            parser.add_argument(*dict.fromkeys(names), **kwargs)  # type: ignore[arg-type]

        add(
            "--model",
            type=str,
            default=d.model,
            help="HF model directory, .gguf file, or 'smollm2' (bundled SmolLM2-135M-Instruct).",
        )
        add("--tokenizer", type=str, default=d.tokenizer, help="Tokenizer path (default: model).")
        add("--skip-tokenizer-init", action="store_true", help="Prompts are token ids only.")
        add("--trust-remote-code", action="store_true", help="Trust remote code (HF).")
        add(
            "--dtype",
            type=str,
            default=d.dtype,
            choices=["auto", "half", "float16", "bfloat16", "float", "float32"],
            help="Weights and activations dtype; auto = the model config's (fp32 if none).",
        )
        add(
            "--quantization",
            "-q",
            type=str,
            default=d.quantization,
            help="Weight-only quantization: 'gguf' (the default for a .gguf model: its "
            "quantized blocks are kept) or 'none' (dequantize a .gguf at load to --dtype).",
        )
        add("--seed", type=int, default=d.seed, help="Random seed.")
        add(
            "--max-model-len",
            type=int,
            default=d.max_model_len,
            help="Model context length (default: from the model config).",
        )
        add(
            "--pipeline-parallel-size",
            "-pp",
            type=int,
            default=d.pipeline_parallel_size,
            help="Number of pipeline stages (decoder layers split across Ray workers).",
        )
        add(
            "--tensor-parallel-size",
            "-tp",
            type=int,
            default=d.tensor_parallel_size,
            help="Number of tensor parallel ranks per pipeline stage (attention heads, MLP and "
            "vocabulary split; one all-reduce per projection).",
        )
        add(
            "--distributed-executor-backend",
            choices=["ray", "mp", "uni"],
            default=d.distributed_executor_backend,
            help="'ray' (default when world size > 1 and Ray is installed), 'mp' (one local "
            "process per rank, no Ray) or 'uni' (single process).",
        )
        add(
            "--pp-layer-partition",
            type=str,
            default=d.pp_layer_partition,
            help="Layers per stage: 'a,b,...' (e.g. '8,8,7,7'), or 'auto' to balance compute "
            "(the last stage runs the lm_head, so it gets fewer layers). Default: even split; "
            "env VLLM_PP_LAYER_PARTITION.",
        )
        add(
            "--pp-auto-rebalance",
            action="store_true",
            default=d.pp_auto_rebalance,
            help="Re-split the layers while serving from the stages' measured compute times, "
            "so a slower stage gets fewer layers (every request is recomputed after a "
            "re-split). Off by default.",
        )
        add(
            "--pp-rebalance-min-gain",
            type=float,
            default=d.pp_rebalance_min_gain,
            help="With --pp-auto-rebalance: re-split only when the predicted step time is at "
            "least this fraction lower (0.1 = 10%%).",
        )
        add(
            "--block-size",
            type=int,
            default=d.block_size,
            choices=[8, 16, 32],
            help="Token block size for the paged KV cache.",
        )
        add(
            "--swap-space",
            type=float,
            default=d.swap_space,
            help="CPU swap space size (GiB) per stage.",
        )
        add(
            "--kv-cache-space",
            type=float,
            default=d.kv_cache_space,
            help="KV cache size (GiB) per stage when the device is the CPU.",
        )
        add(
            "--gpu-memory-utilization",
            type=float,
            default=d.gpu_memory_utilization,
            help="Fraction of GPU memory for the model, activations and KV cache (CUDA).",
        )
        add(
            "--num-gpu-blocks-override",
            type=int,
            default=d.num_gpu_blocks_override,
            help="Use this many KV blocks instead of the profiled number.",
        )
        add(
            "--max-num-batched-tokens",
            type=int,
            default=d.max_num_batched_tokens,
            help="Maximum number of batched tokens per iteration.",
        )
        add(
            "--max-num-seqs",
            type=int,
            default=d.max_num_seqs,
            help="Maximum number of sequences per iteration.",
        )
        add(
            "--max-logprobs",
            type=int,
            default=d.max_logprobs,
            help="Max number of log probs to return when logprobs is set in SamplingParams.",
        )
        add(
            "--preemption-mode",
            type=str,
            default=d.preemption_mode,
            choices=["recompute", "swap"],
            help="Preemption by recompute or swap (default: recompute for single sequences).",
        )
        add(
            "--enable-chunked-prefill",
            action=argparse.BooleanOptionalAction,
            default=d.enable_chunked_prefill,
            help="Prefill long prompts in chunks of at most max_num_batched_tokens (default "
            "512 then), batched with the running decodes. Default: on for the servers "
            "(vllm serve, run_batch), off for the LLM class and run.py; "
            "--no-enable-chunked-prefill turns it off.",
        )
        add(
            "--long-prefill-token-threshold",
            type=int,
            default=d.long_prefill_token_threshold,
            help="With chunked prefill: at most this many tokens of one prompt per step "
            "(0: only the step's token budget limits it). With --max-num-partial-prefills > 1 "
            "also the length above which a prompt counts as long (default then: 4%% of "
            "max_model_len, telling long from short only).",
        )
        add(
            "--max-num-partial-prefills",
            type=int,
            default=d.max_num_partial_prefills,
            help="For chunked prefill, the maximum number of sequences that can be partially "
            "prefilled concurrently (they share a step's token budget).",
        )
        add(
            "--max-long-partial-prefills",
            type=int,
            default=d.max_long_partial_prefills,
            help="For chunked prefill, the maximum number of prompts longer than "
            "--long-prefill-token-threshold that will be prefilled concurrently. Setting this "
            "less than --max-num-partial-prefills will allow shorter prompts to jump the queue "
            "in front of longer prompts in some cases, improving latency.",
        )
        add(
            "--async-scheduling",
            action=argparse.BooleanOptionalAction,
            default=d.async_scheduling,
            help="Schedule each decode micro-batch's next step before its output comes back "
            "(the last stage sends its sampled ids straight to the first one). Default: on "
            "with pipeline parallelism on the ray and mp backends.",
        )
        add(
            "--speculative-config",
            type=str,
            default=None,
            help='Speculative decoding as JSON, e.g. \'{"method": "ngram", '
            '"num_speculative_tokens": 4, "prompt_lookup_max": 4}\' (prompt lookup: '
            "exact under greedy, the target's distribution when sampling).",
        )
        add(
            "--enable-lora",
            action="store_true",
            help="If True, enable handling of LoRA adapters.",
        )
        add(
            "--max-loras",
            type=int,
            default=d.max_loras,
            help="Max number of LoRAs in a single batch.",
        )
        add(
            "--max-lora-rank",
            type=int,
            default=d.max_lora_rank,
            help="Max LoRA rank.",
        )
        add(
            "--max-cpu-loras",
            type=int,
            default=d.max_cpu_loras,
            help="Maximum number of LoRAs to store in CPU memory (per stage); must be >= "
            "max_loras (default: max_loras).",
        )
        add(
            "--enable-prefix-caching",
            action="store_true",
            help="Enables automatic prefix caching: requests reuse the KV blocks of a shared "
            "prompt prefix.",
        )
        add(
            "--runner",
            type=str,
            default=d.runner,
            choices=list(RUNNER_TYPES),
            help="The model runner: 'generate' (text generation) or 'pooling' (embeddings, "
            "classification, scores); 'auto' from the architecture.",
        )
        add(
            "--convert",
            type=str,
            default=d.convert,
            choices=list(CONVERT_TYPES),
            help="Adapt the model to pooling: 'embed', 'classify' or 'reward'.",
        )
        add(
            "--task",
            type=str,
            default=d.task,
            help="Older form of --runner/--convert: generate, embed, classify, score, reward.",
        )
        add(
            "--pooler-config",
            type=str,
            default=None,
            help='The pooler, as JSON: e.g. \'{"pooling_type": "MEAN", "normalize": true}\'.',
        )
        add(
            "--override-pooler-config",
            type=str,
            default=None,
            help="Deprecated name of --pooler-config.",
        )
        add(
            "--device",
            type=str,
            default=d.device,
            choices=["auto", "cpu", "cuda"],
            help="Device type for execution.",
        )
        add("--disable-log-stats", action="store_true", help="Disable logging statistics.")
        add(
            "--max-stage-restarts",
            type=int,
            default=d.max_stage_restarts,
            help="How many times a failed pipeline stage may be replaced (its requests "
            "recomputed, none lost) within VLLM_STAGE_RESTART_WINDOW_S (default 600 s) before "
            "the engine gives up; 0 = fail-stop, like vLLM.",
        )
        add(
            "--stage-recovery",
            type=str,
            default=d.stage_recovery,
            choices=["local", "full"],
            help="How a replaced stage gets its KV back: 'local' re-prefills only the lost "
            "stage(s) from the token ids and the previous stage's boundary cache (the rows "
            "each stage sent downstream, kept per KV slot when PP > 1 and "
            "--max-stage-restarts > 0); 'full' re-prefills every request through all stages.",
        )
        add(
            "--step-timeout-s",
            type=float,
            default=d.step_timeout_s,
            help="Base deadline (s) for a micro-batch to come back from the pipeline, plus "
            "VLLM_PP_STEP_TIMEOUT_PER_TOKEN_S per token; a stage that misses it is declared "
            "failed. Default: VLLM_PP_STEP_TIMEOUT_S or 60.",
        )
        add(
            "--enforce-eager",
            action="store_true",
            help="Accepted for vLLM compatibility (no CUDA graphs are captured here).",
        )
        add(
            "--served-model-name",
            type=str,
            nargs="+",
            default=d.served_model_name,
            help="The model name(s) used in the API (any of them is accepted) and, the first, "
            "in metrics (default: --model).",
        )
        add(
            "--worker-use-ray",
            action="store_true",
            help="vLLM 0.5's spelling of --distributed-executor-backend ray.",
        )
        add(
            "--tokenizer-pool-size",
            type=int,
            default=d.tokenizer_pool_size,
            help="Accepted for vLLM compatibility: the server tokenizes in its own thread pool.",
        )
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        names = [f.name for f in dataclasses.fields(cls)]
        return cls(**{name: getattr(args, name) for name in names if hasattr(args, name)})

    @property
    def served_model_names(self) -> list[str] | None:
        """`served_model_name` as a list (None when not given)."""
        name = self.served_model_name
        if not name:
            return None
        return [name] if isinstance(name, str) else list(name)

    def _speculative_config(self) -> SpeculativeConfig | None:
        """`speculative_config`, or the dict vLLM 0.5's keywords describe (not both)."""
        legacy = SpeculativeConfig.from_legacy(
            {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        )
        if legacy is not None and self.speculative_config is not None:
            raise ValueError(
                f"speculative_config and vLLM 0.5's keyword(s) {sorted(legacy)} were both "
                "given; use speculative_config only."
            )
        return SpeculativeConfig.from_user(
            legacy if legacy is not None else self.speculative_config
        )

    def chunked_prefill_requested(self) -> bool:
        """enable_chunked_prefill as given, else this entry point's default."""
        if self.enable_chunked_prefill is None:
            return self.CHUNKED_PREFILL_DEFAULT
        return self.enable_chunked_prefill

    def create_engine_config(self) -> EngineConfig:
        """The validated configs as one object, passed by name to the engine, executors and
        workers (Ray Data reads `.scheduler_config` and `.parallel_config` from it)."""
        device_config = DeviceConfig(self.device)
        backend = self.distributed_executor_backend
        if self.worker_use_ray and backend is None:
            backend = "ray"
        parallel_config = ParallelConfig(
            self.pipeline_parallel_size,
            self.tensor_parallel_size,
            backend,
            self.pp_layer_partition,
            max_stage_restarts=self.max_stage_restarts,
            stage_recovery=self.stage_recovery,
            pp_auto_rebalance=self.pp_auto_rebalance,
            pp_rebalance_min_gain=self.pp_rebalance_min_gain,
            step_timeout_s=self.step_timeout_s,  # type: ignore[arg-type]  # None: derived
        )
        cache_config = CacheConfig(
            block_size=self.block_size,
            gpu_memory_utilization=self.gpu_memory_utilization,
            swap_space=self.swap_space,
            kv_cache_space=self.kv_cache_space,
            num_gpu_blocks_override=self.num_gpu_blocks_override,
            enable_prefix_caching=self.enable_prefix_caching,
        )
        cache_config.verify_memory(device_config.device, parallel_config.tensor_parallel_size)
        model_config = ModelConfig(
            model=self.model,
            tokenizer=self.tokenizer,
            dtype=self.dtype,
            quantization=self.quantization,
            seed=self.seed,
            max_model_len=self.max_model_len,  # type: ignore[arg-type]  # None: derived
            trust_remote_code=self.trust_remote_code,
            max_logprobs=self.max_logprobs,
            skip_tokenizer_init=self.skip_tokenizer_init,
            runner=self.runner,
            convert=self.convert,
            task=self.task,
            pooler_config=self.pooler_config,
            override_pooler_config=self.override_pooler_config,
            served_model_name=_first_served_name(self.served_model_name),
        )
        # Fails fast (before any worker starts) on pp > layers, a bad partition, or heads that
        # do not split over the TP ranks.
        model_config.get_pp_layer_sizes(parallel_config)
        model_config.verify_with_parallel_config(parallel_config)
        requested = self.enable_chunked_prefill
        enable_chunked_prefill = self.chunked_prefill_requested()
        max_num_partial_prefills = self.max_num_partial_prefills
        max_long_partial_prefills = self.max_long_partial_prefills
        if model_config.is_encoder_only:
            # vLLM's rule: an encoder attends over the whole prompt at once, and keeps no KV
            # between steps to share.
            if requested or cache_config.enable_prefix_caching:
                logger.warning(
                    "Chunked prefill and prefix caching are not supported for encoder-only "
                    "models: both are disabled."
                )
            enable_chunked_prefill = False
            cache_config.enable_prefix_caching = False
            # Partial prefills are chunked prefill's: without chunks there are none to share.
            if max_num_partial_prefills > 1:
                logger.warning(
                    "max_num_partial_prefills (%d) needs chunked prefill, which encoder-only "
                    "models do not support: set to 1.",
                    max_num_partial_prefills,
                )
            max_num_partial_prefills = max_long_partial_prefills = 1
        scheduler_config = SchedulerConfig(
            max_num_batched_tokens=self.max_num_batched_tokens,  # type: ignore[arg-type]
            max_num_seqs=self.max_num_seqs,
            max_model_len=model_config.max_model_len,
            preemption_mode=self.preemption_mode,
            enable_chunked_prefill=enable_chunked_prefill,
            async_scheduling=self.async_scheduling,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            max_num_partial_prefills=max_num_partial_prefills,
            max_long_partial_prefills=max_long_partial_prefills,
        )
        return EngineConfig(
            speculative_config=self._speculative_config(),
            model_config=model_config,
            cache_config=cache_config,
            parallel_config=parallel_config,
            scheduler_config=scheduler_config,
            device_config=device_config,
            lora_config=(
                LoRAConfig(self.max_lora_rank, self.max_loras, self.max_cpu_loras)
                if self.enable_lora
                else None
            ),
        )


@dataclass
class AsyncEngineArgs(EngineArgs):
    """Arguments for AsyncLLMEngine: EngineArgs plus the online-serving options."""

    # Serving: on, as vLLM V1 has it. A burst of prompts no longer waits for the whole burst's
    # prefill: each gets its first token after its own chunk (mean TTFT 9.6 -> 5.2 s under
    # `vllm bench serve` at PP=1, same output tokens/s: docs/PERFORMANCE.md).
    CHUNKED_PREFILL_DEFAULT: ClassVar[bool] = True

    disable_log_requests: bool = False
    # Newer vLLM's name, passed by Ray Data's LLM processor.
    enable_log_requests: bool = False
    # vLLM 0.5: run the engine in a Ray actor. Here the engine always runs in the server's
    # process (its stages are the Ray actors), so the flag is accepted with a warning.
    engine_use_ray: bool = False
    # vLLM's --max-log-len (the flag is the server's): characters of a request's parameters
    # in its log line.
    max_log_len: int | None = None

    def __post_init__(self) -> None:
        if self.engine_use_ray:
            from vllm.logger import init_logger

            init_logger("vllm.engine.arg_utils").warning(
                "engine_use_ray: the engine runs in this process; its stages are the Ray "
                "actors (--distributed-executor-backend ray)."
            )
        super().__post_init__()

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        parser = EngineArgs.add_cli_args(parser)
        parser.add_argument(
            "--disable-log-requests",
            "--disable_log_requests",
            action="store_true",
            help="Disable logging requests.",
        )
        parser.add_argument(
            "--engine-use-ray",
            "--engine_use_ray",
            action="store_true",
            help="Accepted for vLLM 0.5 compatibility (the engine runs in this process).",
        )
        return parser
