"""Misbehaving environments for the fault campaign, registered in-process by ``-p fault_envs``.
Each is the built-in reverse_digits task with one fault in ``step``. Test fixtures, not grpo-sdk."""

from __future__ import annotations

import re
import time

from grpo_sdk.environments.reverse_digits import ReverseDigitsEnvironment
from grpo_sdk.plugins import ComponentSpec, hookimpl


class Stuck(ReverseDigitsEnvironment):
    """Hangs (in Python) on every batch holding the first prompt it ever saw."""

    doomed: str | None = None

    def step(self, message_logs, metadata):
        Stuck.doomed = Stuck.doomed or message_logs[0][0].content
        if any(log[0].content == Stuck.doomed for log in message_logs):
            time.sleep(3600)
        return super().step(message_logs, metadata)


class RegexHang(ReverseDigitsEnvironment):
    """Hangs inside C: catastrophic regex backtracking, which no signal handler can interrupt."""

    def step(self, message_logs, metadata):
        re.match(r"(a+)+$", "a" * 64 + "b")
        return super().step(message_logs, metadata)


class NoneReward(ReverseDigitsEnvironment):
    def step(self, message_logs, metadata):
        ret = super().step(message_logs, metadata)
        ret.rewards["correct_digits"][0] = None
        return ret


class TextReward(ReverseDigitsEnvironment):
    def step(self, message_logs, metadata):
        ret = super().step(message_logs, metadata)
        ret.rewards["correct_digits"][0] = "high"
        return ret


class TextMetric(ReverseDigitsEnvironment):
    def step(self, message_logs, metadata):
        ret = super().step(message_logs, metadata)
        ret.metrics["quality"] = "high"
        return ret


class AlwaysFails(ReverseDigitsEnvironment):
    def step(self, message_logs, metadata):
        raise RuntimeError("the grader is down")


class MostlyFails(ReverseDigitsEnvironment):
    """Fails on 3 samples in 4 (by prompt), so no batch fails entirely."""

    def step(self, message_logs, metadata):
        if len(message_logs) > 1 or sum(map(ord, message_logs[0][0].content)) % 4:
            raise RuntimeError("flaky grader")
        return super().step(message_logs, metadata)


FAULTY = {"stuck": Stuck, "regex_hang": RegexHang, "none_reward": NoneReward, "text_reward": TextReward,
          "text_metric": TextMetric,
          "always_fails": AlwaysFails, "mostly_fails": MostlyFails}


@hookimpl
def grpo_components():
    return [ComponentSpec(name=name, kind="environment", impl=f"fault_envs:{cls.__name__}",
                          config="grpo_sdk.environments.specs:ReverseDigitsConfig", capabilities={"generates_prompts"},
                          summary="fault-campaign fixture") for name, cls in FAULTY.items()]
