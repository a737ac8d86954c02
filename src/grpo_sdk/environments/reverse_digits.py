"""Reverse a digit string: the built-in verifiable task.

The prompt is the digits followed by ``>`` (``"12345>"``); the answer is the digits reversed
(``"54321"``). The reward is the fraction of positions that match, over the longer of answer
and target, so a short, long or garbled answer earns partial credit and only the exact answer
earns 1. A random policy scores about 1/25 per position.
"""

from __future__ import annotations

import random
from typing import Any, Sequence

from grpo_sdk.plugins import EnvironmentReturn, MessageLog
from grpo_sdk.environments.specs import ReverseDigitsConfig


def correct_positions(answer: str, target: str) -> float:
    if not answer and not target:
        return 1.0
    matches = sum(a == b for a, b in zip(answer, target))
    return matches / max(len(answer), len(target))


class ReverseDigitsEnvironment:
    """Example::

        env = ReverseDigitsEnvironment(ReverseDigitsConfig(num_digits=5), context=None)
        prompts = env.sample_prompts(2, random.Random(0))   # [("49…>", {"target": "…94"}), ...]
    """

    def __init__(self, config: ReverseDigitsConfig | None, context: Any):
        self.config = config or ReverseDigitsConfig()

    def sample_prompts(self, num_prompts: int, rng: random.Random) -> list[tuple[str, dict[str, Any]]]:
        prompts = []
        for _ in range(num_prompts):
            digits = "".join(rng.choice("0123456789") for _ in range(self.config.num_digits))
            prompts.append((f"{digits}>", {"target": digits[::-1]}))
        return prompts

    def step(self, message_logs: Sequence[MessageLog], metadata: Sequence[dict[str, Any]]) -> EnvironmentReturn:
        rewards, exact = [], 0
        for log, meta in zip(message_logs, metadata):
            answer = log[-1].content
            target = meta["target"]
            rewards.append(correct_positions(answer, target))
            exact += answer == target
        return EnvironmentReturn(rewards={"correct_digits": rewards},
                                 metrics={"exact_match": exact / max(1, len(rewards))})
