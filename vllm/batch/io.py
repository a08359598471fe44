"""Reading prompts into a Ray Dataset and writing the generated rows (Parquet or JSONL).

Input, by suffix: `.txt` (one prompt per non-empty line, column `prompt`), `.jsonl`/`.json`
(one object per line: `prompt` and/or `messages`, optional `sampling_params`, any other
columns are carried through), `.parquet` (a file or a directory of them). Output: a directory
of Parquet or JSONL files, one or more per block, as Ray Data writes them; `read_outputs`
reads either back as a pandas DataFrame.
"""

from __future__ import annotations

import glob
import os
from typing import Any

INPUT_FORMATS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
OUTPUT_FORMATS = ("parquet", "jsonl")


def input_format(path: str) -> str:
    if os.path.isdir(path):
        files = sorted(glob.glob(os.path.join(path, "*")))
        suffixes = {os.path.splitext(f)[1] for f in files if os.path.isfile(f)}
        known = [INPUT_FORMATS[s] for s in suffixes if s in INPUT_FORMATS]
        if len(set(known)) == 1:
            return known[0]
        raise ValueError(f"cannot tell the format of the files in {path!r} ({sorted(suffixes)})")
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in INPUT_FORMATS:
        raise ValueError(
            f"unknown input format {suffix!r} for {path!r}: use .txt, .jsonl/.json or .parquet"
        )
    return INPUT_FORMATS[suffix]


def read_dataset(path: str, prompt_column: str = "prompt") -> Any:
    """A Ray Dataset of the prompts in `path` (see the module doc for the formats)."""
    import ray.data

    fmt = input_format(path)
    if fmt == "text":
        # Ray's read_text keeps empty lines; a prompt file's blank lines are not prompts.
        ds = ray.data.read_text(path).filter(lambda row: bool(row["text"].strip()))
        return ds.rename_columns({"text": prompt_column}) if prompt_column != "text" else ds
    if fmt == "json":
        return ray.data.read_json(path, lines=True)
    return ray.data.read_parquet(path)


def output_format(path: str, fmt: str | None = None) -> str:
    if fmt:
        if fmt not in OUTPUT_FORMATS:
            raise ValueError(f"output format must be one of {OUTPUT_FORMATS}, got {fmt!r}")
        return fmt
    suffix = os.path.splitext(path.rstrip("/"))[1].lower()
    return "jsonl" if suffix in (".jsonl", ".json") else "parquet"


def write_dataset(ds: Any, path: str, fmt: str | None = None) -> str:
    """Run `ds` and write it under the directory `path`; returns the format used."""
    fmt = output_format(path, fmt)
    if fmt == "parquet":
        ds.write_parquet(path)
    else:
        ds.write_json(path)  # JSON Lines, one file per block
    return fmt


def read_outputs(path: str, fmt: str | None = None) -> Any:
    """The rows written by write_dataset, as one pandas DataFrame."""
    import pandas as pd

    fmt = output_format(path, fmt)
    if fmt == "parquet":
        return pd.read_parquet(path)
    files = sorted(f for f in glob.glob(os.path.join(path, "*")) if os.path.isfile(f))
    frames = [
        # JSON types as written: no guessing (a prompt "42" stays a string)
        pd.read_json(f, lines=True, dtype=False)
        for f in files
        if os.path.getsize(f) > 0
    ]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
