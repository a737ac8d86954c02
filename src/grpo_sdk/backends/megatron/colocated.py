"""Colocated megatron generation: which runs share the megatron policy's model, and how the generation
finds it (light: no torch here; the config checks import it).

A megatron generation shares the policy's ``GPTModel`` (no second copy, no weight conversion on
refit) only when both live in one process: ``cluster.runtime=local`` with
``policy.generation.colocated.enabled``. The policy is built first and publishes itself with
``publish_policy``; the generation, built next with the same ``RunContext``, finds it with
``published_policy`` (``grpo_sdk.plugins.toolkit``'s registry, which the hf backends use too).
On Ray the policy and the generation are separate actors, so each generation replica
holds its own model and takes the policy's weights in Hugging Face names (NeMo-RL instead runs
colocated generation inside the policy workers: not built here).
"""

from __future__ import annotations

from typing import Any

from grpo_sdk.plugins.toolkit import forget_policy, publish_policy, published_policy

__all__ = ["forget_policy", "publish_policy", "published_policy", "shares_policy_model"]


def shares_policy_model(config: Any) -> bool:
    """Whether a megatron generation of this run generates on the megatron policy's own model."""
    return (config.policy.backend == "megatron" and bool(config.policy.generation.colocated.enabled)
            and config.cluster.runtime == "local")
