"""Small torch-free helpers shared across the package."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def ceil_div(a: int, b: int) -> int:
    """`a / b` rounded up, for non-negative integers (`b` > 0)."""
    return -(-a // b)


class FlexibleArgumentParser(argparse.ArgumentParser):
    """vLLM's ArgumentParser: `--flag_name` is read as `--flag-name` (also in `--a_b=value`)."""

    def parse_args(self, args: Any = None, namespace: Any = None) -> Any:
        if args is None:
            args = sys.argv[1:]
        processed = []
        for arg in args:
            if arg.startswith("--"):
                key, eq, value = arg.partition("=")
                arg = "--" + key[2:].replace("_", "-") + eq + value
            processed.append(arg)
        return super().parse_args(processed, namespace)
