"""Group statistics against an exact reference, on the rewards where shortcuts break.

The reference is a per-group loop in exact rational arithmetic (``fractions.Fraction`` of the
rewards as stored, so float32 / bfloat16 rounding of the inputs is part of the question, not of
the answer); only the final square root is a float. The estimators must match it to 1e-6
relative. Elements whose exact value is (near) zero get an absolute floor of 1e-12 times the
largest advantage of their group: float64 arithmetic cannot promise fewer than that, and a
relative test on an exact 0 would ask for an exact 0 from every cancellation. Where the math gives
an exact zero spread (a row whose peers are all equal, a group of equal rewards), the tests ask
for exactly 0, in float32, float64 and bfloat16.

The adversarial families are the ones where ``E[x^2] - E[x]^2`` (NeMo-RL's form, and ours until
issue 11) cancels: non-dyadic ties (0.1, 0.2, 0.3, 1/3), one outlier among equals, magnitudes
from 1e-6 to 1e6, group sizes 2 to 64, invalid rows mixed in.
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_sdk.algorithms.rewards import trivial_groups
from grpo_sdk.algorithms.statistics import whiten
from grpo_sdk.estimators.gdpo import GDPOEstimator
from grpo_sdk.estimators.grpo import baseline_and_std_per_group, grpo_advantages
from grpo_sdk.estimators.reinforce_plus_plus import ReinforcePlusPlusEstimator
from grpo_sdk.estimators.rloo import RLOOEstimator
from grpo_sdk.estimators.specs import GDPOEstimatorConfig

from helpers.estimators import advantages_of

TIES = [0.1, 0.2, 0.3, 1 / 3, 0.7, 0.9]
DTYPES = {"float32": torch.float32, "float64": torch.float64}


# --- the exact reference ---------------------------------------------------------------------


def reference(rewards: list[float], group_ids: list[int], valid: list[bool], *, leave_one_out: bool,
              normalize: bool) -> tuple[list[float], list[float], list[float]]:
    """``(baseline, std, advantage)`` per row, group by group, in Fractions.

    The semantics are NeMo-RL's (docs/algorithms.md) with the decisions of
    docs/decisions.md: an invalid row's leave-one-out baseline is the valid sum over n_valid - 1
    (upstream's value), its std 0.
    """
    n = len(rewards)
    baseline, std, advantage = [0.0] * n, [0.0] * n, [0.0] * n
    for g in set(group_ids):
        members = [i for i in range(n) if group_ids[i] == g]
        x = {i: Fraction(rewards[i]) for i in members}
        good = [i for i in members if valid[i]]
        for i in members:
            if len(good) <= 1:
                baseline[i], std[i], advantage[i] = rewards[i], 0.0, 0.0
                continue
            peers = [j for j in good if not (leave_one_out and j == i)]
            k = len(peers)
            if leave_one_out and not valid[i]:
                b = sum(x[j] for j in good) / (len(good) - 1)
                s = 0.0
            else:
                b = sum(x[j] for j in peers) / k
                s = math.sqrt(sum((x[j] - b) ** 2 for j in peers) / (k - 1)) if k > 1 else 0.0
            a = x[i] - b
            baseline[i], std[i] = float(b), s
            advantage[i] = float(a) / (s + 1e-6) if normalize and s > 0 else float(a)
    return baseline, std, advantage


def assert_matches(actual: torch.Tensor, expected: list[float], group_ids: list[int], what: str, rtol: float = 1e-6):
    got = actual.double().tolist()
    info = torch.finfo(actual.dtype)
    subnormal_step = info.tiny * info.eps  # below info.tiny a result is rounded to this absolute step
    for g in set(group_ids):
        rows = [i for i, gi in enumerate(group_ids) if gi == g]
        scale = max(abs(expected[i]) for i in rows)
        for i in rows:
            tol = rtol * abs(expected[i]) + 1e-12 * scale + subnormal_step
            assert abs(got[i] - expected[i]) <= tol, (
                f"{what}[{i}] = {got[i]!r}, exact {expected[i]!r} (group {g}: "
                f"{[got[j] for j in rows]} vs {[expected[j] for j in rows]})")


# --- adversarial batches ---------------------------------------------------------------------


@st.composite
def group_values(draw, size: int) -> list[float]:
    kind = draw(st.sampled_from(["ties", "outlier", "magnitudes", "partial_credit", "uniform"]))
    if kind == "ties":
        return draw(st.lists(st.sampled_from(TIES), min_size=size, max_size=size))
    if kind == "outlier":  # one success among identical failures, the common GRPO group
        common, odd = draw(st.sampled_from(TIES + [0.0, -1.0])), draw(st.sampled_from(TIES + [1.0, 5.0]))
        values = [common] * size
        values[draw(st.integers(0, size - 1))] = odd
        return values
    if kind == "magnitudes":
        scale = 10.0 ** draw(st.integers(-6, 6))
        return [scale * v for v in draw(st.lists(st.sampled_from(TIES + [1.0, 2.0]), min_size=size, max_size=size))]
    if kind == "partial_credit":
        return [k / 5 for k in draw(st.lists(st.integers(0, 5), min_size=size, max_size=size))]
    return draw(st.lists(st.floats(-1e3, 1e3, allow_nan=False, width=32), min_size=size, max_size=size))


@st.composite
def batches(draw, max_groups: int = 4, max_size: int = 64, invalid: bool = True):
    sizes = draw(st.lists(st.integers(2, max_size), min_size=1, max_size=max_groups))
    rewards, groups = [], []
    for g, size in enumerate(sizes):
        rewards += draw(group_values(size))
        groups += [g] * size
    valid = [True] * len(rewards)
    if invalid and draw(st.booleans()):
        valid = draw(st.lists(st.booleans(), min_size=len(rewards), max_size=len(rewards)))
    perm = draw(st.permutations(range(len(rewards))))  # groups need not be contiguous
    return [rewards[i] for i in perm], [groups[i] for i in perm], [valid[i] for i in perm]


def as_tensor(values, dtype):
    return torch.tensor(values, dtype=dtype)


# --- grpo / rloo -----------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(batches(), st.sampled_from(sorted(DTYPES)), st.booleans(), st.booleans())
def test_grpo_matches_the_exact_reference(batch, dtype_name, leave_one_out, normalize):
    rewards_list, group_list, valid_list = batch
    dtype = DTYPES[dtype_name]
    rewards = as_tensor(rewards_list, dtype)
    stored = rewards.double().tolist()  # what the estimator sees, after the input's own rounding
    group_ids = torch.tensor(group_list)
    valid = torch.tensor(valid_list, dtype=dtype)
    b, s, a = reference(stored, group_list, valid_list, leave_one_out=leave_one_out, normalize=normalize)
    baseline, std = baseline_and_std_per_group(rewards, group_ids, valid, leave_one_out=leave_one_out)
    advantages = grpo_advantages(rewards, group_ids, normalize_rewards=normalize, leave_one_out=leave_one_out,
                                 valid_mask=valid)
    assert advantages.dtype == baseline.dtype == std.dtype == dtype
    assert_matches(baseline, b, group_list, "baseline")
    assert_matches(std, s, group_list, "std")
    assert_matches(advantages, a, group_list, "advantage")


@settings(max_examples=60, deadline=None)
@given(batches(invalid=False))
def test_rloo_matches_the_exact_reference(batch):
    rewards_list, group_list, _ = batch
    rewards = as_tensor(rewards_list, torch.float32)
    _, _, a = reference(rewards.double().tolist(), group_list, [True] * len(group_list), leave_one_out=True,
                        normalize=False)
    out = advantages_of(RLOOEstimator(None, None), rewards, torch.tensor(group_list), torch.ones(len(a), 2))
    assert_matches(out[:, 0], a, group_list, "rloo")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("common, odd", [(0.1, 0.9), (0.9, 0.1), (1 / 3, 1.0), (0.2, 0.6), (1e6 + 0.1, 0.0)])
@pytest.mark.parametrize("size", [2, 3, 4, 16, 64])
def test_a_row_whose_peers_are_identical_keeps_its_raw_advantage(dtype, common, odd, size):
    """The issue-11 case: std exactly 0 for the odd row (its peers are equal), so A = r - c."""
    rewards = torch.full((size,), common, dtype=dtype)
    rewards[-1] = odd
    groups = torch.zeros(size, dtype=torch.long)
    baseline, std = baseline_and_std_per_group(rewards, groups)
    advantages = grpo_advantages(rewards, groups)
    assert std[-1] == 0 and baseline[-1] == rewards[0]
    assert advantages[-1] == (rewards[-1].double() - rewards[0].double()).to(dtype)
    if size >= 3:  # every other row has a spread among its peers, which includes the odd row
        assert (std[:-1] > 0).all()
    # Group-mean baseline (no leave-one-out): identical rewards still give an exactly zero spread.
    same = torch.full((size,), common, dtype=dtype)
    assert (baseline_and_std_per_group(same, groups, leave_one_out=False)[1] == 0).all()
    assert (grpo_advantages(same, groups, leave_one_out=False) == 0).all()


def test_the_issue_example():
    advantages = grpo_advantages(torch.tensor([0.1, 0.1, 0.1, 0.9]), torch.zeros(4, dtype=torch.long))
    assert advantages[3] == torch.tensor(0.9) - torch.tensor(0.1)  # was 795742.75
    assert advantages.abs().max() < 1


# --- gdpo, reinforce++, whitening ------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(batches(max_groups=3, max_size=16, invalid=False), st.sampled_from(TIES))
def test_gdpo_per_component_and_whitening_match_the_exact_reference(batch, shift):
    rewards_list, group_list, _ = batch
    a = as_tensor(rewards_list, torch.float32)
    b = as_tensor([shift] * len(a), torch.float32)
    b[0] = 1.0  # one odd row: component b is "one success among identical failures" in group 0's view
    n = len(a)
    est = GDPOEstimator(GDPOEstimatorConfig(reward_weights=[1.0, 0.5]), None)
    out = advantages_of(est, torch.zeros(n), torch.tensor(group_list), torch.ones(n, 1),
                                 reward_components={"a": a, "b": b})[:, 0]
    ones = [True] * n
    parts = [reference(x.double().tolist(), group_list, ones, leave_one_out=True, normalize=True)[2] for x in (a, b)]
    total = [Fraction(pa) + Fraction(pb) / 2 for pa, pb in zip(*parts)]
    mean = sum(total) / n
    var = sum((x - mean) ** 2 for x in total) / (n - 1)
    expected = [float(x - mean) / math.sqrt(var) if var > 0 else float(x - mean) for x in total]
    assert_matches(out, expected, [0] * n, "gdpo", rtol=1e-5)  # components are float64 floats, not exact


@pytest.mark.parametrize("value", [0.1, 1 / 3, 0.7, 1e6 + 0.1, -2.5])
def test_whitening_a_constant_gives_exactly_zero(value):
    x = torch.full((7, 5), value)
    mask = torch.ones(7, 5)
    mask[2:, 3:] = 0
    assert (whiten(x, mask, unbiased=False, floor=1e-8) == 0).all()
    assert (whiten(x, unbiased=True) == 0).all()


def test_reinforce_plus_plus_zero_spread_whitens_to_exactly_zero():
    """Upstream's count + 1e-8 denominator turns this exact 0 into ~5e-5 at the 1e-8 variance floor."""
    rewards = torch.full((6,), 0.3)
    mask = torch.ones(6, 4)
    mask[:, 2:] = 0
    est = ReinforcePlusPlusEstimator(None, None)
    assert (advantages_of(est, rewards, torch.zeros(6, dtype=torch.long), mask) == 0).all()
    assert (advantages_of(est, rewards, torch.arange(6), mask) == 0).all()


@settings(max_examples=60, deadline=None)
@given(batches(max_groups=3, max_size=16, invalid=False), st.integers(1, 4))
def test_reinforce_plus_plus_matches_the_exact_reference(batch, width):
    rewards_list, group_list, _ = batch
    rewards = as_tensor(rewards_list, torch.float64)
    n = len(rewards)
    mask = (torch.arange(4)[None, :] < torch.arange(n)[:, None] % width + 1).double()
    out = advantages_of(ReinforcePlusPlusEstimator(None, None), rewards, torch.tensor(group_list), mask)
    b, _, _ = reference(rewards.tolist(), group_list, [True] * n, leave_one_out=False, normalize=False)
    a = [Fraction(r) - Fraction(bi) for r, bi in zip(rewards.tolist(), b)]
    weights = mask.sum(-1).tolist()  # a row's value counts once per valid token
    count = sum(weights)
    mean = sum(x * Fraction(w) for x, w in zip(a, weights)) / Fraction(count)
    var = sum((x - mean) ** 2 * Fraction(w) for x, w in zip(a, weights)) / Fraction(count)
    expected = [float(x - mean) / math.sqrt(max(float(var), 1e-8)) for x in a]
    assert_matches(out[:, 0], expected, [0] * n, "reinforce++", rtol=1e-9)


# --- dynamic sampling's triviality -----------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(batches(invalid=False), st.sampled_from([torch.float32, torch.float64, torch.bfloat16]))
def test_triviality_is_exact_equality_of_the_whole_group(batch, dtype):
    rewards_list, group_list, _ = batch
    rewards = as_tensor(rewards_list, dtype)
    stored = rewards.tolist()
    expected = [len({stored[j] for j, g in enumerate(group_list) if g == gi}) == 1 for gi in group_list]
    assert trivial_groups(rewards, torch.tensor(group_list)).tolist() == expected
