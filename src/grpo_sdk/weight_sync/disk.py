"""Disk weight sync: the policy writes its weights as safetensors, generation reloads them.

The slowest transport and the most robust one: it needs nothing but a filesystem both sides see
(on a multi-node Ray cluster, a shared one), works between any two backends whatever their
process layout, and leaves a file that can be inspected when a sync goes wrong.

Each sync writes ``<directory>/weights_v<version>.safetensors`` (through a temporary name and a
rename, so a reader never sees half a file), then every generation replica loads it and reports
the new version in ``GenerationOutput.weight_version``. Generic over runtimes: when the policy and
generation objects offer ``save_weights(path)`` / ``load_weights(path, version=)`` (the Ray
runtime's worker groups do: policy rank 0 writes in its own process, each replica reads in its
own), they are used; otherwise (in-process) the driver writes ``policy.named_weights()`` and
streams the file into ``generation.update_weights``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Iterable, Iterator

from grpo_sdk.core.records import SyncStats
from grpo_sdk.weight_sync.specs import DiskWeightSyncConfig


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


class DiskWeightSync:
    """Example::

        sync = DiskWeightSync(DiskWeightSyncConfig(), context)       # <run_dir>/weight_sync
        stats = sync.sync_weights(policy, generation, version=3)    # weights_v3.safetensors
    """

    def __init__(self, config: DiskWeightSyncConfig | None, context: Any):
        config = config or DiskWeightSyncConfig()
        self.directory = Path(config.directory) if config.directory else Path(context.run_dir) / "weight_sync"
        self.keep_last = config.keep_last

    def sync_weights(self, policy: Any, generation: Any, *, version: int) -> SyncStats:
        start = time.perf_counter()
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"weights_v{version}.safetensors"
        if callable(getattr(policy, "save_weights", None)):
            num_tensors, num_bytes = policy.save_weights(str(path))
        else:
            num_tensors, num_bytes = write_weights(policy.named_weights(), path,
                                                   metadata={"version": str(version)})
        if callable(getattr(generation, "load_weights", None)):
            generation.load_weights(str(path), version=version)
        else:
            generation.update_weights(read_weights(path), version=version)
        for old in self.directory.glob("weights_v*.safetensors"):
            if old != path or not self.keep_last:
                old.unlink(missing_ok=True)
        return SyncStats(version=version, num_tensors=num_tensors, num_bytes=num_bytes,
                         seconds=time.perf_counter() - start)
