"""Config-time rules of multi-turn episodes and tool calls (docs/multi-turn.md), checked with the others.

NeMo-RL refuses its message-level advantage overrides outside NeMo-Gym because nothing else sets
the flags they act on, and they would silently do nothing; here the same rule follows from the
environment's declared capabilities, so any environment that flags invalid tool calls can use them.
"""

from __future__ import annotations

from typing import Any

from grpo_sdk.config import schema as C
from grpo_sdk.core.capabilities import Capability


def _declares(registry: Any, env_name: str, capability: Capability) -> bool | None:
    """Whether the selected environment declares ``capability``; None when it cannot be known here."""
    info = registry.info("environment", env_name) if registry is not None else None
    if info is None or info.spec is None:
        return None
    return capability in info.spec.capabilities


def check_episodes(cfg: C.MasterConfig, registry: Any = None) -> list[tuple[str, str]]:
    """The advantage override for invalid tool calls needs an environment that flags them."""
    env = cfg.env.name
    # An agent environment's turns are flagged by the rollout endpoint when a request offers tools.
    if cfg.grpo.invalid_tool_call_advantage is not None \
            and _declares(registry, env, Capability.TOOL_CALLS) is False \
            and _declares(registry, env, Capability.RUNS_AGENTS) is False:
        return [("grpo.invalid_tool_call_advantage",
                 f"environment {env!r} does not flag invalid tool calls (it declares neither the tool_calls nor "
                 "the runs_agents capability), so the override would never apply; use a tool environment, or "
                 "set it null")]
    return []


def episode_warnings(cfg: C.MasterConfig, registry: Any = None) -> list[tuple[str, str]]:
    """A multi-turn environment limited to one turn: legal (it may answer at once), rarely meant."""
    env = cfg.env.name
    if cfg.grpo.max_rollout_turns == 1 and _declares(registry, env, Capability.MULTI_TURN):
        return [("grpo.max_rollout_turns", f"is 1, but environment {env!r} is multi-turn: every episode ends "
                 "after its first assistant turn (raise it to let the environment answer)")]
    return []
