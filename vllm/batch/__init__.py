"""Offline batch inference over Ray Data: N replicas of an `LLM`, each in its own placement
group sized for its parallel layout (pipeline x tensor parallel ranks).

    import ray
    from vllm.batch import build_processor, read_dataset, write_dataset

    with build_processor("smollm2", num_instances=2, pipeline_parallel_size=1,
                         sampling_params={"temperature": 0, "max_tokens": 64}) as processor:
        write_dataset(processor(read_dataset("prompts.txt")), "out.parquet")

Importing this package does not import Ray Data (pandas, pyarrow); using it does.
"""

from vllm.batch.embed_predictor import EMBED_OUTPUT_COLUMNS, EmbeddingPredictor
from vllm.batch.io import read_dataset, read_outputs, write_dataset
from vllm.batch.predictor import OUTPUT_COLUMNS, LLMPredictor
from vllm.batch.processor import BatchProcessor, build_processor, instance_bundles

__all__ = [
    "EMBED_OUTPUT_COLUMNS",
    "OUTPUT_COLUMNS",
    "BatchProcessor",
    "EmbeddingPredictor",
    "LLMPredictor",
    "build_processor",
    "instance_bundles",
    "read_dataset",
    "read_outputs",
    "write_dataset",
]
