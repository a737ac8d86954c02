"""Options of the Dynamo backend: ``policy.generation.dynamo`` (NeMo-RL's ``dynamo_cfg`` also works).

The backend is a client of a Dynamo deployment that is already running: one frontend
(``python -m dynamo.frontend``) and one or more ``dynamo.vllm`` workers started with
``--enable-rl`` and ``--weight-transfer-config '{"backend": "nccl"}'``, each with its system port
(``DYN_SYSTEM_PORT``) reachable from the trainer. NeMo-RL (its ``DynamoConfig``,
nemo_rl/models/generation/dynamo/config.py at NVIDIA-NeMo/RL 7ea279a) instead starts a managed
fleet inside Ray (etcd, NATS, workers, frontend); its fleet-building keys (``vllm_cfg`` engine
arguments, ``dynamo_cfg.worker_args`` / ``frontend_args``, ``startup_timeout_s``, ports, router
mode, metrics prefixes) configure processes this backend does not start, so they are not here.
What is kept: ``request_timeout_s`` and ``control_timeout_s`` (same meaning), the engine world
size (``ranks_per_worker``: NeMo-RL's ``tensor_parallel_size x pipeline_parallel_size``), and
NeMo-RL's restrictions: not colocated, collective (NCCL) refit only, no in-flight weight updates.
"""

from __future__ import annotations

from typing import Any

import attrs

from grpo_sdk.plugins import option
from grpo_sdk.plugins.toolkit import MasterConfig, positive


@attrs.frozen(kw_only=True)
class DynamoConfig:
    frontend_url: str | None = option(
        None, "URL of the deployment's OpenAI-compatible frontend, e.g. http://frontend:8000/v1 (a missing /v1 is "
        "added). Generation posts token-id prompts to its /completions route.")
    worker_urls: list[str] = option(
        factory=list, help="System URLs of every dynamo.vllm worker (http://host:DYN_SYSTEM_PORT), in a fixed order: weight "
        "updates, pause and resume go to each of them through its /engine/... routes. Every worker serving the "
        "model must be listed, or it keeps the old weights.")
    model_name: str | None = option(None, "The model name the frontend serves (the workers' --served-model-name); "
                                    "null uses policy.model_name.")
    ranks_per_worker: int = option(1, "Ranks of one worker's engine (tensor x pipeline parallel size): worker i "
                                   "takes the weight-update group's ranks from rank_offset + i x ranks_per_worker.",
                                   validator=positive)
    request_timeout_s: float = option(600.0, "Deadline of one completion request (a clear error, never a hang).",
                                      validator=positive)
    control_timeout_s: float = option(600.0, "Deadline of one worker route call (group init, a weight-update step, "
                                      "pause, resume), including the broadcast it waits for.", validator=positive)
    max_concurrent_requests: int = option(64, "Completion requests in flight at once (one per prompt row; the "
                                          "frontend batches them across workers).", validator=positive)
    weight_transfer_backend: str = option(
        "nccl", "The transfer backend the workers were started with (--weight-transfer-config backend); the "
        "collective transport must use the same one. Only the stand-in server accepts gloo.")
    check_weight_version: bool = option(
        True, "After each update, ask every worker's /engine/get_weight_version and fail unless it reports the new "
        "version. Set false for a Dynamo release whose vLLM handler lacks that route.")


def check_options(config: MasterConfig, options: DynamoConfig, registry: Any) -> list[tuple[str, str]]:
    """NeMo-RL's managed-Dynamo boundary, for a client of an existing deployment: where it is, that
    it is not colocated, that weights arrive by the collective transport (the workers' only refit
    path used here), and that in-flight updates are refused."""
    prefix = "policy.generation.dynamo"
    problems = []
    if not options.frontend_url:
        problems.append((f"{prefix}.frontend_url", "is required: the URL of the Dynamo frontend, e.g. "
                         "http://frontend:8000/v1 (this backend does not start a deployment)"))
    if not options.worker_urls:
        problems.append((f"{prefix}.worker_urls", "is required: the system URL (http://host:DYN_SYSTEM_PORT) of every "
                         "dynamo.vllm worker, which receive the weight updates"))
    for key, url in [("frontend_url", options.frontend_url), *[("worker_urls", u) for u in options.worker_urls]]:
        if url and not url.startswith(("http://", "https://")):
            problems.append((f"{prefix}.{key}", f"{url!r} is not an http(s) URL"))
    if len(set(u.rstrip("/") for u in options.worker_urls)) != len(options.worker_urls):
        problems.append((f"{prefix}.worker_urls", "lists a worker twice; each would join the weight-update group twice"))
    if config.policy.generation.colocated.enabled:
        problems.append(("policy.generation.colocated.enabled", "must be false with the dynamo backend: the deployment "
                         "runs on its own GPUs, outside this run (NeMo-RL refuses colocated Dynamo too)"))
    if config.weight_sync.backend != "collective":
        problems.append(("weight_sync.backend", f"must be collective with the dynamo backend (got "
                         f"{config.weight_sync.backend!r}): the workers receive weights only by a broadcast into their "
                         "engine (init_weights_update_group + update_weights_from_distributed); their "
                         "update_weights_from_tensor route is not implemented in Dynamo's vLLM handler, and the disk "
                         "route is not built here"))
    if options.weight_transfer_backend not in ("nccl", "gloo"):
        problems.append((f"{prefix}.weight_transfer_backend", "must be nccl (a real worker) or gloo (the stand-in)"))
    if config.cluster.runtime == "ray" and config.cluster.generation_workers != 1:
        problems.append(("cluster.generation_workers", "must be 1 with the dynamo backend: one client drives the whole "
                         "deployment (the frontend spreads requests over its workers); several replicas would each "
                         "join every worker to the weight-update group"))
    async_grpo = config.grpo.async_grpo
    if async_grpo.enabled and async_grpo.in_flight_weight_updates:
        problems.append(("grpo.async_grpo.in_flight_weight_updates", "must be false with the dynamo backend: Dynamo's "
                         "layerwise weight reload is not safe while requests run, so generation is drained before each "
                         "update (NeMo-RL refuses it the same way)"))
    return problems
