"""Rows of a local dataset file: JSON lines (``.jsonl``, ``.json``), Parquet (``.parquet``) or a
directory written by ``datasets.Dataset.save_to_disk``.

Each row comes back as ``(where, row)``, ``where`` naming it for error messages
(``"data/train.jsonl line 7"``, ``"data/train.parquet row 17"``; lines count from 1 as an editor
shows them, rows from 0 as ``table[i]`` indexes them). Datasets by name and the options any
dataset takes (split, columns, max_rows) are ``grpo_sdk.data.hub``'s, which reads a local path
through this module; ``grpo_sdk.data.prompts.read_rows`` takes either.
"""

from __future__ import annotations

import json
import stat
from pathlib import Path
from typing import Any

from grpo_sdk.core.errors import DataError

DATA_EXTRA = "pip install 'grpo-sdk[data]'"


def read_file_rows(path: str | Path) -> list[tuple[str, dict[str, Any]]]:
    """``(where, row)`` for every row of a JSONL/JSON/Parquet file or a save_to_disk directory."""
    path = Path(path).expanduser()
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise DataError(f"{path}: no such file or directory") from None
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the name
        raise DataError(f"{path}: cannot be read ({getattr(exc, 'strerror', None) or exc})") from None
    if stat.S_ISDIR(mode):
        return _dataset_dir_rows(path)
    if not stat.S_ISREG(mode):
        # A FIFO would block the start-up until a writer comes, and is empty on resume.
        kind = "FIFO (named pipe)" if stat.S_ISFIFO(mode) else "device or socket"
        raise DataError(f"{path}: is a {kind}, not a regular file; the dataset is read whole at start-up and "
                        "again on resume, so write it to a file")
    if path.suffix in (".jsonl", ".json"):
        return _jsonl_rows(path)
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DataError(f"{path}: reading Parquet needs pyarrow: {DATA_EXTRA}") from None
        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as exc:  # noqa: BLE001 - pyarrow raises several types for a bad file
            raise DataError(f"{path}: not a readable Parquet file ({exc})") from None
        return [(f"{path} row {i}", row) for i, row in enumerate(rows)]
    raise DataError(f"{path}: unknown format {path.suffix!r}; expected .jsonl, .json, .parquet or a directory "
                    "saved by datasets' save_to_disk")


def _jsonl_rows(path: Path) -> list[tuple[str, dict[str, Any]]]:
    rows = []
    try:
        f = open(path, "rb")  # bytes, so a non-UTF-8 line is named rather than crashing the reader
    except OSError as exc:
        raise DataError(f"{path}: cannot be read ({exc.strerror})") from None
    with f:
        for line_no, raw in enumerate(f, start=1):
            where = f"{path} line {line_no}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                utf16 = " (it looks like UTF-16)" if line_no == 1 and raw[:2] in (b"\xff\xfe", b"\xfe\xff") else ""
                raise DataError(f"{where}: not UTF-8 (byte 0x{raw[exc.start]:02x} at column {exc.start + 1}){utf16}; "
                                "JSON lines must be UTF-8") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno}); "
                                "expected one JSON object per line") from None
            except RecursionError:
                raise DataError(f"{where}: nested too deeply to read; expected one JSON object per line") from None
            rows.append((where, row))
    return rows


def _dataset_dir_rows(path: Path) -> list[tuple[str, dict[str, Any]]]:
    try:
        import datasets
    except ImportError:
        raise DataError(f"{path}: reading a saved Hugging Face dataset needs datasets: {DATA_EXTRA}") from None
    try:
        ds = datasets.load_from_disk(str(path))
    except (OSError, ValueError) as exc:  # FileNotFoundError without its metadata files
        raise DataError(f"{path}: not a directory saved by datasets' save_to_disk ({exc})") from None
    label = str(path)
    if isinstance(ds, datasets.DatasetDict):  # a dict of splits: train on "train", or on the only split
        if "train" not in ds and len(ds) != 1:
            raise DataError(f"{path}: a DatasetDict with splits {sorted(ds)} and no 'train' split; save one split")
        split = "train" if "train" in ds else next(iter(ds))
        ds, label = ds[split], f"{path} (split {split})"
    return [(f"{label} row {i}", row) for i, row in enumerate(ds.to_list())]
