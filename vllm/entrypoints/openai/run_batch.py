"""The OpenAI batch-file runner (vLLM's `run_batch`):

    vllm run-batch -i requests.jsonl -o results.jsonl --model MODEL [engine flags]
    python -m vllm.entrypoints.openai.run_batch -i requests.jsonl -o results.jsonl --model MODEL

Each input line `{"custom_id", "method": "POST", "url", "body"}` for `/v1/completions` or
`/v1/chat/completions` runs through the server's own handlers (see `batch_lines`); one output
line per input line, in input order. A bad line gets an error line and the rest run. Input and
output may be local paths or http(s) URLs (GET / PUT). The output file is written whole under a
temporary name and renamed, so a run that stops early leaves no partial file. The exit status is
0, or 1 when some lines were not batch requests at all (invalid JSON, no custom_id: vLLM's run
fails on such a file); their error lines are in the output all the same.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
from http import HTTPStatus

from tqdm import tqdm

from vllm.engine.async_llm_engine import AsyncEngineDeadError, AsyncLLMEngine
from vllm.entrypoints.openai.batch_lines import (
    BatchLineRunner,
    BatchRequestInput,
    BatchRequestOutput,
    error_output,
    parse_lines,
)
from vllm.logger import init_logger

logger = init_logger("vllm.entrypoints.openai.run_batch")

# Plain text with a newline: a bar redrawn in place is mangled by the worker processes' and
# Ray's line-prefixed output.
_BAR_FORMAT = (
    "{desc}: {percentage:3.0f}% Completed | {n_fmt}/{total_fmt} "
    "[{elapsed}<{remaining}, {rate_fmt}]\n"
)


def make_arg_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """run-batch's flags plus every engine flag (AsyncEngineArgs)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.openai.api_server import add_tool_args

    if parser is None:
        parser = argparse.ArgumentParser(description="vLLM OpenAI-compatible batch runner.")
    parser.add_argument(
        "-i",
        "--input-file",
        required=True,
        type=str,
        help="The input batch file: a local path or an http(s) URL (read with GET).",
    )
    parser.add_argument(
        "-o",
        "--output-file",
        required=True,
        type=str,
        help="The output file: a local path or an http(s) URL (written with PUT).",
    )
    parser.add_argument(
        "--output-tmp-dir",
        type=str,
        default=None,
        help="Where the output is written before it is uploaded to an output URL.",
    )
    parser.add_argument(
        "--chat-template", type=str, default=None, help="A Jinja chat template (file or text)."
    )
    add_tool_args(parser)
    parser.add_argument(
        "--max-log-len",
        type=int,
        default=None,
        help="Max number of characters of a request's parameters printed in the log.",
    )
    parser.add_argument(
        "--disable-progress-bar", action="store_true", help="Do not show the progress bar."
    )
    return AsyncEngineArgs.add_cli_args(parser)


def read_input(path_or_url: str) -> str:
    """The batch file's text, from a local path or an http(s) URL."""
    if path_or_url.startswith(("http://", "https://")):
        import httpx

        response = httpx.get(path_or_url, timeout=300, follow_redirects=True)
        response.raise_for_status()
        return response.text
    with open(path_or_url, encoding="utf-8") as f:
        return f.read()


def write_output(path_or_url: str, lines: list[str], tmp_dir: str | None = None) -> None:
    """Write the output lines: to a local path atomically (a temporary file renamed), or with
    an HTTP PUT to a URL."""
    is_url = path_or_url.startswith(("http://", "https://"))
    directory = tmp_dir if is_url else (os.path.dirname(os.path.abspath(path_or_url)))
    fd, tmp = tempfile.mkstemp(prefix=".run_batch_", suffix=".jsonl", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.writelines(line + "\n" for line in lines)
            f.flush()
            os.fsync(f.fileno())
        if is_url:
            import httpx

            with open(tmp, "rb") as f:
                httpx.put(path_or_url, content=f.read(), timeout=1000).raise_for_status()
        else:
            os.replace(tmp, path_or_url)
            tmp = ""
    finally:
        if tmp:
            os.unlink(tmp)


async def run_lines(
    runner: BatchLineRunner,
    items: list[BatchRequestInput | BatchRequestOutput],
    max_concurrency: int,
    progress: bool = True,
) -> list[BatchRequestOutput]:
    """Every parsed line's output (`parse_lines`), in input order, at most `max_concurrency`
    running at once. If the engine dies, the lines not yet answered get 500 error lines."""
    results: list[BatchRequestOutput | None] = [
        item if isinstance(item, BatchRequestOutput) else None for item in items
    ]
    semaphore = asyncio.Semaphore(max_concurrency)
    bar = tqdm(
        total=len(items),
        desc="Running batch",
        unit="req",
        disable=not progress,
        bar_format=_BAR_FORMAT,
        mininterval=5,
    )
    bar.update(sum(r is not None for r in results))

    async def one(index: int, request: BatchRequestInput) -> None:
        async with semaphore:
            try:
                results[index] = await runner.run(request)
            except AsyncEngineDeadError as exc:
                results[index] = error_output(
                    request.custom_id,
                    str(exc),
                    status=HTTPStatus.INTERNAL_SERVER_ERROR,
                    err_type="InternalServerError",
                )
        bar.update(1)

    try:
        await asyncio.gather(
            *(one(i, item) for i, item in enumerate(items) if isinstance(item, BatchRequestInput))
        )
    finally:
        bar.close()
    return [r for r in results if r is not None]


def build_runner(engine: AsyncLLMEngine, args: argparse.Namespace) -> BatchLineRunner:
    """The completion and chat handlers the server would build from these flags."""
    from vllm.entrypoints.openai.api_server import limits_from_args
    from vllm.entrypoints.openai.bounded_work import BoundedWork
    from vllm.entrypoints.openai.serving_chat import OpenAIServingChat
    from vllm.entrypoints.openai.serving_completion import OpenAIServingCompletion

    served = args.served_model_name
    names = ([served] if isinstance(served, str) else list(served)) if served else [args.model]
    scheduler_config = engine.engine.scheduler_config
    work = BoundedWork(
        engine.engine.get_tokenizer(), scheduler_config.max_model_len, limits_from_args(args)
    )
    completion = OpenAIServingCompletion(
        engine,
        names,
        work=work,
        return_tokens_as_token_ids=getattr(args, "return_tokens_as_token_ids", False),
    )
    chat = OpenAIServingChat(
        engine,
        names,
        response_role=getattr(args, "response_role", "assistant"),
        work=work,
        chat_template=args.chat_template,
        enable_auto_tools=getattr(args, "enable_auto_tool_choice", False),
        tool_parser=getattr(args, "tool_call_parser", None),
        reasoning_parser=getattr(args, "reasoning_parser", None),
    )
    return BatchLineRunner(completion, chat)


async def run_batch(engine: AsyncLLMEngine, args: argparse.Namespace) -> list[BatchRequestOutput]:
    """Run the batch file `args.input_file` on `engine` and write `args.output_file` (every
    line's output, in order). Raises MalformedBatchError after writing it if some lines were
    not batch requests at all (as vLLM, whose run fails on such a file)."""
    runner = build_runner(engine, args)
    logger.info("Reading batch from %s...", args.input_file)
    text = await asyncio.to_thread(read_input, args.input_file)
    items = parse_lines(text)
    # Twice the scheduler's sequences (as vLLM): the engine always has the next ones queued.
    max_concurrency = 2 * engine.engine.scheduler_config.max_num_seqs
    try:
        outputs = await run_lines(
            runner, items, max_concurrency, progress=not args.disable_progress_bar
        )
    finally:
        runner.completion.work.shutdown()
    lines = [o.model_dump_json() for o in outputs]
    await asyncio.to_thread(write_output, args.output_file, lines, args.output_tmp_dir)
    failed = sum(not o.ok for o in outputs)
    logger.info("Wrote %d results to %s (%d failed)", len(outputs), args.output_file, failed)
    malformed = sum(isinstance(item, BatchRequestOutput) for item in items)
    if malformed:
        raise MalformedBatchError(
            f"{malformed} line(s) of {args.input_file} are not batch requests (invalid JSON, "
            "no custom_id, ...): their error lines are in the output, the other lines ran."
        )
    return outputs


class MalformedBatchError(ValueError):
    """Some lines of the input file were not batch requests (the rest ran)."""


async def _main(args: argparse.Namespace) -> None:
    from vllm.entrypoints.openai.api_server import build_engine

    engine = build_engine(args)
    engine.max_log_len = getattr(args, "max_log_len", None)
    try:
        await run_batch(engine, args)
    finally:
        engine.shutdown()


def main(argv: list[str] | None = None) -> None:
    """Entry point of `python -m vllm.entrypoints.openai.run_batch`."""
    run(make_arg_parser().parse_args(argv))


def run(args: argparse.Namespace) -> None:
    """Run a parsed run-batch command line (also `vllm run-batch`)."""
    if getattr(args, "enable_auto_tool_choice", False) and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice requires --tool-call-parser to be set")
    try:
        asyncio.run(_main(args))
    except MalformedBatchError as exc:
        logger.error("%s", exc)
        sys.exit(1)


if __name__ == "__main__":
    main()
