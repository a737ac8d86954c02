"""``cluster.*`` and ``weight_sync``: the Ray runtime's workers against the batch, the nodes and the
GPUs, Ray-only keys set for the local runtime, and a transport that needs Ray workers."""

from __future__ import annotations

import math
from typing import Any

from grpo_sdk.config import schema as C
from grpo_sdk.config.checks.components import capabilities_of
from grpo_sdk.core.capabilities import Capability


def check_runtime(cfg: C.MasterConfig, registry: Any = None) -> list[tuple[str, str]]:
    """cluster.*: the Ray runtime's worker counts against the batch and the devices; Ray-only keys
    set for the local runtime. Reads installed metadata only: never imports ray."""
    import importlib.metadata as md

    c, problems = cfg.cluster, []
    rows = cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt
    if c.runtime != "ray":
        for key in ("policy_workers", "generation_workers", "env_workers"):
            if getattr(c, key) > 1:
                problems.append((f"cluster.{key}", f"{getattr(c, key)} workers need cluster.runtime=ray (the local "
                                 "runtime runs one of each in this process)"))
        if c.address:
            problems.append(("cluster.address", "is set, but cluster.runtime is local; set cluster.runtime=ray"))
        if c.num_nodes > 1:
            problems.append(("cluster.num_nodes", f"{c.num_nodes} nodes need cluster.runtime=ray"))
        if c.env_gpus_per_worker > 0:
            problems.append(("cluster.env_gpus_per_worker", "needs cluster.runtime=ray: the local runtime runs the "
                             "environment in this process, on the run's device"))
        return problems
    try:
        md.version("ray")
    except md.PackageNotFoundError:
        problems.append(("cluster.runtime", "ray is not installed: pip install 'grpo-sdk[ray]'"))
    n, m = c.policy_workers, c.generation_workers
    if rows % n:
        problems.append(("cluster.policy_workers", f"{n} ranks must divide the rollout batch "
                         f"(grpo.num_prompts_per_step x grpo.num_generations_per_prompt = {rows}): each rank "
                         "trains an equal share"))
    global_rows = cfg.policy.train_global_batch_size
    if global_rows is not None and global_rows > 0 and global_rows % n:
        problems.append(("policy.train_global_batch_size", f"{global_rows} must be divisible by "
                         f"cluster.policy_workers ({n}): each rank trains an equal share of every optimizer step"))
    if m > rows:
        problems.append(("cluster.generation_workers", f"{m} replicas for a rollout batch of {rows} rows would leave "
                         "some idle; use at most as many replicas as rows"))
    colocated = cfg.policy.generation.colocated.enabled
    if c.num_nodes > 1 and not c.address:
        problems.append(("cluster.num_nodes", f"{c.num_nodes} nodes need an existing cluster (cluster.address); "
                         "a local Ray cluster has one node"))
    bundles = max(n, m) if colocated else n + m
    if c.num_nodes > bundles:  # each node takes a contiguous block of the bundles (grpo_sdk.runtime.nodes)
        how = ("colocated: max(policy_workers, generation_workers)" if colocated
               else "non-colocated: policy_workers + generation_workers")
        problems.append(("cluster.num_nodes", f"{c.num_nodes} nodes, but the run has {bundles} worker bundle(s) to "
                         f"spread over them ({how}), so some node would stay empty; raise cluster.policy_workers or "
                         "cluster.generation_workers, or lower cluster.num_nodes"))
    env_gpus = env_gpus_needed(c.env_workers, c.env_gpus_per_worker)
    if c.gpus_per_node > 0:
        gpus = c.num_nodes * c.gpus_per_node
        needed = (max(n, m) if colocated else n + m) + env_gpus
        if needed > gpus:
            how = ("colocated: max(policy_workers, generation_workers)" if colocated
                   else "non-colocated: policy_workers + generation_workers, one GPU each")
            if env_gpus:
                how += f", + {env_gpus} for env_workers x env_gpus_per_worker"
            problems.append(("cluster.gpus_per_node", f"{gpus} GPUs (num_nodes x gpus_per_node) are too few: this run "
                             f"needs {needed} ({how})"))
        if c.device == "cpu":
            problems.append(("cluster.device",
                             "is cpu, but cluster.gpus_per_node > 0 reserves GPUs no worker would use"))
    elif c.device == "cuda":
        problems.append(("cluster.gpus_per_node", "is 0, but cluster.device=cuda: Ray workers get GPUs only "
                         "through their bundles; set cluster.gpus_per_node"))
    if env_gpus and c.device == "cpu":
        problems.append(("cluster.env_gpus_per_worker", "is set, but cluster.device=cpu: no worker would use the GPUs"))
    elif env_gpus and c.gpus_per_node == 0:
        problems.append(("cluster.env_gpus_per_worker", f"asks for {env_gpus} GPU(s), but cluster.gpus_per_node is 0 "
                         "(the run's GPU budget); set cluster.gpus_per_node to count the environment's GPUs too"))
    return problems


def env_gpus_needed(workers: int, per_worker: float) -> int:
    """Whole GPUs that ``workers`` environment actors of ``per_worker`` GPUs each occupy: Ray puts a
    fraction on one GPU, so floor(1 / fraction) actors share each."""
    if per_worker <= 0:
        return 0
    if per_worker > 1:
        return workers * math.ceil(per_worker)
    return math.ceil(workers / math.floor(1 / per_worker + 1e-9))


def check_weight_sync(cfg: C.MasterConfig, registry: Any = None) -> list[tuple[str, str]]:
    """A transport that declares ``ray_workers`` (it runs code in the Ray workers) needs
    cluster.runtime=ray, except the built-in ``collective`` with a generation engine that receives
    the broadcast itself (``receives_broadcast``: an inference server's weight-update group), which
    the driver serves as rank 0 in one process. What else a transport needs it checks itself
    (``ComponentSpec.check``)."""
    name = cfg.weight_sync.backend
    engine_receives = (name == "collective" and Capability.RECEIVES_BROADCAST in
                       capabilities_of(registry, "generation", cfg.policy.generation.backend))
    if (Capability.RAY_WORKERS in capabilities_of(registry, "weight_sync", name) and cfg.cluster.runtime != "ray"
            and not engine_receives):
        return [("weight_sync.backend", f"{name!r} moves weights between Ray workers: it needs "
                 "cluster.runtime=ray. In one process use weight_sync.backend=inprocess (or disk)")]
    return []
