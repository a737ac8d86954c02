"""Small builders the estimator tests share: reward and group tensors, and the typed call."""

from __future__ import annotations

import torch

from grpo_sdk.plugins.advantage_calls import input_of


def t(values):
    return torch.tensor(values, dtype=torch.float32)


def ids(*sizes):
    """Group ids for consecutive groups of these sizes: ``ids(2, 3)`` -> ``[0, 0, 1, 1, 1]``."""
    return torch.arange(len(sizes)).repeat_interleave(torch.tensor(sizes))


def advantages_of(estimator, rewards, group_ids, mask, **extras):
    """The estimator's advantages for these tensors, through the typed call (``AdvantageInput``)."""
    return estimator.compute_advantages(input_of(rewards, group_ids, mask, **extras))
