"""Entry-point targets (and light config classes) of the built-in weight-sync transports."""

from __future__ import annotations

from typing import Any, Literal

import attrs

from grpo_sdk.plugins import option
from grpo_sdk.plugins.toolkit import MasterConfig, non_negative, positive
from grpo_sdk.plugins import Capability, ComponentSpec

INPROCESS = ComponentSpec(
    name="inprocess",
    kind="weight_sync",
    impl="grpo_sdk.weight_sync.inprocess:InProcessWeightSync",
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
    summary="The policy writes its weights as safetensors; every generation replica reloads them.",
)


@attrs.frozen(kw_only=True)
class CollectiveWeightSyncConfig:
    bucket_mb: float = option(16.0, "Tensors are packed, in the policy's order, into flat byte buckets of at most this "
                              "many MiB, one broadcast each (a larger tensor goes alone); 0 broadcasts every tensor "
                              "on its own. Policy rank 0 and every generation replica hold at most two buckets at "
                              "once.",
                              validator=non_negative)
    backend: Literal["auto", "gloo", "nccl"] = option(
        "auto", "torch.distributed backend of the broadcast group. auto: nccl when the workers run on CUDA and "
        "generation is not colocated, gloo otherwise (on GPUs, gloo stages each bucket through host memory). "
        "nccl cannot put two ranks on one GPU, so colocated generation on GPUs needs gloo (or cuda_ipc).")
    timeout_s: float | None = option(None, "Deadline of one sync, in seconds; null: cluster.call_timeout_s. A "
                                     "participant that does not finish in time is stopped and the run fails with "
                                     "a WorkerError naming it.", validator=attrs.validators.optional(positive))
    master_address: str | None = option(None, "Local runtime, with a generation engine that receives the broadcast "
                                        "itself (receives_broadcast: SGLang, TensorRT-LLM, Dynamo servers): the "
                                        "address of this machine its workers reach; rank 0's store listens there "
                                        "only. null: 127.0.0.1 (an engine on this machine). On Ray it is always "
                                        "policy rank 0's node address.")


COLLECTIVE = ComponentSpec(
    name="collective",
    kind="weight_sync",
    impl="grpo_sdk.weight_sync.collective:CollectiveWeightSync",
    config="grpo_sdk.weight_sync.specs:CollectiveWeightSyncConfig",
    check="grpo_sdk.weight_sync.specs:check_collective",
    capabilities={"ray_workers"},
    summary="Policy rank 0 broadcasts its weights to every generation replica over a torch.distributed group (Ray; "
            "or to an inference server's own weight-update group, also in one process).",
)


@attrs.frozen(kw_only=True)
class CudaIPCWeightSyncConfig:
    bucket_mb: float = option(512.0, "Size of each of the two GPU buffers every sending policy rank packs its "
                              "weights into (a larger tensor gets a buffer of its own); the generation replica on "
                              "the same GPU copies out of them through CUDA IPC handles.", validator=positive)
    timeout_s: float | None = option(None, "Deadline of one sync, in seconds; null: cluster.call_timeout_s.",
                                     validator=attrs.validators.optional(positive))


CUDA_IPC = ComponentSpec(
    name="cuda_ipc",
    kind="weight_sync",
    impl="grpo_sdk.weight_sync.cuda_ipc:CudaIPCWeightSync",
    config="grpo_sdk.weight_sync.specs:CudaIPCWeightSyncConfig",
    check="grpo_sdk.weight_sync.specs:check_cuda_ipc",
    capabilities={"ray_workers"},
    summary="Ray, GPUs, colocated: each generation replica copies the weights of the policy rank on its GPU "
            "through CUDA IPC handles (no copy through host memory).",
)


def _on_gpus(config: MasterConfig) -> bool:
    return config.cluster.gpus_per_node > 0 and config.cluster.device != "cpu"


def check_collective(config: MasterConfig, options: CollectiveWeightSyncConfig, registry: Any) -> list[tuple[str, str]]:
    """nccl needs GPUs, and cannot put two ranks on one GPU (colocated generation does)."""
    if options.backend != "nccl":
        return []
    if not _on_gpus(config):
        return [("weight_sync.collective.backend", "nccl needs GPUs (cluster.gpus_per_node > 0 and cluster.device "
                 "not cpu); use gloo or auto")]
    if config.policy.generation.colocated.enabled:
        return [("weight_sync.collective.backend", "nccl cannot put two ranks on one GPU, and with colocated "
                 "generation policy rank 0 shares its GPU with generation replica 0; use gloo (auto picks it) or "
                 "weight_sync.backend=cuda_ipc")]
    return []


def check_cuda_ipc(config: MasterConfig, options: CudaIPCWeightSyncConfig, registry: Any) -> list[tuple[str, str]]:
    """CUDA IPC shares GPU memory between processes on one GPU: GPUs, colocated generation with a
    policy rank on every replica's GPU, and a generation backend that declares the cuda_ipc capability."""
    c, missing = config.cluster, []  # cluster.runtime=ray is checked for every transport with ray_workers
    if not _on_gpus(config):
        missing.append("GPUs (cluster.gpus_per_node > 0 and cluster.device not cpu)")
    if not config.policy.generation.colocated.enabled:
        missing.append("policy.generation.colocated.enabled=true (a generation replica shares the GPU of the "
                       "policy rank it copies from)")
    elif c.generation_workers > c.policy_workers:
        missing.append(f"a policy rank on every replica's GPU: cluster.generation_workers ({c.generation_workers}) "
                       f"<= cluster.policy_workers ({c.policy_workers})")
    generation = config.policy.generation.backend
    info = registry.info("generation", generation) if registry is not None else None
    if info is not None and info.spec is not None and Capability.CUDA_IPC not in info.spec.capabilities:
        missing.append(f"a generation backend that declares the cuda_ipc capability ({generation!r} does not)")
    if not missing:
        return []
    return [("weight_sync.backend", f"'cuda_ipc' shares GPU memory between processes on one GPU; it needs "
             f"{'; '.join(missing)}. Otherwise use collective or disk")]
