"""Weights files: (name, tensor) pairs as one safetensors file, written atomically.

What the ``disk`` transport writes and reads, and what the Ray runtime's worker groups use for
``save_weights`` / ``load_weights``. Plugins get them as ``grpo_sdk.plugins.tensors``.
torch and safetensors are imported inside the functions.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable, Iterator


def write_weights(weights: Iterable[tuple[str, Any]], path: Path, *, metadata: dict[str, str] | None = None
                  ) -> tuple[int, int]:
    """Write (name, tensor) pairs to ``path`` atomically; returns (tensors, bytes).

    Tensors that share memory (tied embeddings) are written once each, as copies: safetensors
    refuses aliased tensors, and the reader needs every name the policy sent.
    """
    from safetensors.torch import save_file

    tensors: dict[str, Any] = {}
    seen: set[int] = set()
    num_bytes = 0
    for name, tensor in weights:
        tensor = tensor.detach()
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        storage = tensor.untyped_storage().data_ptr()
        if storage in seen or not tensor.numel() or not tensor.is_contiguous():
            tensor = tensor.contiguous().clone()
        else:
            seen.add(storage)
        tensors[name] = tensor
        num_bytes += tensor.numel() * tensor.element_size()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        save_file(tensors, str(tmp), metadata=metadata)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return len(tensors), num_bytes


def read_weights(path: Path) -> Iterator[tuple[str, Any]]:
    """The (name, tensor) pairs of a weights file, one tensor in memory at a time."""
    from safetensors import safe_open

    if not path.is_file():
        raise FileNotFoundError(f"weights file {path} does not exist here (pid {os.getpid()}); on a multi-node "
                                "cluster weight_sync.disk.directory must be on a filesystem every node sees")
    with safe_open(str(path), framework="pt", device="cpu") as f:
        for name in f.keys():
            yield name, f.get_tensor(name)
