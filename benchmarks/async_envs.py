"""Environments for benchmarks/async_vs_sync.py, loaded as a hook plugin module (``-p async_envs``,
with benchmarks/ on the path; Ray workers get the module the same way).

* ``slow_reverse_digits``: the built-in ``reverse_digits`` task behind a remote judge or sandbox:
  every scoring call sleeps ``latency_s`` (0.2 s) and then scores exactly as ``reverse_digits``.
  The sleep releases the GIL, as a socket wait would.
* ``longtail_reverse``: reverse a digit string whose length is drawn per prompt from a Pareto
  distribution (shape ``alpha``, from ``min_digits``, capped at ``max_digits``), answered with a stop
  token, so most answers are short and a few are long. Reward: the fraction of correct positions
  over the longer of answer and target (``reverse_digits``' reward), so an answer must also stop at
  the right length. Per scoring call it reports the response lengths' median, p90 and max
  (tokens, the stop token included), so the tail shows in metrics.jsonl (``env/length_p50`` ...).
* ``longtail_repeat``: the same lengths and reward, but the prompt is one digit repeated (``"7777>"``)
  and the answer repeats it as often and stops: a task the tiny model learns within ~100 steps
  (the right digit first, then where to stop), so the reward per sample can be compared where
  reversal does not learn in a feasible budget. With ``min_digits = max_digits`` the length is
  fixed, and with ``latency_s`` it is scenario (b)'s judge on a task that learns.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Sequence
from typing import Any

import attrs

from grpo_sdk.environments.reverse_digits import (
    ReverseDigitsEnvironment,
    correct_positions,
)
from grpo_sdk.environments.specs import ReverseDigitsConfig
from grpo_sdk.plugins import ComponentSpec, EnvironmentReturn, hookimpl, option


@attrs.frozen(kw_only=True)
class SlowReverseDigitsConfig(ReverseDigitsConfig):
    latency_s: float = option(0.2, "Seconds every scoring call sleeps before scoring (a remote judge's latency).",
                              validator=attrs.validators.ge(0.0))


class SlowReverseDigits(ReverseDigitsEnvironment):
    def step(self, message_logs, metadata) -> EnvironmentReturn:
        time.sleep(self.config.latency_s)
        return super().step(message_logs, metadata)


@attrs.frozen(kw_only=True)
class LongTailConfig:
    min_digits: int = option(2, "Shortest digit string (the Pareto scale).", validator=attrs.validators.gt(0))
    max_digits: int = option(40, "Longest digit string (the Pareto tail is capped here).",
                             validator=attrs.validators.gt(0))
    alpha: float = option(1.2, "Pareto shape of the string length: smaller is a heavier tail.",
                          validator=attrs.validators.gt(0.0))
    latency_s: float = option(0.0, "Seconds every scoring call sleeps before scoring (a remote judge's latency).",
                              validator=attrs.validators.ge(0.0))

    def num_reward_components(self) -> int:
        return 1


def pareto_length(rng: random.Random, cfg: LongTailConfig) -> int:
    return min(cfg.max_digits, int(cfg.min_digits / (1.0 - rng.random()) ** (1.0 / cfg.alpha)))


def percentile(values: Sequence[int], q: float) -> float:
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, int(q * len(ordered)))]) if ordered else 0.0


class LongTailReverse:
    def __init__(self, config: LongTailConfig | None, context: Any):
        self.config = config or LongTailConfig()

    def sample_prompts(self, num_prompts: int, rng: random.Random) -> list[tuple[str, dict[str, Any]]]:
        prompts = []
        for _ in range(num_prompts):
            digits = "".join(rng.choice("0123456789") for _ in range(pareto_length(rng, self.config)))
            prompts.append((f"{digits}>", {"target": digits[::-1]}))
        return prompts

    def step(self, message_logs, metadata) -> EnvironmentReturn:
        time.sleep(self.config.latency_s)
        answers = [log[-1].content for log in message_logs]
        rewards = [correct_positions(a, m["target"]) for a, m in zip(answers, metadata)]
        lengths = [len(log[-1].token_ids) or len(log[-1].content) for log in message_logs]  # tokens, stop included
        targets = [len(m["target"]) for m in metadata]
        return EnvironmentReturn(rewards={"correct_digits": rewards}, metrics={
            "exact_match": sum(a == m["target"] for a, m in zip(answers, metadata)) / max(1, len(answers)),
            "length_p50": statistics.median(lengths) if lengths else 0.0, "length_p90": percentile(lengths, 0.9),
            "length_max": float(max(lengths, default=0)), "target_length_max": float(max(targets, default=0))})


class LongTailRepeat(LongTailReverse):
    def sample_prompts(self, num_prompts: int, rng: random.Random) -> list[tuple[str, dict[str, Any]]]:
        prompts = []
        for _ in range(num_prompts):
            digits = rng.choice("0123456789") * pareto_length(rng, self.config)
            prompts.append((f"{digits}>", {"target": digits}))
        return prompts


SPECS = [
    ComponentSpec(name="slow_reverse_digits", kind="environment", impl=f"{__name__}:SlowReverseDigits",
                  config=f"{__name__}:SlowReverseDigitsConfig", capabilities={"generates_prompts"},
                  metrics={"exact_match", "format_fraction"},
                  summary="reverse_digits behind a judge that takes latency_s per scoring call"),
    ComponentSpec(name="longtail_reverse", kind="environment", impl=f"{__name__}:LongTailReverse",
                  config=f"{__name__}:LongTailConfig", capabilities={"generates_prompts"},
                  metrics={"exact_match", "length_p50", "length_p90", "length_max", "target_length_max"},
                  summary="reverse digit strings of Pareto-distributed length (long-tailed responses)"),
    ComponentSpec(name="longtail_repeat", kind="environment", impl=f"{__name__}:LongTailRepeat",
                  config=f"{__name__}:LongTailConfig", capabilities={"generates_prompts"},
                  metrics={"exact_match", "length_p50", "length_p90", "length_max", "target_length_max"},
                  summary="repeat one digit as often as the prompt does, Pareto-distributed lengths"),
]


@hookimpl
def grpo_components():
    return SPECS
