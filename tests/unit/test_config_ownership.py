"""Configs are built once and frozen; the running pipeline's shape is the executor's
`PipelineShape`, and stage control is one typed interface (milliseconds, torch-free).

- No module writes a config field outside the config builders (`vllm/config.py`,
  `vllm/engine/arg_utils.py`): read from the source, every assignment to an attribute of an
  object named `*_config` (or a local bound to one, or a parameter typed `*Config`).
- A built `EngineConfig` refuses any write to its configs, naming the field.
- A `PipelineShape` change is a new value (next generation); the configs seen through it
  follow, the configured ones stay as built.
- `ExecutorBase` has no "cannot do this" stubs and nothing compares methods by `__func__`.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib

import pytest

from vllm.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    PlainConfig,
    SchedulerConfig,
)
from vllm.distributed.pipeline_shape import PipelineShape

pytestmark = pytest.mark.fast

REPO = pathlib.Path(__file__).resolve().parents[2]
BUILDERS = {"vllm/config.py", "vllm/engine/arg_utils.py"}


def _is_config_expr(node: ast.expr, aliases: set[str]) -> bool:
    """`x_config`, `a.b.x_config`, `config`, or a local bound to one of those."""
    if isinstance(node, ast.Name):
        return node.id.endswith("_config") or node.id == "config" or node.id in aliases
    if isinstance(node, ast.Attribute):
        return node.attr.endswith("_config")
    return False


def _config_aliases(tree: ast.AST) -> set[str]:
    """Names bound to a config anywhere in the file: `pc = engine.parallel_config`, a
    parameter `cc: CacheConfig` (one set per file: a name reused for something else in
    another function would be checked as a config too)."""
    aliases: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.arg) and node.annotation is not None:
            if ast.unparse(node.annotation).endswith("Config"):
                aliases.add(node.arg)
        elif isinstance(node, ast.Assign) and _is_config_expr(node.value, set()):
            aliases.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return aliases


def config_writes(source: str, filename: str) -> list[str]:
    """`file:line: target` of every write to a config's field in `source`."""
    tree = ast.parse(source, filename)
    aliases = _config_aliases(tree)
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("setattr", "delattr")
            and node.args
            and _is_config_expr(node.args[0], aliases)
        ):
            found.append((node.lineno, ast.unparse(node)))
        for target in targets:
            if isinstance(target, ast.Attribute) and _is_config_expr(target.value, aliases):
                found.append((target.lineno, ast.unparse(target)))
    return [f"{filename}:{line}: {text}" for line, text in sorted(found)]


def test_no_config_field_is_written_outside_the_builders() -> None:
    offenders = []
    for path in sorted((REPO / "vllm").rglob("*.py")):
        name, source = str(path.relative_to(REPO)), path.read_text()
        # A file that never says "config" holds no config expression (nor a `*Config` type).
        if name not in BUILDERS and "config" in source.lower():
            offenders += config_writes(source, name)
    assert not offenders, (
        "configs are frozen once built; publish a new PipelineShape (the executor) instead "
        f"of writing: {offenders}"
    )


def test_the_check_finds_writes_through_names_aliases_and_setattr() -> None:
    source = (
        "def f(engine, pc: ParallelConfig):\n"
        "    engine.parallel_config.pipeline_parallel_size = 2\n"
        "    cc = engine.cache_config\n"
        "    cc.num_gpu_blocks += 1\n"
        "    pc.pp_layer_partition = None\n"
        "    setattr(engine.cache_config, 'num_cpu_blocks', 3)\n"
        "    self._parallel_config = pc\n"  # a new reference of one's own: allowed
    )
    assert [w.split(": ", 1)[1] for w in config_writes(source, "x.py")] == [
        "engine.parallel_config.pipeline_parallel_size",
        "cc.num_gpu_blocks",
        "pc.pp_layer_partition",
        "setattr(engine.cache_config, 'num_cpu_blocks', 3)",
    ]


def _engine_config(pp: int = 2) -> EngineConfig:
    hf = PlainConfig(
        dict(
            architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64,
            intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            num_hidden_layers=6, vocab_size=300, max_position_embeddings=256,
            torch_dtype="float32", sliding_window=None,
        )
    )  # fmt: skip
    return EngineConfig(
        ModelConfig("tiny-llama", hf_config=hf, skip_tokenizer_init=True),
        CacheConfig(kv_cache_space=0.01),
        ParallelConfig(pp, distributed_executor_backend="mp", pp_layer_partition="auto"),
        SchedulerConfig(max_num_batched_tokens=256, max_model_len=256),
        DeviceConfig("cpu"),
    )


def test_a_built_engine_config_refuses_writes_naming_the_field() -> None:
    config = _engine_config()
    for part, field in [
        (config.parallel_config, "pipeline_parallel_size"),
        (config.parallel_config, "pp_layer_partition"),
        (config.cache_config, "num_gpu_blocks"),
        (config.cache_config, "num_cpu_blocks"),
        (config.scheduler_config, "max_num_seqs"),
        (config.model_config, "max_model_len"),
    ]:
        with pytest.raises(dataclasses.FrozenInstanceError, match=repr(field)):
            setattr(part, field, 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.cache_config = CacheConfig()  # type: ignore[misc]
    # Built but not yet in an EngineConfig (the builders' own step): still writable.
    loose = CacheConfig()
    loose.enable_prefix_caching = True
    assert not loose.frozen


def test_a_shape_change_is_a_new_value_and_the_configs_follow_it() -> None:
    config = _engine_config()
    shape = PipelineShape.configured(config)
    assert (shape.pipeline_parallel_size, shape.layer_split, shape.generation) == (2, (3, 3), 0)
    assert shape.layouts == [(0, 3), (3, 6)] and shape.last_stage_driver_rank == 1
    sized = shape.with_blocks(40, 8)
    merged = sized.resized(1, [6], "6")
    assert (sized.generation, merged.generation) == (1, 2)
    assert shape.num_gpu_blocks is None  # the old value is unchanged
    running = merged.running_config(config)
    assert running.parallel_config.pipeline_parallel_size == 1
    assert running.parallel_config.pp_layer_partition == "6"
    assert (running.cache_config.num_gpu_blocks, running.cache_config.num_cpu_blocks) == (40, 8)
    assert running.parallel_config.frozen and running.cache_config.frozen
    # The configured values stay as built.
    assert config.parallel_config.pipeline_parallel_size == 2
    assert config.parallel_config.pp_layer_partition == "auto"
    assert config.cache_config.num_gpu_blocks is None
    # "auto" restored after growing back: the split stays, its statement is the configured one.
    assert merged.resplit([6]).with_partition("auto").layer_partition == "auto"
    with pytest.raises(ValueError, match="layer_split"):
        shape.resized(3, [3, 3], None)
    with pytest.raises(ValueError, match="pp_rank 2"):
        shape.stage_layers(2)


def test_stage_control_is_a_typed_interface_not_stubs() -> None:
    base = (REPO / "vllm/executor/base.py").read_text()
    assert "NotImplementedError" not in base
    for path in (REPO / "vllm").rglob("*.py"):
        assert "__func__" not in path.read_text(), path
    from vllm.executor.elastic import ElasticStageExecutor
    from vllm.executor.stage_control import StageControl

    assert issubclass(ElasticStageExecutor, StageControl)


def test_max_model_len_above_the_context_needs_vllms_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM's rule and message: a max_model_len past the model's positions is refused unless
    VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 (long-prompt benchmarks time work past SmolLM2's 8k)."""
    hf = _engine_config().model_config.hf_config
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    with pytest.raises(ValueError, match="VLLM_ALLOW_LONG_MAX_MODEL_LEN=1"):
        ModelConfig("tiny-llama", hf_config=hf, skip_tokenizer_init=True, max_model_len=512)
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    config = ModelConfig("tiny-llama", hf_config=hf, skip_tokenizer_init=True, max_model_len=512)
    assert config.max_model_len == 512
