"""Effort levels: length shaping of the rewards of prompts marked low-effort (``grpo.effort_levels``).

NeMo-RL shapes NeMo-Gym rewards by "effort level": a prompt whose last user message contains
``low_string`` asks for a short answer, and its reward moves with the response's length::

    length_reward = min(1, low_weight * (1 - length / low_ub))
    reward'       = reward + reward * max(length_reward, 0) + low_penalty * min(length_reward, 0)

A short correct answer earns up to ``low_weight`` times its reward more; past ``low_ub`` tokens
the term turns negative and costs ``low_penalty`` per unit whatever the reward was. Other prompts
are unchanged (their lengths are reported as the "high" effort ones). Here it applies to any
environment; the length is the model's own tokens in the episode (every assistant turn).
"""

from __future__ import annotations

import statistics
from typing import Any, Sequence


def last_user_message(log: Sequence[Any]) -> str:
    """The text of the prompt's last user message (before the model's first turn): what marks it."""
    first = next((i for i, m in enumerate(log) if m.generation_logprobs is not None), len(log))
    return next((m.content for m in reversed(log[:first]) if m.role == "user"), "")


def generated_length(log: Sequence[Any]) -> int:
    return sum(len(m.token_ids) for m in log if m.generation_logprobs is not None)


def shape(reward: float, length: int, config: Any) -> tuple[float, float]:
    """The shaped reward and its length term."""
    length_reward = min(1.0, config.low_weight * (1.0 - length / config.low_ub))
    return reward + reward * max(length_reward, 0.0) + config.low_penalty * min(length_reward, 0.0), length_reward


def apply_effort_levels(rewards: Sequence[float], valid: Sequence[bool], prompts: Sequence[str],
                        lengths: Sequence[int], config: Any) -> tuple[list[float], dict[str, float]]:
    """Shape the valid rows whose prompt contains ``config.low_string``; the rewards and the metrics
    (``effort/mean_length_reward_low``, ``effort/mean_reward_low``, ``effort/{mean,median}_length_{low,high}``)."""
    out = list(rewards)
    terms, shaped, low, high = [], [], [], []
    for i, (reward, ok, prompt, length) in enumerate(zip(rewards, valid, prompts, lengths)):
        if not ok:
            continue
        if config.low_string in prompt:
            out[i], term = shape(reward, length, config)
            terms.append(term)
            shaped.append(out[i])
            low.append(length)
        else:
            high.append(length)
    metrics: dict[str, float] = {}
    if low:
        metrics.update({"effort/mean_length_reward_low": sum(terms) / len(terms),
                        "effort/mean_reward_low": sum(shaped) / len(shaped),
                        "effort/mean_length_low": sum(low) / len(low),
                        "effort/median_length_low": float(statistics.median(low))})
    if high:
        metrics.update({"effort/mean_length_high": sum(high) / len(high),
                        "effort/median_length_high": float(statistics.median(high))})
    return out, metrics
