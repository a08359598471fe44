"""The `vllm` command line (console script): `vllm serve MODEL [engine and server flags]` and
`vllm run-batch -i INPUT -o OUTPUT --model MODEL [engine flags]`."""

from __future__ import annotations

import argparse
import asyncio
import sys


def main(argv: list[str] | None = None) -> None:
    from vllm.entrypoints.openai import run_batch
    from vllm.entrypoints.openai.api_server import make_arg_parser, serve

    parser = argparse.ArgumentParser(prog="vllm", description="vLLM CLI")
    subparsers = parser.add_subparsers(dest="subcommand", required=True)
    serve_parser = subparsers.add_parser(
        "serve",
        help="Start the OpenAI-compatible server.",
        usage="vllm serve <model_tag> [options]",
    )
    serve_parser.add_argument("model_tag", type=str, help="The model to serve.")
    make_arg_parser(serve_parser)
    batch_parser = subparsers.add_parser(
        "run-batch",
        help="Run an OpenAI batch file offline.",
        usage="vllm run-batch -i INPUT.jsonl -o OUTPUT.jsonl --model <model> [options]",
    )
    run_batch.make_arg_parser(batch_parser)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.subcommand == "serve":
        # The positional model wins over --model (as in vLLM).
        args.model = args.model_tag
        asyncio.run(serve(args))
    elif args.subcommand == "run-batch":
        run_batch.run(args)


if __name__ == "__main__":
    main()
