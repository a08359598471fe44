"""Weight-only quantization (vLLM's `--quantization`): the GGUF blocks kept as shipped
(`gguf.py`). Which method a model runs is decided by `ModelConfig` (`resolve_quantization` in
vllm/config.py)."""
