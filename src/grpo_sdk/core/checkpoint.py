"""Checkpoints that are never half-written, and the bookkeeping of which ones to keep.

A checkpoint is written into ``<dir>/.step_N.partial``, every file flushed and fsynced, then the
directory is renamed to ``<dir>/step_N`` (a rename within one filesystem is atomic), and only
then is ``latest_checkpoint_status.json`` rewritten (itself through a temporary file and a
rename). A crash at any moment leaves either no ``step_N`` or a complete one; leftover
``.partial`` directories are removed at the next start.

Layout of ``step_N/``::

    policy/                  the policy backend's files; for hf a Hugging Face model directory
                             (config.json, model.safetensors, tokenizer) plus optimizer.safetensors
    generation/              the generation backend's state (its sampling RNG), when it has any
    rng.safetensors          torch's global RNG state
    training_state.json      step counters, dataloader position, Python RNG state, ranking metric

Nothing here is read back with pickle: tensors are safetensors, the rest JSON.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any

from grpo_sdk.core.config import CheckpointingConfig

STATUS_FILE = "latest_checkpoint_status.json"
STATE_FILE = "training_state.json"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """Flush every file below ``path`` and the directories themselves to disk."""
    for root, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb+") as f:
                os.fsync(f.fileno())
        _fsync_dir(Path(root))


def write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def step_of(path: Path) -> int:
    return int(path.name.split("_", 1)[1])


class CheckpointManager:
    """Writes, lists, ranks and prunes the checkpoints of one run."""

    def __init__(self, config: CheckpointingConfig, run_dir: Path):
        self.config = config
        self.directory = Path(config.checkpoint_dir) if config.checkpoint_dir else Path(run_dir) / "checkpoints"

    def checkpoints(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        if not self.directory.is_dir():
            return []
        found = [p for p in self.directory.iterdir() if p.is_dir() and p.name.startswith("step_")
                 and p.name[5:].isdigit() and (p / STATE_FILE).is_file()]
        return sorted(found, key=step_of)

    def latest(self) -> Path | None:
        found = self.checkpoints()
        return found[-1] if found else None

    def remove_partial(self) -> None:
        if self.directory.is_dir():
            for path in self.directory.glob(".step_*.partial"):
                shutil.rmtree(path, ignore_errors=True)

    def save(self, step: int, write: Any, state: dict[str, Any]) -> Path:
        """``write(directory)`` fills a fresh directory; it becomes ``step_<step>`` once complete."""
        self.directory.mkdir(parents=True, exist_ok=True)
        partial = self.directory / f".step_{step}.partial"
        final = self.directory / f"step_{step}"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
        write(partial)
        with open(partial / STATE_FILE, "w", encoding="utf-8") as f:
            json.dump(state, f)
        fsync_tree(partial)
        if final.exists():  # a resumed run re-reaching a step it had saved before the crash
            shutil.rmtree(final)
        os.replace(partial, final)
        _fsync_dir(self.directory)  # the rename itself
        write_json_atomic(self.directory / STATUS_FILE, {
            "last_checkpoint_step": step, "last_successful_ckpt_save_completion": time.time(), "path": str(final)})
        self.prune()
        return final

    def metric_of(self, path: Path) -> float | None:
        state = json.loads((path / STATE_FILE).read_text())
        value = state.get("ranking_metric")
        return value if isinstance(value, (int, float)) and math.isfinite(value) else None

    def best(self) -> Path | None:
        """The best checkpoint by ``metric_name`` (newest first among equals and unranked)."""
        found = self.checkpoints()
        if not found:
            return None
        if self.config.metric_name is None:
            return found[-1]
        sign = 1 if self.config.higher_is_better else -1

        def key(path: Path) -> tuple:
            value = self.metric_of(path)
            return (value is not None, sign * value if value is not None else 0.0, step_of(path))

        return max(found, key=key)

    def prune(self) -> None:
        """Keep the ``keep_top_k`` best by metric, and always the latest (resume needs it)."""
        k = self.config.keep_top_k
        found = self.checkpoints()
        if k is None or len(found) <= k:
            return
        keep = {found[-1]}
        if self.config.metric_name is None:
            keep.update(found[-k:])
        else:
            sign = 1 if self.config.higher_is_better else -1
            ranked = sorted(found, key=lambda p: (self.metric_of(p) is not None,
                                                  sign * (self.metric_of(p) or 0.0), step_of(p)), reverse=True)
            keep.update(ranked[:k])
        for path in found:
            if path not in keep:
                shutil.rmtree(path, ignore_errors=True)


def ranking_metric(name: str | None, train_metrics: dict[str, float], val_metrics: dict[str, float]) -> float | None:
    """The value of ``train:<key>`` or ``val:<key>`` for this step, if there is one."""
    if name is None:
        return None
    source, _, key = name.partition(":")
    value = (train_metrics if source == "train" else val_metrics).get(key)
    return float(value) if value is not None else None
