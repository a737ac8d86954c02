"""Files that appear complete or not at all: a temporary name, fsync, then a rename.

The run directory (``trainer.run_dir``), the checkpoints and the ``jsonl`` logger write through
these, and plugins get them as ``grpo_sdk.plugins.toolkit.write_text_atomic``.
"""

from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Make a rename (or a new file) in ``path`` durable: fsync the directory itself."""
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
        fsync_dir(Path(root))


def write_text_atomic(path: Path, text: str) -> None:
    """``path`` holds either its old content or all of ``text``, never a part."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
