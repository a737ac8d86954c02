"""Entry-point targets (and light config classes) of the built-in weight-sync transports."""

from __future__ import annotations

import attrs

from grpo_sdk.core.config import option
from grpo_sdk.plugins import ComponentSpec

INPROCESS = ComponentSpec(
    name="inprocess",
    kind="weight_sync",
    impl="grpo_sdk.weight_sync.inprocess:InProcessWeightSync",
    capabilities={"inprocess"},
    summary="Hands the policy's tensors to the generation backend in the same process.",
)


@attrs.frozen(kw_only=True)
class DiskWeightSyncConfig:
    directory: str | None = option(None, "Where the policy writes weights_v<N>.safetensors; null: "
                                   "<run_dir>/weight_sync. On a multi-node Ray cluster it must be a filesystem "
                                   "every node sees.")
    keep_last: bool = option(False, "Keep the newest weights file after the sync (for inspection); false deletes "
                             "each file once every generation replica has loaded it.")


DISK = ComponentSpec(
    name="disk",
    kind="weight_sync",
    impl="grpo_sdk.weight_sync.disk:DiskWeightSync",
    config="grpo_sdk.weight_sync.specs:DiskWeightSyncConfig",
    capabilities={"disk"},
    summary="The policy writes its weights as safetensors; every generation replica reloads them.",
)
