"""Reverse a digit string: the built-in verifiable task.

The prompt is the digits followed by ``>`` (``"12345>"``); the answer is the digits reversed
(``"54321"``). The reward is the fraction of positions that match, over the longer of answer
and target, so a short, long or garbled answer earns partial credit and only the exact answer
earns 1. A random policy scores about 1/25 per position.

With ``format_weight`` w > 0 the reward has two named components, so a multi-reward estimator
(``gdpo``) can weigh them: ``correct_digits = (1 - w) * fraction of correct positions`` and
``format = w * (the answer is exactly num_digits digits)``. Their sum stays in [0, 1] and is 1
only for the exact answer, so validation's ``pass_k`` (reward >= 1) still counts exact answers.
With w = 0 (the default) only ``correct_digits`` is reported: the plain fraction.
"""

from __future__ import annotations

import random
from typing import Any, Sequence

from grpo_sdk.plugins import EnvironmentReturn, MessageLog
from grpo_sdk.environments.specs import ReverseDigitsConfig


DIGITS = frozenset("0123456789")


def correct_positions(answer: Sequence[Any], target: Sequence[Any]) -> float:
    """Matching positions over the longer length: characters here, token ids in the calculator's process reward."""
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
        w = self.config.format_weight
        correct, formatted, exact = [], [], 0
        for log, meta in zip(message_logs, metadata):
            answer = log[-1].content
            target = meta["target"]
            correct.append((1.0 - w) * correct_positions(answer, target))
            formatted.append(len(answer) == len(target) and set(answer) <= DIGITS)
            exact += answer == target
        n = max(1, len(correct))
        rewards = {"correct_digits": correct}
        if w > 0:
            rewards["format"] = [w * f for f in formatted]
        return EnvironmentReturn(rewards=rewards, metrics={"exact_match": exact / n,
                                                           "format_fraction": sum(formatted) / n})
