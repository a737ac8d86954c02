"""Checkpoints that are never half-written, verify themselves, and the bookkeeping of which to keep.

A checkpoint is written into ``<dir>/.step_N.partial``; its last file is ``manifest.json`` (every
other file's size and CRC-32); every file is flushed and fsynced, then the directory is renamed
to ``<dir>/step_N`` (a rename within one filesystem is atomic), and only then is
``latest_checkpoint_status.json`` rewritten (itself through a temporary file and a rename). A
crash at any moment leaves either no ``step_N`` or a complete one. A checkpoint leaves (pruning,
or a re-save of the same step) by a rename to ``.step_N.removing`` before it is deleted, so a
crash mid-delete leaves nothing that looks like a checkpoint and nothing that is never deleted;
leftover ``.partial`` and ``.removing`` directories are removed at the next start.

Resume verifies the manifest (``verify``): a flipped byte, a truncated or missing file, an
edited ``training_state.json`` is reported by path and reason, and resume falls back to the
newest checkpoint that verifies. CRC-32 detects accidental damage (2 GB/s here), not tampering.

Layout of ``step_N/``::

    policy/                  the policy backend's files; for hf a Hugging Face model directory
                             (config.json, model.safetensors, tokenizer) plus optimizer.safetensors;
                             with policy.lora peft's adapter directory instead of the model
    generation/              the generation backend's state (its sampling RNG), when it has any
    rng.safetensors          torch's global RNG state
    training_state.json      step counters, dataloader position, Python RNG state, ranking metric
    manifest.json            every other file's size and CRC-32, written last

Nothing here is read back with pickle: tensors are safetensors, the rest JSON.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
import zlib
from pathlib import Path
from typing import Any

from grpo_sdk.config.schema import CheckpointingConfig
from grpo_sdk.core.errors import GrpoSdkError
from grpo_sdk.core.protocols import ExportsMergedModel
from grpo_sdk.trainer.run_dir import fsync_dir as _fsync_dir
from grpo_sdk.trainer.run_dir import fsync_tree
from grpo_sdk.trainer.run_dir import write_text_atomic

STATUS_FILE = "latest_checkpoint_status.json"
STATE_FILE = "training_state.json"
MANIFEST_FILE = "manifest.json"
STATE_KEYS = {"step": int, "next_group_id": int, "data": dict, "python_random": list}


def write_json_atomic(path: Path, data: Any) -> None:
    write_text_atomic(path, json.dumps(data, indent=2))


def step_of(path: Path) -> int:
    return int(path.name.split("_", 1)[1])


def file_crc32(path: Path) -> str:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 23):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def write_manifest(directory: Path) -> None:
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST_FILE)
    entries = {str(p.relative_to(directory)): {"size": p.stat().st_size, "crc32": file_crc32(p)} for p in files}
    with open(directory / MANIFEST_FILE, "w", encoding="utf-8") as f:
        json.dump({"format": 1, "files": entries}, f, indent=1)


def verify(directory: Path) -> str | None:
    """Why ``directory`` is not a usable checkpoint, or None when every file matches its manifest."""
    try:
        entries = json.loads((directory / MANIFEST_FILE).read_text(encoding="utf-8"))["files"]
    except FileNotFoundError:
        return f"{MANIFEST_FILE} is missing (the checkpoint is incomplete, or older than grpo-sdk's manifests)"
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        entries = None
    if not isinstance(entries, dict) or not entries or not all(isinstance(e, dict) for e in entries.values()):
        return f"{MANIFEST_FILE} is not a valid manifest"
    for name, entry in entries.items():
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != entry.get("size"):
            return f"{name} has {size} bytes, the manifest says {entry.get('size')}"
        if file_crc32(path) != entry.get("crc32"):
            return f"{name} does not match its checksum (the file is damaged or was edited)"
    if STATE_FILE not in entries:
        return f"{STATE_FILE} is not in the manifest"
    try:
        state = json.loads((directory / STATE_FILE).read_text(encoding="utf-8"))
        wrong = [k for k, kind in STATE_KEYS.items() if not isinstance(state.get(k), kind)]
    except (ValueError, UnicodeDecodeError, AttributeError):
        return f"{STATE_FILE} is not valid JSON"
    if wrong:
        return f"{STATE_FILE} lacks or mistypes {', '.join(wrong)}"
    if state["step"] != step_of(directory):
        return f"{STATE_FILE} says step {state['step']}, the directory step {step_of(directory)}"
    return None


class CheckpointWriteError(GrpoSdkError):
    """A checkpoint could not be written (disk full, permissions); the previous one stays the latest."""


class NoUsableCheckpointError(GrpoSdkError):
    """Every checkpoint of the run failed verification. Exit code 1."""


class CheckpointManager:
    """Writes, lists, verifies, ranks and prunes the checkpoints of one run."""

    def __init__(self, config: CheckpointingConfig, run_dir: Path):
        self.config = config
        self.directory = Path(config.checkpoint_dir) if config.checkpoint_dir else Path(run_dir) / "checkpoints"

    def checkpoints(self) -> list[Path]:
        """Checkpoint directories (complete by construction, not yet verified), oldest first."""
        if not self.directory.is_dir():
            return []
        found = [p for p in self.directory.iterdir() if p.is_dir() and p.name.startswith("step_")
                 and p.name[5:].isdigit()]
        return sorted(found, key=step_of)

    def latest(self) -> Path | None:
        found = self.checkpoints()
        return found[-1] if found else None

    def latest_verified(self, warn: Any = print) -> Path | None:
        """The newest checkpoint that verifies; each newer one that does not is reported through ``warn``.

        Raises ``NoUsableCheckpointError`` when there are checkpoints but none verifies.
        """
        failures = []
        for path in reversed(self.checkpoints()):
            problem = verify(path)
            if problem is None:
                for bad, why in failures:
                    warn(f"grpo-sdk: warning: checkpoint {bad} is not usable ({why}); resuming from {path}")
                return path
            failures.append((path, problem))
        if failures:
            listing = "; ".join(f"{p}: {why}" for p, why in failures)
            raise NoUsableCheckpointError(
                f"no checkpoint of this run verifies, so it cannot resume: {listing}. Restore a copy of a "
                f"checkpoint, or start over in a new --run-dir.")
        return None

    def remove_partial(self) -> None:
        """Leftovers of a crash: half-written checkpoints, half-deleted ones, unrenamed temporary files."""
        if self.directory.is_dir():
            for path in [*self.directory.glob(".step_*.partial"), *self.directory.glob(".step_*.removing")]:
                shutil.rmtree(path, ignore_errors=True)
            for path in self.directory.glob(".*.tmp"):  # a status file's copy that never got renamed
                path.unlink(missing_ok=True)

    def _remove(self, path: Path) -> None:
        """Delete a checkpoint so that a crash at any point leaves no orphan (renamed out of sight first)."""
        doomed = self.directory / f".{path.name}.removing"
        shutil.rmtree(doomed, ignore_errors=True)
        os.replace(path, doomed)
        _fsync_dir(self.directory)
        shutil.rmtree(doomed, ignore_errors=True)

    def save(self, step: int, write: Any, state: dict[str, Any]) -> Path:
        """``write(directory)`` fills a fresh directory; it becomes ``step_<step>`` once complete."""
        partial = self.directory / f".step_{step}.partial"
        final = self.directory / f"step_{step}"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir()
            write(partial)
            with open(partial / STATE_FILE, "w", encoding="utf-8") as f:
                json.dump(state, f)
            write_manifest(partial)
            fsync_tree(partial)
            if final.exists():  # a resumed run re-reaching a step it had saved before the crash
                self._remove(final)
            os.replace(partial, final)
            _fsync_dir(self.directory)  # the rename itself
            write_json_atomic(self.directory / STATUS_FILE, {
                "last_checkpoint_step": step, "last_successful_ckpt_save_completion": time.time(),
                "path": str(final)})
        except Exception as exc:  # OSError, or a backend's own I/O error (safetensors raises SafetensorError)
            shutil.rmtree(partial, ignore_errors=True)
            previous = self.latest()
            detail = f"{exc.strerror} ({exc.filename or partial})" if isinstance(exc, OSError) else \
                f"{type(exc).__name__}: {exc}"
            raise CheckpointWriteError(
                f"could not write the checkpoint of step {step} to {partial}: {detail}; the latest checkpoint "
                f"is still {previous if previous else 'none'}. Free space or fix the storage, then resume.") from exc
        self.prune()
        return final

    def metric_of(self, path: Path) -> float | None:
        try:
            value = json.loads((path / STATE_FILE).read_text(encoding="utf-8")).get("ranking_metric")
        except (OSError, ValueError, AttributeError):  # a damaged checkpoint ranks last; verify() says why
            return None
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
                self._remove(path)


def ranking_metric(name: str | None, train_metrics: dict[str, float], val_metrics: dict[str, float]) -> float | None:
    """The value of ``train:<key>`` or ``val:<key>`` for this step, if there is one."""
    if name is None:
        return None
    source, _, key = name.partition(":")
    value = (train_metrics if source == "train" else val_metrics).get(key)
    return float(value) if value is not None else None


def chosen_checkpoint(run_dir: Path, *, step: int | None = None, best: bool = False) -> Path:
    """The checkpoint of a run directory that `grpoctl export` and `grpoctl serve` take: the latest by
    default, that of ``step``, or the best by checkpointing.metric_name. ConfigError when there is none."""
    from grpo_sdk.core.errors import ConfigError

    manager = saved_manager(run_dir)
    found = manager.checkpoints()
    if not found:
        raise ConfigError([("RUN_DIR", f"{run_dir} holds no complete checkpoint")])
    if step is not None:
        chosen = next((p for p in found if p.name == f"step_{step}"), None)
        if chosen is None:
            raise ConfigError([("--step", f"no checkpoint of step {step}; have {', '.join(p.name for p in found)}")])
        return chosen
    return manager.best() if best else found[-1]


def export_policy(run_dir: Path, out: Path, *, step: int | None = None, best: bool = False,
                  lora: str = "merged", registry: Any = None) -> Path:
    """Copy a checkpoint's policy (config, safetensors, tokenizer; no optimizer) to ``out``, ready for
    from_pretrained or vLLM; the policy directory it copied. The latest checkpoint by default.

    A LoRA checkpoint (adapters only) becomes, with ``lora="merged"``, the base model with the adapters
    folded in (a plain Hugging Face model directory: the run's policy class merges them, an
    ``ExportsMergedModel``, found in ``registry``, default the installed plugins), or with
    ``lora="adapter"`` peft's adapter directory.
    """
    from grpo_sdk.core.errors import ConfigError

    if lora not in ("merged", "adapter"):
        raise ConfigError([("--lora", f"must be 'merged' or 'adapter', not {lora!r}")])
    chosen = chosen_checkpoint(run_dir, step=step, best=best)
    if out.exists():
        raise ConfigError([("OUT", f"{out} already exists")])
    policy = chosen / "policy"
    is_adapter = (policy / "adapter_config.json").is_file()
    if lora == "adapter" and not is_adapter:
        raise ConfigError([("--lora", f"'adapter': {policy} is not a LoRA checkpoint (the run trained every "
                            "weight); export it without --lora")])
    if is_adapter and lora == "merged":
        exporter = policy_class(run_dir, registry)
        if not isinstance(exporter, ExportsMergedModel):
            raise ConfigError([("--lora", f"'merged': the policy backend that saved {policy} cannot merge its "
                                "adapters (it is no ExportsMergedModel); export with --lora adapter")])
        exporter.export_merged(str(policy), str(out))
    else:
        shutil.copytree(policy, out, ignore=shutil.ignore_patterns("optimizer.*"))
    return policy


def policy_class(run_dir: Path, registry: Any = None) -> Any:
    """The implementation class of the policy backend a run trained with (``policy.backend`` of its
    saved config.resolved.yaml, read without validating the rest; ``hf`` when it names none)."""
    from grpo_sdk.plugins.registry import Registry

    name = (_saved_config(run_dir).get("policy") or {}).get("backend") or "hf"
    return (registry or Registry.discover()).load_impl("policy", name)


def _saved_config(run_dir: Path) -> dict[str, Any]:
    """A run directory's config.resolved.yaml as plain data; empty when there is none."""
    import yaml

    saved = Path(run_dir) / "config.resolved.yaml"
    return (yaml.safe_load(saved.read_text(encoding="utf-8")) or {}) if saved.is_file() else {}


def saved_manager(run_dir: Path) -> CheckpointManager:
    """The checkpoints of a run directory where its saved config.resolved.yaml puts them, read
    without loading (or validating) the rest of that config; the defaults when there is none."""
    raw = _saved_config(run_dir).get("checkpointing") or {}
    fields = {k: raw[k] for k in ("checkpoint_dir", "metric_name", "higher_is_better") if k in raw}
    return CheckpointManager(CheckpointingConfig(**fields), Path(run_dir))
