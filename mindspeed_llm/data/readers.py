"""Reading raw datasets: a JSON array, JSON Lines or Parquet file, or a folder of them.

Rows are yielded as ``(source, row)`` where ``source`` is ``"file:line"`` (JSON Lines),
``"file[row N]"`` (JSON array, Parquet) and ``row`` is a dict. Parquet is read with pyarrow in
record batches, nested structs and lists (for example DAPO-Math's chat-message ``prompt`` and
``reward_model.ground_truth``) come back as Python dicts and lists. JSON is parsed with the
``json`` module so values keep their exact types and a malformed line is reported with its
file and line number.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator, List, Tuple

from mindspeed_llm.data.errors import DataError, InputFormatError

JSON_SUFFIXES = (".json", ".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet", ".pq")
SUPPORTED_SUFFIXES = JSON_SUFFIXES + PARQUET_SUFFIXES


def list_input_files(path: os.PathLike) -> List[Path]:
    """The input files for ``--input``: the file itself, or a folder's supported files by name."""
    p = Path(path)
    if p.is_dir():
        files = sorted(f for f in p.iterdir()
                       if f.is_file() and f.suffix.lower() in SUPPORTED_SUFFIXES and not f.name.startswith("."))
        if not files:
            raise DataError(f"--input folder {p} holds no {'/'.join(SUPPORTED_SUFFIXES)} files")
        return files
    if not p.exists():
        raise DataError(f"--input {p} does not exist")
    if p.suffix.lower() not in SUPPORTED_SUFFIXES:
        raise InputFormatError(
            f"--input {p}: unsupported file type {p.suffix or '(none)'!r}; "
            f"supported: {', '.join(SUPPORTED_SUFFIXES)}")
    return [p]


def _check_row(row, source: str) -> dict:
    if not isinstance(row, dict):
        raise InputFormatError(f"{source}: expected a JSON object per row, got {type(row).__name__}")
    return row


def _iter_json_lines(path: Path, text: str) -> Iterator[Tuple[str, dict]]:
    decoder = json.JSONDecoder()
    # split on "\n" only: str.splitlines() would also split on U+2028 inside JSON strings
    for lineno, line in enumerate(text.split("\n"), start=1):
        line = line.strip()
        if not line:
            continue
        try:
            row, end = decoder.raw_decode(line)
            if end != len(line):
                raise json.JSONDecodeError("extra data after the JSON value", line, end)
        except json.JSONDecodeError as e:
            raise InputFormatError(
                f"{path}:{lineno}: malformed JSON line (column {e.colno}): {e.msg}") from None
        yield f"{path}:{lineno}", _check_row(row, f"{path}:{lineno}")


def _iter_json(path: Path) -> Iterator[Tuple[str, dict]]:
    try:
        text = path.read_text(encoding="utf-8-sig")  # tolerate a UTF-8 byte-order mark
    except UnicodeDecodeError as e:
        raise InputFormatError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    head = text.lstrip()[:1]
    if head == "[":
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise InputFormatError(
                f"{path}:{e.lineno}: malformed JSON (column {e.colno}): {e.msg}") from None
        for i, row in enumerate(rows):
            yield f"{path}[row {i}]", _check_row(row, f"{path}[row {i}]")
    else:
        # JSON Lines, whatever the suffix (many "*.json" datasets are JSON Lines)
        yield from _iter_json_lines(path, text)


def _iter_parquet(path: Path, batch_size: int = 1024) -> Iterator[Tuple[str, dict]]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError subclasses
        raise InputFormatError(f"{path}: cannot read as Parquet: {e}") from None
    i = 0
    for batch in pf.iter_batches(batch_size=batch_size):
        for row in batch.to_pylist():
            yield f"{path}[row {i}]", row
            i += 1


def iter_rows(path: os.PathLike) -> Iterator[Tuple[str, dict]]:
    """Yield ``(source, row)`` for every row of ``--input`` (a file or a folder), in order."""
    for f in list_input_files(path):
        if f.suffix.lower() in PARQUET_SUFFIXES:
            yield from _iter_parquet(f)
        else:
            yield from _iter_json(f)


def flat_columns(row: dict, prefix: str = "", depth: int = 2) -> List[str]:
    """Column names of a row, nested struct fields as ``parent.child`` (for error messages)."""
    names = []
    for k, v in row.items():
        name = f"{prefix}{k}"
        names.append(name)
        if isinstance(v, dict) and depth > 1:
            names.extend(flat_columns(v, name + ".", depth - 1))
    return names
