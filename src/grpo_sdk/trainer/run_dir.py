"""The run directory as a resource: one run at a time, atomic files, storage checked up front.

* ``RunLock``: an exclusive ``flock`` on ``<run dir>/.lock``. The kernel drops it when the process
  dies, however it dies, so a SIGKILLed run never leaves a stale lock; the file holds the
  holder's pid only so the error can name it.
* ``write_text_atomic`` / ``replace_dir``: a file or directory appears complete or not at all
  (temporary name, fsync, rename).
* ``check_storage``: the run and checkpoint directories are directories, writable, and have room
  for one checkpoint, before any model is loaded.

No torch here: the CLI runs these checks before the heavy imports.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

from grpo_sdk.core.errors import ConfigError, ExitCode, GrpoSdkError
from grpo_sdk.core.files import fsync_dir, fsync_tree, write_text_atomic  # noqa: F401 - re-exported

if TYPE_CHECKING:
    from grpo_sdk.config.schema import MasterConfig

LOCK_FILE = ".lock"


class RunLockedError(GrpoSdkError):
    """Another process is running in this run directory. Exit code 2 (a usage error)."""

    exit_code = ExitCode.USAGE


class RunLock:
    """Held for the life of a run; the last ``release`` (or process exit) frees it.

    Re-acquiring a directory this process already holds shares the lock (the CLI takes it before
    the trainer does), since a second ``flock`` on a new descriptor would fail against ourselves.
    """

    _held: dict[Path, list] = {}  # resolved lock path -> [descriptor, holders]

    def __init__(self, directory: Path):
        self.path = Path(directory) / LOCK_FILE
        self._key: Path | None = None

    def acquire(self) -> RunLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        key = self.path.resolve()
        if key in self._held:
            self._held[key][1] += 1
            self._key = key
            return self
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _holder_pid(fd)
            os.close(fd)
            if exc.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            raise RunLockedError(
                f"{self.path.parent} is in use by another grpoctl run (pid {holder}); two runs in one run "
                "directory would interleave metrics.jsonl and checkpoints. Wait for it to end, stop it, or "
                "choose another --run-dir.") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._held[key] = [fd, 1]
        self._key = key
        return self

    def release(self) -> None:
        if self._key is None:
            return
        entry = self._held[self._key]
        entry[1] -= 1
        if entry[1] == 0:
            os.close(entry[0])  # closing the descriptor drops the flock
            del self._held[self._key]
        self._key = None


def _holder_pid(fd: int) -> str:
    """The holder writes its pid right after it takes the lock; give it a moment to do so."""
    for _ in range(50):
        text = os.pread(fd, 32, 0).decode(errors="replace").strip()
        if text:
            return text
        time.sleep(0.02)
    return "unknown"


def replace_dir(staging: Path, final: Path) -> None:
    """Move a fully written ``staging`` directory to ``final`` (which must not exist) atomically."""
    os.replace(staging, final)
    fsync_dir(final.parent)


def check_storage(run_dir: Path, checkpoint_dir: Path | None, needed_bytes: int = 0) -> None:
    """Every storage problem that can be known before training, at once (exit 2)."""
    problems: list[tuple[str, str]] = []
    for key, path in (("--run-dir", run_dir), ("checkpointing.checkpoint_dir", checkpoint_dir)):
        if path is None:
            continue
        problem = _directory_problem(Path(path))
        if problem:
            problems.append((key, problem))
    if not problems and needed_bytes and checkpoint_dir is not None:
        existing = _existing_parent(Path(checkpoint_dir))
        free = shutil.disk_usage(existing).free
        if free < needed_bytes:
            problems.append(("checkpointing.checkpoint_dir",
                             f"{existing} has {free / 2**20:.1f} MiB free, less than one checkpoint of this model "
                             f"needs (about {needed_bytes / 2**20:.1f} MiB); free space or point it elsewhere"))
    if problems:
        raise ConfigError(problems)


def _existing_parent(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _directory_problem(path: Path) -> str | None:
    if path.exists() and not path.is_dir():
        return f"{path} exists and is not a directory"
    parent = _existing_parent(path)
    if not parent.is_dir():
        return f"{parent} is not a directory, so {path} cannot be created"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{parent} is not writable (cannot create or write {path})"
    return None



def initial_model_path(model_name: str, run_dir: str | Path, seed: int, key: str = "policy.model_name") -> str:
    """``builtin:NAME`` -> the model built into ``<run_dir>/initial_model``; a GGUF file, or a built-in
    that is a packaged one, -> its cached model directory (``core.gguf_cache``); anything else unchanged.

    Built aside and then renamed, so a kill mid-write never leaves half a model behind."""
    from grpo_sdk.core.models import resolve_model_source

    if not model_name.startswith("builtin:"):
        return resolve_model_source(model_name, key)
    from grpo_sdk.core.builtin_models import BUILTIN_MODELS

    name = model_name.split(":", 1)[1]
    if name not in BUILTIN_MODELS:
        raise ConfigError([(key, f"unknown built-in model {name!r}; "
                                 f"built-ins: {', '.join(sorted(BUILTIN_MODELS))}")])
    if BUILTIN_MODELS[name].packaged is not None:
        return resolve_model_source(model_name, key)
    from grpo_sdk.recipes.tiny_model import BUILDERS

    out = Path(run_dir) / "initial_model"
    if not out.is_dir():
        staging = Path(run_dir) / ".initial_model.partial"
        shutil.rmtree(staging, ignore_errors=True)
        BUILDERS[name](staging, seed)
        fsync_tree(staging)
        replace_dir(staging, out)
    return str(out)


def checkpoint_bytes(model_path: str, cfg: MasterConfig) -> int:
    """About what one checkpoint of this model takes: weights, plus AdamW's two moments when saved."""
    path = Path(model_path)
    weights = sum(p.stat().st_size for p in path.glob("*.safetensors")) + sum(
        p.stat().st_size for p in path.glob("*.bin")) if path.is_dir() else 0
    return weights * (3 if cfg.checkpointing.save_optimizer else 1)
