"""Config-time rules of async GRPO (``grpo.async_grpo``, docs/async.md), checked with the others.

NeMo-RL asserts most of these inside ``async_grpo_train`` (so ``python -O`` drops them), after the
models are loaded, or only warns; here each is a config error naming the key and the fix, all
reported at once (exit 2). The rules apply only with ``grpo.async_grpo.enabled=true``: with it
off the section is inert as a whole, like ``grpo.reward_scaling``, so one config can be run sync
and async by flipping that key alone. What is a generation backend's own business (vLLM's sleep
mode) its own spec checks (``ComponentSpec.check``).
"""

from __future__ import annotations

from typing import Any

from grpo_sdk.config import schema as C
from grpo_sdk.core.capabilities import Capability

PREFIX = "grpo.async_grpo"


def declaring(registry: Any, capability: Capability, kind: str = "generation") -> list[str]:
    """The installed components of ``kind`` that declare ``capability``, by name."""
    if registry is None:
        return []
    return sorted(info.name for info in registry.list(kind)
                  if info.spec is not None and capability in info.spec.capabilities)


def check_async(cfg: C.MasterConfig, registry: Any = None) -> list[tuple[str, str]]:
    """Every problem of an async config: the loss correction, the switches against each other and
    against the generation backend's capabilities, and what cannot overlap training."""
    a, grpo = cfg.grpo.async_grpo, cfg.grpo
    if not a.enabled:
        return []
    problems = []
    if not cfg.loss_fn.use_importance_sampling_correction:
        problems.append(("loss_fn.use_importance_sampling_correction",
                         f"must be true with {PREFIX}.enabled=true: a group may train up to "
                         f"{PREFIX}.max_trajectory_age_steps={a.max_trajectory_age_steps} step(s) after the weights "
                         "that sampled it, and only the importance weight exp(old - generation logprobs) corrects "
                         "the loss for that staleness; set loss_fn.use_importance_sampling_correction=true"))
    if a.in_flight_weight_updates:
        backend = cfg.policy.generation.backend
        info = registry.info("generation", backend) if registry is not None else None
        if info is not None and info.spec is not None \
                and Capability.IN_FLIGHT_WEIGHT_UPDATES not in info.spec.capabilities:
            others = declaring(registry, Capability.IN_FLIGHT_WEIGHT_UPDATES)
            which = f"those that do: {', '.join(others)}" if others else "no installed backend declares it yet"
            problems.append((f"{PREFIX}.in_flight_weight_updates",
                             f"needs a generation backend that declares the in_flight_weight_updates capability; "
                             f"{backend!r} (policy.generation.backend) does not ({which}); set "
                             f"{PREFIX}.in_flight_weight_updates=false (a weight update then waits for the "
                             "generations in flight)"))
        if a.schedule == "deterministic":
            problems.append((f"{PREFIX}.schedule",
                             f"deterministic cannot take in-flight weight updates ({PREFIX}."
                             "in_flight_weight_updates=true): where an update lands inside a generation depends on "
                             f"timing, so no run could be reproduced; set {PREFIX}.schedule=newest, or "
                             f"{PREFIX}.in_flight_weight_updates=false"))
    elif a.recompute_kv_cache_after_weight_updates:
        problems.append((f"{PREFIX}.recompute_kv_cache_after_weight_updates",
                         f"does nothing without {PREFIX}.in_flight_weight_updates=true: only an update that lands "
                         "while a generation is in flight leaves a stale KV cache to recompute; set both or "
                         "neither"))
    if cfg.cluster.runtime == "ray" and cfg.policy.generation.colocated.enabled:
        problems.append(("policy.generation.colocated.enabled",
                         f"must be false with {PREFIX}.enabled=true on cluster.runtime=ray: colocated generation "
                         "offloads the policy around every generation round, so generation could never overlap "
                         "training; set policy.generation.colocated.enabled=false (generation gets its own "
                         "devices, cluster.generation_workers of them)"))
    held = (a.max_trajectory_age_steps + 1) * grpo.num_prompts_per_step * grpo.num_generations_per_prompt
    if held > C.MAX_ROWS:
        problems.append((f"{PREFIX}.max_trajectory_age_steps",
                         f"{a.max_trajectory_age_steps} lets the buffer hold (max_trajectory_age_steps + 1) x "
                         f"grpo.num_prompts_per_step x grpo.num_generations_per_prompt = {held:,} rows, more than "
                         f"the {C.MAX_ROWS:,} one batch may hold"))
    return problems


def async_warnings(cfg: C.MasterConfig) -> list[tuple[str, str]]:
    """Allowed async settings that give up something the user may expect."""
    a = cfg.grpo.async_grpo
    if a.enabled and a.schedule == "deterministic" and not cfg.checkpointing.load_replay_buffer:
        return [("checkpointing.load_replay_buffer",
                 f"is false with {PREFIX}.schedule=deterministic: a resumed run regenerates the buffered groups "
                 "with the checkpoint's weights instead of restoring them, so it is valid but no longer "
                 "bit-identical to an uninterrupted run")]
    return []
