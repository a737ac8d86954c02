"""The reward pipeline against NeMo-RL's upstream numbers (the cases of its unit tests; the math: docs/algorithms.md)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from grpo_sdk.algorithms.rewards import (
    clip_advantages,
    mask_by_seq_logprob_error,
    scale_rewards,
    seq_logprob_errors,
    shape_rewards,
    trivial_groups,
)
from grpo_sdk.config.schema import RewardScalingConfig, RewardShapingConfig


def t(values):
    return torch.tensor(values, dtype=torch.float32)


@pytest.mark.parametrize("rewards, source, target, expected", [
    ([1, .5, .8], (0, 1), (0, .7), [.7, .35, .56]),
    ([1, 0, 0, 1, 0], (0, 1), (-1, 1), [1, -1, -1, 1, -1]),
    ([-2.8, -.25, 1.5, .5, 2, 2.5], (-2, 2), (-1, 1), [-1, -.125, .75, .25, 1, 1]),
])
def test_reward_scaling_matches_upstream(rewards, source, target, expected):
    cfg = RewardScalingConfig(enabled=True, source_min=source[0], source_max=source[1], target_min=target[0],
                              target_max=target[1])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = scale_rewards(t(rewards), cfg)
    torch.testing.assert_close(out, t(expected))
    clamped = any(r < source[0] or r > source[1] for r in rewards)
    assert len(caught) == int(clamped)  # out-of-range rewards are counted in a warning


def test_disabled_scaling_and_shaping_return_the_same_tensor():
    rewards = t([1, 2])
    assert scale_rewards(rewards, RewardScalingConfig()) is rewards
    assert shape_rewards(rewards, torch.tensor([1, 2]), torch.tensor([False, True]), RewardShapingConfig(), 10) is rewards


def dapo(penalty, max_len=25, buffer=5):
    return RewardShapingConfig(enabled=True, overlong_buffer_length=buffer, overlong_buffer_penalty=penalty,
                               max_response_length=max_len)


@pytest.mark.parametrize("rewards, lengths, penalty, expected", [
    ([1, 1, 1], [10, 15, 18], 1.0, [1, 1, 1]),
    ([1, .8, .6, .4], [10, 22, 25, 30], 0.5, [1.0, .6, .1, -.6]),
    ([0, 0, 0, 0], [20, 21, 23, 25], 1.0, [0, -.2, -.6, -1.0]),
])
def test_dapo_overlong_penalty_matches_upstream(rewards, lengths, penalty, expected):
    out = shape_rewards(t(rewards), torch.tensor(lengths), torch.zeros(len(rewards), dtype=torch.bool), dapo(penalty), 99)
    torch.testing.assert_close(out, t(expected))


def test_dapo_max_response_length_defaults_to_max_new_tokens():
    cfg = RewardShapingConfig(enabled=True, overlong_buffer_length=5, overlong_buffer_penalty=1.0)
    out = shape_rewards(t([0, 0]), torch.tensor([20, 25]), torch.zeros(2, dtype=torch.bool), cfg, max_new_tokens=25)
    torch.testing.assert_close(out, t([0, -1.0]))


@pytest.mark.parametrize("coef, expected", [(0.5, [1.0, .4, .6, .2]), (0.0, [1.0, 0, .6, 0]), (1.0, [1, .8, .6, .4])])
def test_stop_properly_penalty_matches_upstream_and_overrides_dapo(coef, expected):
    cfg = RewardShapingConfig(enabled=True, stop_properly_penalty_coef=coef, overlong_buffer_length=1,
                              overlong_buffer_penalty=100.0, max_response_length=1)
    out = shape_rewards(t([1, .8, .6, .4]), torch.tensor([50] * 4), torch.tensor([False, True, False, True]), cfg, 99)
    torch.testing.assert_close(out, t(expected))


def test_trivial_groups_use_exact_equality():
    rewards = t([1, 0, 0, 0, 1, 1, 1, 1, 0.5, 0.5, 0.5 + 1e-7, 0.5])
    groups = torch.arange(3).repeat_interleave(4)
    assert trivial_groups(rewards, groups).tolist() == [False] * 4 + [True] * 4 + [False] * 4
    # group ids need not be contiguous or sorted
    assert trivial_groups(t([2, 3, 2, 2]), torch.tensor([7, 9, 7, 9])).tolist() == [True, False, True, False]


def aligned(rows):
    """[B, T] next-token tensors -> input-aligned [B, T+1] (column 0 is the first prompt token)."""
    rows = torch.as_tensor(rows, dtype=torch.float32)
    return torch.nn.functional.pad(rows, (1, 0))


def test_seq_logprob_errors_match_upstream():
    ln2 = math.log(2)
    gen = aligned([[ln2, ln2, math.nan], [100] * 3, [0] * 3])
    errors, valid = seq_logprob_errors(torch.zeros(3, 4), gen, aligned([[1, 1, 0], [1, 1, 1], [0, 0, 0]]), t([1, 0, 1]))
    torch.testing.assert_close(errors, t([2, 0, 0]))
    assert valid.tolist() == [True, False, False] and not errors.requires_grad


def test_seq_logprob_error_masking_matches_upstream():
    gen = aligned([[math.log(2)] * 2, [math.log(4)] * 2, [math.log(16)] * 2])
    token_mask = aligned([[1, 1], [1, 1], [0, 0]])  # row 2 fully masked: error 0, kept, not in the stats
    sample_mask = t([1, 1, 1])
    errors, valid = seq_logprob_errors(torch.zeros(3, 3), gen, token_mask, sample_mask)
    new_mask, metrics = mask_by_seq_logprob_error(errors, valid, sample_mask, t([0, 1, 0]), threshold=3.0)
    assert new_mask.tolist() == [1, 0, 1]
    assert metrics == pytest.approx({
        "max_seq_mult_prob_error": 4, "mean_seq_mult_prob_error": 3, "min_seq_mult_prob_error": 2,
        "num_masked_seqs_by_logprob_error": 1, "masked_correct_pct": 1.0,
        "max_seq_mult_prob_error_after_mask": 2, "mean_seq_mult_prob_error_after_mask": 2,
        "min_seq_mult_prob_error_after_mask": 2})


def test_seq_logprob_error_threshold_boundary_and_none():
    gen = aligned([[0.4]])
    errors, valid = seq_logprob_errors(torch.zeros(1, 2), gen, aligned([[1]]), t([1]))
    kept, _ = mask_by_seq_logprob_error(errors, valid, t([1]), t([0]), threshold=1.5)  # exp(0.4) <= 1.5
    assert kept.tolist() == [1.0]
    same, metrics = mask_by_seq_logprob_error(errors, valid, t([1]), t([0]), threshold=None)
    assert same.tolist() == [1.0] and metrics["num_masked_seqs_by_logprob_error"] == 0  # upstream logs 0
    assert metrics["mean_seq_mult_prob_error_after_mask"] == metrics["mean_seq_mult_prob_error"]


@pytest.mark.parametrize("prev, gen", [([0.0, -1.0], [0.0, math.nan]), ([0.0, -math.inf], [0.0, -math.inf])])
def test_a_nan_error_at_a_valid_token_is_masked(prev, gen):
    """NaN > threshold is False: the row must still leave the loss (as upstream and the in-loss filter do)."""
    token_mask = t([[0, 1]])
    errors, valid = seq_logprob_errors(t([prev]), t([gen]), token_mask, t([1]))
    kept, metrics = mask_by_seq_logprob_error(errors, valid, t([1]), t([1]), threshold=1.5)
    assert kept.tolist() == [0.0] and metrics["num_masked_seqs_by_logprob_error"] == 1
    assert metrics["masked_correct_pct"] == 1.0 and metrics["max_seq_mult_prob_error_after_mask"] == 0.0


def test_masked_correct_pct_is_an_exact_fraction():
    errors, valid = t([5.0] * 5), torch.ones(5, dtype=torch.bool)
    _, metrics = mask_by_seq_logprob_error(errors, valid, t([1] * 5), t([1, 0, 0, 0, 0]), threshold=2.0)
    assert metrics["masked_correct_pct"] == 0.2  # not 0.20000000298 (float32)


def test_already_masked_rows_stay_masked_and_are_not_counted():
    gen = aligned([[5.0], [5.0], [5.0]])
    errors, valid = seq_logprob_errors(torch.zeros(3, 2), gen, aligned([[1], [1], [1]]), t([1, 0, 1]))
    new_mask, metrics = mask_by_seq_logprob_error(errors, valid, t([1, 0, 1]), t([1, 1, 0]), threshold=2.0)
    assert new_mask.tolist() == [0, 0, 0]
    assert metrics["num_masked_seqs_by_logprob_error"] == 2 and metrics["masked_correct_pct"] == 0.5
    assert metrics["max_seq_mult_prob_error_after_mask"] == 0.0


def test_clip_advantages():
    adv = t([-3, -1, 0, 2, 5])
    torch.testing.assert_close(clip_advantages(adv, -2, 3), t([-2, -1, 0, 2, 3]))
    torch.testing.assert_close(clip_advantages(adv, None, 1), t([-3, -1, 0, 1, 1]))
    assert clip_advantages(adv, None, None) is adv
