"""Offline generation with vLLM's API on the bundled SmolLM2-135M-Instruct.

python examples/offline_inference.py                # one stage
python examples/offline_inference.py --pp 2         # two pipeline stages (Ray workers)
"""

import argparse

from vllm import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pp", type=int, default=1, help="pipeline_parallel_size")
    args = parser.parse_args()

    prompts = [
        "Hello, my name is",
        "The capital of France is",
        "The future of AI is",
    ]
    sampling_params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=32, seed=0)
    llm = LLM(model="smollm2", pipeline_parallel_size=args.pp, kv_cache_space=1)
    for output in llm.generate(prompts, sampling_params):
        print(f"Prompt: {output.prompt!r}, Generated text: {output.outputs[0].text!r}")

    reply = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=20),
    )
    print("Chat:", reply[0].outputs[0].text)


if __name__ == "__main__":
    main()
