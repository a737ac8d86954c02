"""grpo.effort_levels: NeMo-RL's length shaping of low-effort prompts' rewards, on any environment."""

from __future__ import annotations

import pytest
import torch

from helpers import config_problems
from grpo_sdk.algorithms.effort_levels import apply_effort_levels, shape
from grpo_sdk.algorithms.rewards import RolloutRewardChanges
from grpo_sdk.config.schema import EffortLevelsConfig
from grpo_sdk.config.loading import load_config
from grpo_sdk.core.records import Message

ON = EffortLevelsConfig(low_weight=0.5, low_penalty=2.0, low_ub=100, low_string="low-effort")


@pytest.mark.parametrize("reward, length, expected, term", [
    (1.0, 20, 1.4, 0.4),      # short: 0.5 * (1 - 20/100) = 0.4 of the reward on top
    (1.0, 100, 1.0, 0.0),     # at the bound: unchanged
    (1.0, 150, 0.5, -0.25),   # past it: low_penalty * -0.25 whatever the reward
    (0.0, 150, -0.5, -0.25),  # a wrong long answer goes below zero
    (1.0, 0, 1.5, 0.5),       # the term is capped at 1 (here low_weight)
])
def test_the_formula(reward, length, expected, term):
    shaped, got = shape(reward, length, ON)
    assert shaped == pytest.approx(expected) and got == pytest.approx(term)


def test_only_valid_low_effort_rows_change_and_both_kinds_are_reported():
    rewards, metrics = apply_effort_levels([1.0, 1.0, 0.0, 1.0], [True, True, False, True],
                                           ["a low-effort", "b", "low-effort failed", "low-effort c"], [20, 30, 200, 60], ON)
    assert rewards == pytest.approx([1.4, 1.0, 0.0, 1.2])
    assert metrics["effort/mean_length_low"] == 40 and metrics["effort/median_length_low"] == 40
    assert metrics["effort/mean_length_high"] == 30 and metrics["effort/mean_reward_low"] == pytest.approx(1.3)


def _log(prompt: str, answer_tokens: int) -> list[Message]:
    return [Message(role="user", content=prompt, token_ids=(1, 2)),
            Message(role="assistant", content="x", token_ids=tuple(range(answer_tokens)),
                    generation_logprobs=(0.0,) * answer_tokens)]


def test_training_rewards_are_shaped_validation_rewards_are_not(registry):
    cfg = load_config(None, ["grpo.effort_levels.low_weight=0.5", "grpo.effort_levels.low_string=low-effort",
                             "grpo.effort_levels.low_ub=100"], registry)
    changes = RolloutRewardChanges(cfg)
    components = {"reward": torch.tensor([1.0, 1.0])}
    logs = [_log("low-effort be brief", 20), _log("think hard", 20)]
    args = (components, torch.tensor([True, True]), torch.tensor([0, 0]), logs, [{}, {}])
    _, total, metrics = changes(*args)
    assert total.tolist() == pytest.approx([1.4, 1.0]) and "effort/mean_length_reward_low" in metrics
    _, total, metrics = changes(*args, training=False)
    assert total.tolist() == [1.0, 1.0] and not metrics
    off = RolloutRewardChanges(load_config(None, ["grpo.effort_levels.low_string=low-effort"], registry))
    assert off(*args)[1].tolist() == [1.0, 1.0]  # low_weight 0: off


def test_a_zero_bound_is_a_config_error(registry):
    problems = config_problems(registry, "grpo.effort_levels.low_ub=0")
    assert "low_ub must be positive" in problems["grpo.effort_levels.low_ub"]
