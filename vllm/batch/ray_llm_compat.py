"""What Ray Data's own LLM module (`ray.data.llm`, Ray 2.60) calls on `vllm`, checked here.

`ray.data.llm.build_processor(vLLMEngineProcessorConfig(...))` runs its vLLM stage
(`ray/llm/_internal/batch/stages/vllm_engine_stage.py`) on vLLM's async engine: it is not a
user of `LLM`. This module lists each call that stage makes and whether the installed `vllm`
(this package) provides it, so the gap is stated by the code rather than by a document that
goes stale:

    python -m vllm.batch.ray_llm_compat                    # the list
    python -m vllm.batch.ray_llm_compat --run HF_MODEL_DIR # and a run of ray.data.llm on CPU

Calls needed only for some features (LoRA, pooling/embeddings -- which this engine lacks --,
guided decoding) are listed as optional. Resource placement is not an engine call but is listed too:
by default the stage asks for GPU bundles.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Requirement:
    call: str
    needed_for: str
    required: bool
    ok: bool = False
    detail: str = ""


def _attr(path: str) -> object:
    """`a.b.C.meth` -> the object: the longest importable module prefix, then attributes."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            if cut == 1:
                raise
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(path)


def _has(path: str) -> tuple[bool, str]:
    try:
        _attr(path)
        return True, ""
    except (ImportError, AttributeError) as error:
        return False, f"{type(error).__name__}: {error}"


def _any_of(*paths: str) -> tuple[bool, str]:
    details = []
    for path in paths:
        ok, detail = _has(path)
        if ok:
            return True, f"as {path}"
        details.append(detail)
    return False, "; ".join(details)


def _accepts(path: str, *names: str) -> tuple[bool, str]:
    try:
        target = _attr(path)
    except (ImportError, AttributeError) as error:
        return False, f"{type(error).__name__}: {error}"
    if dataclasses.is_dataclass(target):
        fields = {f.name for f in dataclasses.fields(target)}
        missing = [n for n in names if n not in fields]
        return (not missing, f"no field(s) {missing}" if missing else "")
    params = inspect.signature(target).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return True, "(**kwargs)"
    missing = [n for n in names if n not in params]
    return (not missing, f"no parameter(s) {missing}" if missing else "")


def _metrics_is_dataclass() -> tuple[bool, str]:
    try:
        from vllm.outputs import RequestOutput
    except ImportError as error:
        return False, str(error)
    hints = inspect.get_annotations(RequestOutput, eval_str=False)
    if "metrics" not in hints and "metrics" not in inspect.signature(RequestOutput).parameters:
        return False, "RequestOutput has no `metrics`"
    ok, detail = _any_of("vllm.sequence.RequestMetrics", "vllm.outputs.RequestMetrics")
    if ok:
        cls = _attr(detail.removeprefix("as "))
        return dataclasses.is_dataclass(cls), "" if dataclasses.is_dataclass(cls) else (
            "RequestMetrics is not a dataclass (the stage calls dataclasses.asdict on it)"
        )
    return False, detail


CHECKS: list[tuple[str, str, bool, Callable[[], tuple[bool, str]]]] = [
    (
        "vllm.AsyncEngineArgs(**engine_kwargs, runner='generate', enable_log_requests=False)",
        "engine construction",
        True,
        lambda: _accepts(
            "vllm.AsyncEngineArgs", "runner", "enable_log_requests", "distributed_executor_backend"
        ),
    ),
    (
        "AsyncEngineArgs.create_engine_config() -> .scheduler_config.max_num_seqs, "
        ".parallel_config.pipeline_parallel_size",
        "the request semaphore",
        True,
        lambda: _has("vllm.AsyncEngineArgs.create_engine_config"),
    ),
    (
        "vllm.AsyncLLMEngine.from_engine_args(args, stat_loggers=...)",
        "engine construction",
        True,
        lambda: _accepts("vllm.AsyncLLMEngine.from_engine_args", "stat_loggers"),
    ),
    (
        "vllm.v1.metrics.ray_wrappers.RayPrometheusStatLogger",
        "log_engine_metrics=True (the default; pass False to skip)",
        False,
        lambda: _has("vllm.v1.metrics.ray_wrappers.RayPrometheusStatLogger"),
    ),
    (
        "vllm.inputs.llm.TextPrompt / TokensPrompt (or vllm.inputs.*)",
        "every request",
        True,
        lambda: _any_of("vllm.inputs.llm.TextPrompt", "vllm.inputs.TextPrompt"),
    ),
    (
        "await/async-for AsyncLLMEngine.generate(request_id=, prompt=, sampling_params=, "
        "lora_request=)",
        "every request",
        True,
        lambda: _accepts(
            "vllm.AsyncLLMEngine.generate",
            "request_id",
            "prompt",
            "sampling_params",
            "lora_request",
        ),
    ),
    (
        "await AsyncLLMEngine.do_log_stats()",
        "after each batch unless disable_log_stats",
        False,
        lambda: _has("vllm.AsyncLLMEngine.do_log_stats"),
    ),
    (
        "AsyncLLMEngine.shutdown()",
        "actor teardown",
        True,
        lambda: _has("vllm.AsyncLLMEngine.shutdown"),
    ),
    (
        "vllm.SamplingParams(**row['sampling_params'], structured_outputs=None)",
        "every request (the keyword is always passed)",
        True,
        lambda: _accepts("vllm.SamplingParams", "structured_outputs"),
    ),
    (
        "vllm.outputs.RequestOutput with dataclass .metrics (dataclasses.asdict)",
        "every output",
        True,
        _metrics_is_dataclass,
    ),
    (
        "vllm.sampling_params.StructuredOutputsParams",
        "guided decoding only",
        False,
        lambda: _has("vllm.sampling_params.StructuredOutputsParams"),
    ),
    (
        "vllm.lora.request.LoRARequest",
        "LoRA only",
        False,
        lambda: _has("vllm.lora.request.LoRARequest"),
    ),
    (
        "vllm.outputs.PoolingRequestOutput / AsyncLLMEngine.encode",
        "embed/classify only",
        False,
        lambda: _has("vllm.outputs.PoolingRequestOutput"),
    ),
]

# Not engine calls: what a user must pass to run the stage on CPU with a local model.
NOTES = [
    "Install: `ray[llm]` cannot be installed next to this package: it requires "
    "vllm[audio]==0.29.0 (PyPI's vLLM, which would replace this `vllm`) and nixl-cu13 (CUDA "
    "wheels). `import ray.data.llm` needs only `ray[data]` plus aiohttp, installed by hand.",
    "Resources: by default each replica asks for {'GPU': 1, 'CPU': 1} bundles (num_gpus=1 "
    "at PP x TP = 1). On CPU pass placement_group_config={'bundles': [{'CPU': 1}] * (PP*TP), "
    "'strategy': 'STRICT_PACK'} in vLLMEngineProcessorConfig.",
    "Model: model_source must be a local HF directory: the chat-template, tokenize and "
    "detokenize stages load it with transformers (the `smollm2` alias and .gguf files are "
    "this engine's, not transformers'); or disable those stages and pass prompt token ids.",
    "PP x TP > 1 runs the engine with distributed_executor_backend='ray' inside the replica's "
    "placement group: that needs the engine to use the caller's group (placement-group "
    "reuse), not create a second one.",
]


def check() -> list[Requirement]:
    results = []
    for call, needed_for, required, fn in CHECKS:
        try:
            ok, detail = fn()
        except Exception as error:  # a broken import is a finding, not a crash
            ok, detail = False, f"{type(error).__name__}: {error}"
        results.append(Requirement(call, needed_for, required, ok, detail))
    return results


def missing_required() -> list[Requirement]:
    return [r for r in check() if r.required and not r.ok]


def run_ray_data_llm(model_dir: str, num_rows: int = 8, pipeline_parallel_size: int = 1) -> list:
    """Run `ray.data.llm`'s vLLM processor on this engine, on CPU, with the settings the
    notes above list; returns the output rows. Needs Ray initialised (CPUs for the bundles
    plus one) and aiohttp installed."""
    import ray.data
    from ray.data.llm import build_processor, vLLMEngineProcessorConfig

    world = pipeline_parallel_size
    config = vLLMEngineProcessorConfig(
        model_source=model_dir,
        engine_kwargs={
            "device": "cpu",
            "kv_cache_space": 0.05,
            "swap_space": 0.01,
            "disable_log_stats": True,
            "pipeline_parallel_size": world,
        },
        placement_group_config={"bundles": [{"CPU": 1}] * world, "strategy": "STRICT_PACK"},
        log_engine_metrics=False,
        concurrency=1,
        batch_size=8,
    )
    processor = build_processor(
        config,
        preprocess=lambda row: {
            "messages": [{"role": "user", "content": row["prompt"]}],
            "sampling_params": {"temperature": 0.0, "max_tokens": 8},
        },
        postprocess=lambda row: {"prompt": row["prompt"], "text": row["generated_text"]},
    )
    ds = ray.data.from_items([{"prompt": f"Hello {i}"} for i in range(num_rows)])
    return processor(ds).take_all()


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--run",
        metavar="HF_MODEL_DIR",
        default=None,
        help="also run ray.data.llm's processor on this model (CPU)",
    )
    parser.add_argument("-pp", "--pipeline-parallel-size", type=int, default=1)
    args = parser.parse_args()
    results = check()
    for r in results:
        mark = "ok     " if r.ok else ("MISSING" if r.required else "absent ")
        print(
            f"[{mark}] {r.call}\n          needed for: {r.needed_for}"
            + (f"\n          {r.detail}" if r.detail else "")
        )
    for note in NOTES:
        print(f"- {note}")
    gaps = [r for r in results if r.required and not r.ok]
    print(
        f"\nray.data.llm's vLLM processor: {len(gaps)} required call(s) missing"
        + (" -- it cannot run on this engine yet." if gaps else ".")
    )
    if args.run:
        import ray

        ray.init(address="local", num_cpus=args.pipeline_parallel_size + 1, include_dashboard=False)
        rows = run_ray_data_llm(args.run, pipeline_parallel_size=args.pipeline_parallel_size)
        print(f"ray.data.llm processed {len(rows)} rows; first: {rows[0]}")


if __name__ == "__main__":
    main()
