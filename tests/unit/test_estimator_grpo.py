"""GRPO baseline, std and advantages against NeMo-RL's upstream numbers, plus properties.

The expected values are NeMo-RL's own unit-test cases (the math: docs/algorithms.md).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_sdk.estimators.grpo import GRPOEstimator, baseline_and_std_per_group, grpo_advantages
from grpo_sdk.estimators.specs import GRPOEstimatorConfig

from helpers.estimators import advantages_of, ids, t

S = 1 / math.sqrt(2)


@pytest.mark.parametrize("rewards, groups, valid, baseline, std", [
    ([1, 2, 3, 4, 5, 6], ids(3, 3), None, [2.5, 2, 1.5, 5.5, 5, 4.5], [.707107, 1.414214, .707107] * 2),
    ([2.5, 4.0], ids(1, 1), None, [2.5, 4.0], [0, 0]),
    ([3, 3, 3, 7, 7, 7], ids(3, 3), None, [3, 3, 3, 7, 7, 7], [0] * 6),
    ([1, 2, 4, 5, 6], ids(2, 3), None, [2, 1, 5.5, 5, 4.5], [0, 0, .707107, 1.414214, .707107]),
    ([1, 999, 3, 4, 5, 6], ids(3, 3), [1, 0, 1, 1, 1, 1], [3, 4, 1, 5.5, 5, 4.5], [0, 0, 0, .707107, 1.414214, .707107]),
])
def test_leave_one_out_baseline_and_std_match_upstream(rewards, groups, valid, baseline, std):
    b, s = baseline_and_std_per_group(t(rewards), groups, None if valid is None else t(valid), leave_one_out=True)
    torch.testing.assert_close(b, t(baseline), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s, t(std), atol=1e-5, rtol=1e-5)


def test_empty_batch_gives_empty_outputs():
    b, s = baseline_and_std_per_group(t([]), torch.zeros(0, dtype=torch.long))
    assert b.shape == (0,) and s.shape == (0,)


def test_large_and_tiny_magnitudes_stay_finite():
    b, s = baseline_and_std_per_group(t([1e-8, 2e-8, 3e-8, 1e8, 2e8, 3e8]), ids(3, 3))
    torch.testing.assert_close(b, t([2.5e-8, 2e-8, 1.5e-8, 2.5e8, 2e8, 1.5e8]), rtol=1e-5, atol=0)
    assert torch.isfinite(s).all()


@pytest.mark.parametrize("rewards, loo, plain", [
    ([0, 1], [-1, 1], [-S, S]),
    ([0, 0, 1], [-S, -S, 1.0], [-.5774, -.5774, 1.1547]),
    ([1, 0, 0, 0], [1.0, -.5774, -.5774, -.5774], [1.5, -.5, -.5, -.5]),
    ([0, 1, 0, 1], [-1.1547, 1.1547, -1.1547, 1.1547], [-.8660, .8660, -.8660, .8660]),
    ([1, 1, 1, 1], [0, 0, 0, 0], [0, 0, 0, 0]),
])
def test_grpo_advantage_edge_cases_match_upstream(rewards, loo, plain):
    groups = torch.zeros(len(rewards), dtype=torch.long)
    torch.testing.assert_close(grpo_advantages(t(rewards), groups, leave_one_out=True), t(loo), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(grpo_advantages(t(rewards), groups, leave_one_out=False), t(plain), atol=1e-4, rtol=1e-4)


def test_singleton_group_gets_zero_advantage():
    torch.testing.assert_close(grpo_advantages(t([1, 0, 1]), ids(1, 2)), t([0, -1, 1]))


def test_estimator_expands_over_the_mask_shape():
    est = GRPOEstimator(GRPOEstimatorConfig(use_leave_one_out_baseline=False), context=None)
    adv = advantages_of(est, t([2, 2, 1, 3]), ids(2, 2), torch.ones(4, 5))
    assert adv.shape == (4, 5)
    torch.testing.assert_close(adv[:, 0], t([0, 0, -S, S]), atol=1e-5, rtol=1e-5)
    assert (adv == adv[:, :1]).all()


def test_near_equal_rewards_still_normalise_to_unit_scale():
    adv = grpo_advantages(t([1, 1.01]), ids(2), leave_one_out=False)
    torch.testing.assert_close(adv.abs(), t([S, S]), rtol=1e-3, atol=0)
    assert adv[0] < 0 < adv[1]


def test_duplicate_prompts_with_distinct_group_ids_are_separate_groups():
    adv = grpo_advantages(t([0, 2, 10, 14]), ids(2, 2), normalize_rewards=False, leave_one_out=False)
    torch.testing.assert_close(adv, t([-1, 1, -2, 2]))


def test_dr_grpo_without_normalisation_is_reward_minus_mean():
    adv = grpo_advantages(t([0, 2, 4]), ids(3), normalize_rewards=False, leave_one_out=False)
    torch.testing.assert_close(adv, t([-2, 0, 2]))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.floats(-10, 10, width=32), min_size=1, max_size=6), min_size=1, max_size=5),
       st.booleans(), st.booleans(), st.randoms(use_true_random=False))
def test_permuting_rows_within_a_group_permutes_the_advantages(groups, loo, normalize, rng):
    rewards = t([r for g in groups for r in g])
    group_ids = ids(*[len(g) for g in groups])
    perm = list(range(len(rewards)))
    start = 0
    for g in groups:  # shuffle inside each group only
        block = perm[start:start + len(g)]
        rng.shuffle(block)
        perm[start:start + len(g)] = block
        start += len(g)
    perm = torch.tensor(perm)
    adv = grpo_advantages(rewards, group_ids, leave_one_out=loo, normalize_rewards=normalize)
    adv_perm = grpo_advantages(rewards[perm], group_ids, leave_one_out=loo, normalize_rewards=normalize)
    torch.testing.assert_close(adv_perm, adv[perm], atol=1e-4, rtol=1e-4)


@settings(max_examples=40, deadline=None)
@given(st.floats(-100, 100, width=32), st.integers(1, 8), st.booleans(), st.booleans())
def test_zero_variance_groups_get_zero_advantage(value, size, loo, normalize):
    adv = grpo_advantages(torch.full((size,), value), torch.zeros(size, dtype=torch.long), leave_one_out=loo,
                          normalize_rewards=normalize)
    assert torch.equal(adv, torch.zeros(size))
