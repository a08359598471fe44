"""`StageChain`: the module of a stage that took over a lost neighbour's layers (its own
module and the gained one, each built for its old layout) runs as one stage. Here the only
stage of an in-process engine is swapped for a chain of two stage modules (the first with the
embeddings, the last with the norm and the lm_head): greedy tokens equal HF's."""

from __future__ import annotations

import pytest

from tests.utils import tiny_models
from vllm import LLM, SamplingParams
from vllm.model_executor.models.stage_chain import StageChain
from vllm.model_executor.models.utils import StageLayout
from vllm.model_executor.weight_utils import load_stage_model


@pytest.mark.parametrize("kind", ["llama-gqa-tied", "opt-post"])
def test_a_chain_of_two_stage_modules_runs_as_one_stage(kind, tiny_model_dirs, hf_reference):
    llm = LLM(tiny_model_dirs[kind], disable_log_stats=True)  # PP = 1, in process
    try:
        worker = llm.llm_engine.executor.worker
        config = worker.model_config
        layers = config.get_num_layers()
        parts = [
            load_stage_model(config, StageLayout(0, 2, True, False), worker.device),
            load_stage_model(config, StageLayout(2, layers, False, True), worker.device),
        ]
        default_shape = (config.get_num_kv_heads(), config.get_head_size())
        chain = StageChain(parts, default_shape)
        assert chain.kv_cache_shapes() == [default_shape] * layers
        assert chain.num_params == sum(p.num_params for p in parts)
        worker.model_runner.model = chain
        greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
        outputs = llm.generate(tiny_models.PROMPTS, greedy, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outputs] == hf_reference(kind)
    finally:
        llm.shutdown()
