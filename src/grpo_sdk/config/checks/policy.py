"""``policy.*`` options a backend must implement: dynamic batching, sequence packing, logprob
chunks, LoRA and bfloat16 optimizer moments, against the selected backends' capabilities."""

from __future__ import annotations

from typing import Any

from grpo_sdk.config import schema as C
from grpo_sdk.config.checks.components import capabilities_of
from grpo_sdk.core.capabilities import Capability


def check_policy_batching(cfg: C.MasterConfig, registry: Any = None) -> list[tuple[str, str]]:
    """``policy.dynamic_batching`` / ``sequence_packing`` / ``logprob_chunk_size``: one of the two
    switches at a time, budgets that hold the longest row, and a policy backend that declares each
    one set (hf does; megatron does not yet)."""
    policy, problems = cfg.policy, []
    dynamic, packing = policy.dynamic_batching, policy.sequence_packing
    if dynamic.enabled and packing.enabled:
        problems.append(("policy.sequence_packing.enabled", "true together with policy.dynamic_batching.enabled: "
                         "choose one (packing already micro-batches by token budget)"))
    longest = policy.max_total_sequence_length
    for block, name in ((dynamic, "dynamic_batching"), (packing, "sequence_packing")):
        if not block.enabled:
            continue
        for field in ("train_mb_tokens", "logprob_mb_tokens"):
            budget = getattr(block, field)
            if budget is not None and budget < longest:
                problems.append((f"policy.{name}.{field}",
                                 f"{budget} is less than policy.max_total_sequence_length ({longest}): a row that "
                                 "long would not fit a micro-batch (rows are never split)"))
    if registry is None:
        return problems
    capabilities = capabilities_of(registry, "policy", policy.backend)
    for on, capability, key in ((dynamic.enabled, Capability.DYNAMIC_BATCHING, "policy.dynamic_batching.enabled"),
                                (packing.enabled, Capability.SEQUENCE_PACKING, "policy.sequence_packing.enabled"),
                                (policy.logprob_chunk_size is not None, Capability.LOGPROB_CHUNKS,
                                 "policy.logprob_chunk_size")):
        if on and capability not in capabilities:
            problems.append((key, f"the {policy.backend!r} policy backend does not implement it (its spec does not "
                             f"declare the {capability.value} capability); unset it or use policy.backend=hf"))
    return problems


def check_lora(cfg: C.MasterConfig, registry: Any = None) -> list[tuple[str, str]]:
    """``policy.lora`` is implemented by the hf policy only; adapter-only weight sync needs a
    generation backend that loads adapters itself (``lora_adapters``: vLLM)."""
    lora = cfg.policy.lora
    if not lora.enabled:
        return []
    problems = []
    if cfg.policy.backend != "hf":
        problems.append(("policy.lora.enabled", f"LoRA is implemented by policy.backend=hf only, not "
                         f"{cfg.policy.backend!r}: set policy.backend=hf or policy.lora.enabled=false"))
    backend = cfg.policy.generation.backend
    if lora.sync == "adapter" and Capability.LORA_ADAPTERS not in capabilities_of(registry, "generation", backend):
        problems.append(("policy.lora.sync", "'adapter' (adapter tensors only) needs a generation backend that "
                         f"loads LoRA adapters itself (declares lora_adapters: vllm), not {backend!r}; use "
                         "'merged', which every backend takes"))
    return problems


def check_optimizer(cfg: C.MasterConfig) -> list[tuple[str, str]]:
    """bfloat16 AdamW moments are the hf policy's own optimizer, over plain (unsharded) tensors."""
    if cfg.policy.optimizer.moments_dtype == "float32":
        return []
    if cfg.policy.backend != "hf":
        return [("policy.optimizer.moments_dtype", f"bfloat16 moments are implemented by policy.backend=hf only, "
                 f"not {cfg.policy.backend!r}: use float32")]
    if cfg.cluster.runtime == "ray" and cfg.cluster.policy_workers > 1:
        return [("policy.optimizer.moments_dtype", f"bfloat16 moments need one policy rank (FSDP2 shards the "
                 f"optimizer state as DTensors), not cluster.policy_workers={cfg.cluster.policy_workers}: use float32")]
    return []
