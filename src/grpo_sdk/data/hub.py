"""Datasets by name (``data.train_path: hf:openai/gsm8k``), and the options any dataset takes.

``hf:NAME`` is read with ``datasets.load_dataset(NAME, data.subset, split=data.split,
revision=data.revision, streaming=data.streaming)``: NAME is a hub id, or a local directory laid
out like a hub dataset repo (data files plus a README.md whose YAML declares the configs), which
``load_dataset`` reads by the same rules. ``data.columns`` renames columns and ``data.max_rows``
keeps the first rows, for hub datasets and local files alike. Rows come back as
``data.prompts.read_rows`` returns them, ``(where, row)``, so templating, tokenizing and the checks
are those of every dataset; a row is named ``hf:openai/gsm8k (main, train) row 17``.

Exact resume: the prompts are read whole at start-up and again on resume, and the dataloader
state carries a fingerprint of every prompt, so a resume over different rows is refused, never
silently trained on. A streaming dataset is read up to ``data.max_rows`` (required: a stream may
not end); its first rows at one revision are the same every time, and ``data.revision`` pinned to
a commit keeps them so across pushes to the dataset (docs/data.md).

Offline: a hub id is only tried when the hub answers (``grpo_sdk.core.hub.probe``, a few
seconds); otherwise it is read from the local cache or fails at once with what to do.
"""

from __future__ import annotations

import contextlib
import itertools
from pathlib import Path
from typing import Any, Iterable

import attrs

from grpo_sdk.core.errors import DataError
from grpo_sdk.core.hub import is_hub_id, offline_hint, offline_mode, probe
from grpo_sdk.data.files import DATA_EXTRA, read_file_rows

HUB_PREFIX = "hf:"


@attrs.frozen(kw_only=True)
class DataSource:
    """A dataset and how to read it; ``str()`` is the path as written, for messages."""

    path: str
    key: str  # the config key it came from, for messages
    split: str = "train"
    subset: str | None = None
    revision: str | None = None
    columns: dict[str, str] = attrs.field(factory=dict)
    streaming: bool = False
    max_rows: int | None = None

    @property
    def is_hub(self) -> bool:
        return self.path.startswith(HUB_PREFIX)

    def __str__(self) -> str:
        return self.path


def data_source(data: Any, which: str, index: int | None = None, max_rows: int | None = None) -> Any:
    """What ``data.prompts.load_prompts`` reads for ``which`` ("train", "validation", or "datasets" with
    ``index``): the plain path when nothing but the path applies (local files read as they always
    were), else a DataSource carrying the split, subset, columns and row bound."""
    if which == "datasets":
        ds = data.datasets[index]
        path, key, split = ds.path, f"data.datasets[{index}].path", ds.split or data.split
        subset, columns = ds.subset or data.subset, data.columns if ds.columns is None else ds.columns
    else:
        path, key = (data.train_path, "data.train_path") if which == "train" else \
            (data.validation_path, "data.validation_path")
        split, subset, columns = data.split if which == "train" else data.validation_split, data.subset, data.columns
    # Validation keeps its first grpo.max_val_samples prompts after filtering; a stream is cut there.
    max_rows = data.max_rows if which != "validation" else (max_rows if data.streaming else None)
    if not path.startswith(HUB_PREFIX) and not columns and max_rows is None:
        return path
    return DataSource(path=path, key=key, split=split, subset=subset, revision=data.revision, columns=dict(columns),
                      streaming=data.streaming, max_rows=max_rows)


def source_rows(source: Any) -> list[tuple[str, dict[str, Any]]]:
    """``(where, row)`` of a DataSource, or of a bare ``hf:NAME`` path with the default options."""
    if not isinstance(source, DataSource):
        source = DataSource(path=str(source), key="data.train_path")
    if source.is_hub:
        rows = hub_rows(source)
    else:
        rows = read_file_rows(Path(source.path))
        rows = rows if source.max_rows is None else rows[:source.max_rows]
    return rename_columns(rows, source.columns, source.key) if source.columns else rows


def rename_columns(rows: list[tuple[str, dict[str, Any]]], columns: dict[str, str],
                   key: str) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for where, row in rows:
        if not isinstance(row, dict):
            out.append((where, row))  # load_prompts names the row that is not an object
            continue
        missing = [c for c in columns if c not in row]
        if missing:
            raise DataError(f"{where}: no column {missing[0]!r} to rename (data.columns); columns: {sorted(row)}")
        clash = [t for c, t in columns.items() if t in row and t not in columns]
        if clash:
            raise DataError(f"{where}: data.columns renames {next(c for c, t in columns.items() if t == clash[0])!r} "
                            f"to {clash[0]!r}, a column the row already has; rename or drop that one too")
        out.append((where, {**{k: v for k, v in row.items() if k not in columns},
                            **{columns[c]: row[c] for c in columns}}))
    return out


# --- datasets.load_dataset ----------------------------------------------------------------------


def hub_rows(source: DataSource) -> list[tuple[str, dict[str, Any]]]:
    name = source.path[len(HUB_PREFIX):]
    key = source.key
    if source.streaming and source.max_rows is None:
        raise DataError(f"{key}: data.streaming=true needs data.max_rows: the prompts are read once at start-up "
                        "(and the same first rows again on resume), so a stream must end")
    local = bool(name) and Path(name).expanduser().is_dir()
    if not local and not is_hub_id(name):
        raise DataError(f"{key}: {source.path}: {name!r} is neither a hub dataset id (hf:ORG/NAME) nor a "
                        "directory laid out like a hub dataset repo")
    try:
        import datasets
    except ImportError:
        raise DataError(f"{key}: {source.path}: loading datasets by name needs datasets: {DATA_EXTRA}") from None
    unreachable = None if local else probe()
    label = f"{source.path} ({', '.join(filter(None, [source.subset, source.split]))})"
    try:
        with offline_mode() if unreachable else contextlib.nullcontext():
            loaded = datasets.load_dataset(str(Path(name).expanduser()) if local else name, source.subset,
                                           split=source.split, revision=source.revision,
                                           streaming=source.streaming)
            return [(f"{label} row {i}", row) for i, row in enumerate(_take(loaded, source.max_rows))]
    except (ConnectionError, OSError) as exc:
        if unreachable is not None and not isinstance(exc, datasets.exceptions.DatasetNotFoundError):
            raise DataError(f"{key}: {source.path} is not in the local cache and the hub cannot be reached "
                            f"({unreachable}); {offline_hint('a local dataset file (JSONL, Parquet) or directory')}"
                            ) from exc
        hint = "" if local else "; a private or gated dataset needs HF_TOKEN"
        raise DataError(f"{key}: could not load {source.path}: {_first_line(exc)}{hint}") from exc
    except Exception as exc:  # noqa: BLE001 - datasets raises ValueError and its own types for a bad name
        raise DataError(f"{key}: could not load {source.path} with subset {source.subset!r}, split "
                        f"{source.split!r} (data.subset, data.split / data.validation_split, data.revision): "
                        f"{_first_line(exc)}") from exc


def _take(loaded: Any, limit: int | None) -> Iterable[dict[str, Any]]:
    if limit is None:
        return loaded.to_list() if hasattr(loaded, "to_list") else list(loaded)
    if hasattr(loaded, "select"):  # a map-style Dataset: read only the rows kept
        return loaded.select(range(min(limit, len(loaded)))).to_list()
    return list(itertools.islice(loaded, limit))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__
