"""A random-weight model with SmolLM2-135M's shape that splits over 2 (and 4) TP ranks.

SmolLM2-135M has 9 attention heads and 3 KV heads, which no TP size but 3 and 9 divides (vLLM
refuses the rest, and so does this engine). For TP=2 vs PP=2 comparisons this builds the same
shape with 8 query heads and 4 KV heads of 64 (hidden 576, MLP 1536, 30 layers, vocab 49152,
tied embeddings): the same per-token work within ~5%. Weights are random, so benchmark runs
use `ignore_eos` (every request generates exactly its token budget).

    python -m benchmarks.tp_model /tmp/smollm2-shape-8h     # then --model /tmp/smollm2-shape-8h
"""

from __future__ import annotations

import argparse
import os


def build(out_dir: str, heads: int = 8, kv_heads: int = 4, seed: int = 0) -> str:
    """Save the model and SmolLM2's tokenizer into `out_dir` (skipped if it already exists)."""
    if os.path.isfile(os.path.join(out_dir, "config.json")):
        return out_dir
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from vllm.transformers_utils.gguf_config import (
        load_gguf_config,
        load_gguf_tokenizer,
        resolve_model,
    )

    path = resolve_model("smollm2")
    base = load_gguf_config(path)
    tokenizer = load_gguf_tokenizer(path)
    config = LlamaConfig(
        architectures=["LlamaForCausalLM"],
        hidden_size=base.hidden_size,
        intermediate_size=base.intermediate_size,
        num_hidden_layers=base.num_hidden_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=64,
        vocab_size=base.vocab_size,
        max_position_embeddings=base.max_position_embeddings,
        rms_norm_eps=base.rms_norm_eps,
        rope_theta=getattr(base, "rope_theta", 10000.0),
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out_dir")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    args = parser.parse_args()
    print(build(args.out_dir, args.heads, args.kv_heads))


if __name__ == "__main__":
    main()
