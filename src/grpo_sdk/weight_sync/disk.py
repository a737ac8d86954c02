"""Disk weight sync: the policy writes its weights as safetensors, generation reloads them.

The slowest transport and the most robust one: it needs nothing but a filesystem both sides see
(on a multi-node Ray cluster, a shared one), works between any two backends whatever their
process layout, and leaves a file that can be inspected when a sync goes wrong.

Each sync writes ``<directory>/weights_v<version>.safetensors`` (through a temporary name and a
rename, so a reader never sees half a file), then every generation replica loads it and reports
the new version in ``GenerationOutput.weight_version``. Generic over runtimes: a policy that is a
``WeightFileWriter`` writes the file itself and a generation backend that is a
``WeightFileLoader`` reads it itself (the Ray runtime's worker groups are both: policy rank 0
writes in its own process, each replica reads in its own); otherwise (in-process) the driver
writes ``policy.named_weights()`` and streams the file into ``generation.update_weights``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from grpo_sdk.plugins import SyncStats, WeightFileLoader, WeightFileWriter
from grpo_sdk.plugins.tensors import read_weights, write_weights
from grpo_sdk.weight_sync.specs import DiskWeightSyncConfig


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
        path = (self.directory / f"weights_v{version}.safetensors").absolute()  # the protocols take absolute paths
        if isinstance(policy, WeightFileWriter):
            num_tensors, num_bytes = policy.save_weights(str(path))
        else:
            num_tensors, num_bytes = write_weights(policy.named_weights(), path,
                                                   metadata={"version": str(version)})
        if isinstance(generation, WeightFileLoader):
            generation.load_weights(str(path), version=version)
        else:
            generation.update_weights(read_weights(path), version=version)
        for old in self.directory.glob("weights_v*.safetensors"):
            if old != path or not self.keep_last:
                old.unlink(missing_ok=True)
        return SyncStats(version=version, num_tensors=num_tensors, num_bytes=num_bytes,
                         seconds=time.perf_counter() - start)
