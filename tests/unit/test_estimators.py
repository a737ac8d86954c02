"""The rloo, gdpo, reinforce_plus_plus and opd estimators against NeMo-RL's numbers, plus properties.

Upstream cases are NeMo-RL's own unit-test inputs (the math: docs/algorithms.md); where upstream
only asserts a sign or a shape, the exact value its code gives is pinned too.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_sdk.algorithms.loss import calculate_kl
from grpo_sdk.config.schema import LossConfig
from grpo_sdk.estimators.gdpo import GDPOEstimator
from grpo_sdk.estimators.grpo import GRPOEstimator
from grpo_sdk.estimators.opd import OPDEstimator, pad_teacher_logprobs
from grpo_sdk.estimators.reinforce_plus_plus import ReinforcePlusPlusEstimator
from grpo_sdk.estimators.rloo import RLOOEstimator
from grpo_sdk.estimators.specs import GDPOEstimatorConfig, GRPOEstimatorConfig, ReinforcePlusPlusConfig
from grpo_sdk.plugins.registry import Registry

from helpers.estimators import advantages_of, ids, t

S = 1 / math.sqrt(2)
GAP = "on_policy_distillation/teacher_student_logprob_gap_mean"
ADV_MEAN, ADV_STD = "on_policy_distillation/adv_mean", "on_policy_distillation/adv_std"


def kl_context(beta=0.1, kl_type="k3", **loss):
    loss_fn = LossConfig(use_kl_in_reward=True, reference_policy_kl_penalty=beta, reference_policy_kl_type=kl_type,
                         **loss)
    return SimpleNamespace(config=SimpleNamespace(loss_fn=loss_fn))


def rows(advantages):
    """The per-row value of a broadcast [B, S] advantage, after checking it is constant along S."""
    torch.testing.assert_close(advantages, advantages[:, :1].expand_as(advantages))
    return advantages[:, 0]


# --- registry --------------------------------------------------------------------------------


@pytest.mark.parametrize("name, config", [("rloo", None), ("gdpo", GDPOEstimatorConfig()),
                                          ("reinforce_plus_plus", ReinforcePlusPlusConfig()), ("opd", None)])
def test_entry_points_resolve_to_working_estimators(name, config):
    registry = Registry.discover()
    impl = registry.load_impl("estimator", name)
    config_class = registry.load_config_class("estimator", name)
    assert (config_class is None) == (config is None) and (config is None or isinstance(config, config_class))
    est = impl(config, None)
    mask = torch.ones(4, 3)
    extras = dict(reward_components={"a": t([1, 0, 1, 1]), "b": t([0, 0, 1, 0])}, valid_mask=torch.ones(4, dtype=bool),
                  prev_logprobs=torch.full((4, 3), -1.0), teacher_logprobs=torch.zeros(4, 3))
    advantages = advantages_of(est, t([1, 0, 2, 1]), ids(2, 2), mask, **extras)
    assert advantages.shape == mask.shape and torch.isfinite(advantages).all()


# --- rloo ------------------------------------------------------------------------------------


@pytest.mark.parametrize("rewards, groups, expected", [
    ([0, 1], ids(2), [-1, 1]),
    ([0, 0, 1], ids(3), [-.5, -.5, 1]),
    ([1, 0, 0, 0], ids(4), [1, -1 / 3, -1 / 3, -1 / 3]),
    ([1, 2, 3, 4, 5, 6], ids(3, 3), [-1.5, 0, 1.5, -1.5, 0, 1.5]),
    ([1, 0, 1], ids(1, 2), [0, -1, 1]),  # a singleton group gets 0
    ([3, 3, 3, 7, 7], ids(3, 2), [0] * 5),
])
def test_rloo_is_reward_minus_mean_of_the_others(rewards, groups, expected):
    advantages = advantages_of(RLOOEstimator(None, None), t(rewards), groups, torch.ones(len(rewards), 4))
    torch.testing.assert_close(rows(advantages), t(expected))


def test_rloo_equals_grpo_leave_one_out_unnormalised():
    rewards, groups = torch.randn(12), ids(4, 3, 5)
    valid = torch.tensor([1, 1, 0, 1] + [1] * 8, dtype=torch.bool)
    grpo = GRPOEstimator(GRPOEstimatorConfig(normalize_rewards=False, use_leave_one_out_baseline=True), None)
    torch.testing.assert_close(advantages_of(RLOOEstimator(None, None), rewards, groups, torch.ones(12, 2),
                                                                           valid_mask=valid),
                               advantages_of(grpo, rewards, groups, torch.ones(12, 2), valid_mask=valid))


# --- gdpo ------------------------------------------------------------------------------------

UPSTREAM_COMPONENTS = {"integer": t([1, -1]), "correctness": t([1, 1]), "format": t([1, 0])}
TWO_GROUPS = {"correctness": t([1, 0, 0, 1, 1, 1]), "format": t([1, 1, 0, 0, 1, 0])}


def gdpo(components, groups, mask=None, **config):
    mask = torch.ones(len(groups), 3) if mask is None else mask
    est = GDPOEstimator(GDPOEstimatorConfig(**config), None)
    return advantages_of(est, torch.zeros(len(groups)), groups, mask, reward_components=components)


def test_gdpo_upstream_three_components():
    advantages = gdpo(UPSTREAM_COMPONENTS, ids(2), use_leave_one_out_baseline=False)
    torch.testing.assert_close(rows(advantages), t([S, -S]))


def test_gdpo_is_whitened_weighted_sum_of_per_component_grpo():
    groups, weights = ids(3, 3), [1.0, 0.25]
    expected = sum(w * advantages_of(GRPOEstimator(GRPOEstimatorConfig(), None), TWO_GROUPS[k], groups,
                                                                                     torch.ones(6, 1))[:, 0]
                   for w, k in zip(weights, sorted(TWO_GROUPS)))
    expected = (expected - expected.mean()) / expected.std()
    torch.testing.assert_close(rows(gdpo(TWO_GROUPS, groups, reward_weights=weights)), expected)


def test_gdpo_ignores_rewards_and_component_order():
    a = advantages_of(GDPOEstimator(None, None), t([5, -3, 9, 0, 0, 1]), ids(3, 3), torch.ones(6, 2),
                                                     reward_components=TWO_GROUPS)
    reordered = dict(reversed(list(TWO_GROUPS.items())))
    torch.testing.assert_close(a, gdpo(reordered, ids(3, 3), mask=torch.ones(6, 2)))


def test_gdpo_uniform_weights_cancel_and_uneven_weights_matter():
    base = gdpo(TWO_GROUPS, ids(3, 3))
    torch.testing.assert_close(gdpo(TWO_GROUPS, ids(3, 3), reward_weights=[2.0, 2.0]), base)
    assert not torch.allclose(gdpo(TWO_GROUPS, ids(3, 3), reward_weights=[1.0, 0.25]), base)


def test_gdpo_constant_batch_is_only_centred_and_one_row_gives_zero():
    constant = {"a": t([1, 1, 0, 0]), "b": t([1, 1, 1, 1])}  # every group has zero variance in every component
    torch.testing.assert_close(gdpo(constant, ids(2, 2)), torch.zeros(4, 3))
    torch.testing.assert_close(gdpo({"a": t([1]), "b": t([0])}, ids(1)), torch.zeros(1, 3))  # std of one value: NaN


@pytest.mark.parametrize("components, match", [
    ({"correctness": t([1, 0])}, r"at least 2 named reward components.*\['correctness'\]"),
    ({}, "at least 2"),
])
def test_gdpo_needs_two_components(components, match):
    with pytest.raises(ValueError, match=match):
        gdpo(components, ids(2))


def test_gdpo_missing_components_extra_is_a_clear_error():
    with pytest.raises(ValueError, match="at least 2"):
        advantages_of(GDPOEstimator(None, None), t([1, 0]), ids(2), torch.ones(2, 3))


def test_gdpo_weight_count_must_match_and_names_the_components():
    with pytest.raises(ValueError, match=r"1 entries.*\['correctness', 'format'\]"):
        gdpo(TWO_GROUPS, ids(3, 3), reward_weights=[1.0])


# --- reinforce_plus_plus ---------------------------------------------------------------------


def test_reinforce_plus_plus_upstream_numbers():
    mask = torch.ones(4, 5)
    advantages = advantages_of(ReinforcePlusPlusEstimator(None, None), t([0, 1, 2, 3]), ids(4), mask)
    torch.testing.assert_close(rows(advantages), t([-1.3416, -0.4472, 0.4472, 1.3416]), atol=1e-4, rtol=0)
    assert abs(float((advantages * mask).sum() / mask.sum())) < 1e-6


def upstream_reinforce_plus_plus(rewards, groups, mask, minus_baseline, beta=0.0, kl=None):
    """NeMo-RL's computation written out literally (unguarded divisions, biased variance)."""
    if minus_baseline:
        mean = torch.stack([rewards[groups == g].mean() for g in groups])
        a = rewards - mean
    else:
        a = rewards
    a = a[:, None].expand(mask.shape)
    if kl is not None:
        a = a - beta * kl
    mu = (a * mask).sum() / mask.sum()
    var = ((a - mu).pow(2) * mask).sum() / mask.sum()
    return (a - mu) * var.clamp(min=1e-8).rsqrt()


@pytest.mark.parametrize("minus_baseline", [True, False])
def test_reinforce_plus_plus_matches_upstream_with_partial_mask(minus_baseline):
    rewards, groups = t([0, 1, 1, 5, 2, 2, 7]), ids(3, 1, 3)  # a singleton group: its baseline is itself
    mask = (torch.arange(6)[None, :] < torch.tensor([6, 2, 4, 1, 3, 5, 0])[:, None]).float()  # last row fully masked
    est = ReinforcePlusPlusEstimator(ReinforcePlusPlusConfig(minus_baseline=minus_baseline), None)
    got = advantages_of(est, rewards, groups, mask)
    torch.testing.assert_close(got, upstream_reinforce_plus_plus(rewards, groups, mask, minus_baseline))
    assert got[6].abs().sum() > 0  # masked positions are transformed, not zeroed


@pytest.mark.parametrize("kl_type", ["k1", "k2", "k3"])
def test_reinforce_plus_plus_folds_token_kl_into_the_reward(kl_type):
    torch.manual_seed(0)
    rewards, groups, mask = t([1, 0, 0, 1]), ids(2, 2), torch.ones(4, 6)
    mask[:, :2] = 0  # prompt positions
    prev, ref = torch.randn(4, 6) - 2, torch.randn(4, 6) * 8 - 2  # large gaps: the clamps matter
    est = ReinforcePlusPlusEstimator(None, kl_context(beta=0.2, kl_type=kl_type))
    got = advantages_of(est, rewards, groups, mask, prev_logprobs=prev, reference_logprobs=ref)
    kl = calculate_kl(prev, ref, kl_type, 20.0, 10.0)
    torch.testing.assert_close(got, upstream_reinforce_plus_plus(rewards, groups, mask, True, 0.2, kl))
    assert not torch.allclose(got, advantages_of(est, rewards, groups, mask, prev_logprobs=prev,
                                                          reference_logprobs=prev))


def test_reinforce_plus_plus_kl_uses_the_configured_clamps():
    prev, ref, mask = torch.zeros(2, 3), t([[0, -15, -30], [0, 1, 2]]), torch.ones(2, 3)
    est = ReinforcePlusPlusEstimator(ReinforcePlusPlusConfig(minus_baseline=False),
                                     kl_context(beta=1.0, kl_type="k1", kl_input_clamp_value=None,
                                                kl_output_clamp_value=None))
    got = advantages_of(est, t([0, 0]), ids(2), mask, prev_logprobs=prev, reference_logprobs=ref)
    expected = upstream_reinforce_plus_plus(t([0, 0]), ids(2), mask, False, 1.0, -ref)  # unclamped k1 = -(ref - lp)
    torch.testing.assert_close(got, expected)


def test_reinforce_plus_plus_without_kl_in_reward_ignores_logprobs():
    est = ReinforcePlusPlusEstimator(None, SimpleNamespace(config=SimpleNamespace(loss_fn=LossConfig())))
    a = advantages_of(est, t([0, 1]), ids(2), torch.ones(2, 3), prev_logprobs=torch.zeros(2, 3),
                               reference_logprobs=torch.full((2, 3), -5.0))
    torch.testing.assert_close(a, advantages_of(est, t([0, 1]), ids(2), torch.ones(2, 3)))


def test_reinforce_plus_plus_kl_in_reward_without_logprobs_is_a_clear_error():
    est = ReinforcePlusPlusEstimator(None, kl_context())
    with pytest.raises(ValueError, match="reference_logprobs"):
        advantages_of(est, t([0, 1]), ids(2), torch.ones(2, 3), prev_logprobs=torch.zeros(2, 3))
    zero_beta = ReinforcePlusPlusEstimator(None, kl_context(beta=0.0))  # beta 0: nothing to fold in
    assert torch.isfinite(advantages_of(zero_beta, t([0, 1]), ids(2), torch.ones(2, 3))).all()


def test_reinforce_plus_plus_empty_mask_raises_instead_of_nan():
    with pytest.raises(ValueError, match="no valid token"):
        advantages_of(ReinforcePlusPlusEstimator(None, None), t([0, 1]), ids(2), torch.zeros(2, 3))


def test_reinforce_plus_plus_zero_variance_group_rows_are_equal_and_zero_under_a_full_mask():
    rewards, groups = t([2, 2, 2, 0, 1, 5]), ids(3, 3)
    a = rows(advantages_of(ReinforcePlusPlusEstimator(None, None), rewards, groups, torch.ones(6, 4)))
    torch.testing.assert_close(a[:3], torch.zeros(3), atol=1e-6, rtol=0)
    uneven = torch.ones(6, 4)
    uneven[4:, 2:] = 0  # unequal token counts shift the masked mean: the flat group is no longer 0, but still flat
    b = advantages_of(ReinforcePlusPlusEstimator(None, None), rewards, groups, uneven)
    assert torch.equal(b[0], b[1]) and torch.equal(b[1], b[2])


# --- opd -------------------------------------------------------------------------------------


def opd(teacher, prev, mask):
    est = OPDEstimator(None, None)
    return est, advantages_of(est, torch.zeros(len(mask)), torch.arange(len(mask)), mask,
                                       teacher_logprobs=teacher, prev_logprobs=prev)


def test_opd_upstream_cases():
    _, a = opd(torch.zeros(2, 4), torch.full((2, 4), -1.0), torch.ones(2, 4))
    assert a.shape == (2, 4) and (a > 0).all()
    same = torch.randn(2, 4)
    torch.testing.assert_close(opd(same, same, torch.ones(2, 4))[1], torch.zeros(2, 4))
    _, a = opd(torch.zeros(1, 6), torch.full((1, 6), -1.0), t([[1, 1, 1, 0, 0, 0]]))
    assert (a[:, 3:] == 0).all() and (a[:, :3] > 0).all()


def test_opd_metrics_upstream():
    est, _ = opd(torch.zeros(2, 4), torch.full((2, 4), -1.0), torch.ones(2, 4))
    assert est.last_metrics[GAP] == pytest.approx(1.0, abs=1e-5)
    assert est.last_metrics[ADV_MEAN] == pytest.approx(1.0, abs=1e-5)
    assert est.last_metrics[ADV_STD] == pytest.approx(0.0, abs=1e-5)


def test_opd_metrics_cover_only_valid_tokens():
    teacher, prev = t([[0, -1, -2, 9]]), t([[-1, -1, 0, 0]])
    mask = t([[1, 1, 0.5, 0]])  # a fractional sample weight scales the advantage but not the raw gap
    est, a = opd(teacher, prev, mask)
    torch.testing.assert_close(a, t([[1, 0, -1, 0]]))
    assert est.last_metrics[GAP] == pytest.approx(-1 / 3)
    assert est.last_metrics[ADV_MEAN] == pytest.approx(0.0)
    assert est.last_metrics[ADV_STD] == pytest.approx(1.0)
    est, _ = opd(teacher, prev, torch.zeros(1, 4))
    assert est.last_metrics == {GAP: 0.0, ADV_MEAN: 0.0, ADV_STD: 0.0}
    est, _ = opd(teacher, prev, t([[1, 0, 0, 0]]))
    assert est.last_metrics[ADV_STD] == 0.0  # one valid token: no spread


def test_opd_is_stop_gradient_and_masked_infinities_stay_zero():
    prev = t([[-1.0, -2.0, float("-inf")]]).requires_grad_()
    teacher = t([[-0.5, -1.0, float("-inf")]])
    _, a = opd(teacher, prev, t([[1, 1, 0]]))
    assert not a.requires_grad
    torch.testing.assert_close(a, t([[0.5, 1.0, 0.0]]))


def test_opd_pads_a_short_teacher_and_rejects_a_long_one():
    padded = pad_teacher_logprobs(torch.ones(2, 3), 5)
    assert padded.shape == (2, 5) and (padded[:, :3] == 1).all() and (padded[:, 3:] == 0).all()
    assert pad_teacher_logprobs(torch.ones(2, 4), 4).shape == (2, 4)
    with pytest.raises(ValueError, match="seq length"):
        pad_teacher_logprobs(torch.ones(2, 6), 4)
    _, a = opd(torch.ones(1, 2), torch.zeros(1, 4), torch.ones(1, 4))
    torch.testing.assert_close(a, t([[1, 1, 0, 0]]))
    with pytest.raises(ValueError, match="seq length"):
        opd(torch.ones(1, 5), torch.zeros(1, 4), torch.ones(1, 4))


def test_opd_missing_inputs_name_the_fix():
    est = OPDEstimator(None, None)
    with pytest.raises(ValueError, match="on_policy_distillation.teacher_model"):
        advantages_of(est, t([0]), ids(1), torch.ones(1, 2), prev_logprobs=torch.zeros(1, 2))
    with pytest.raises(ValueError, match="prev_logprobs"):
        advantages_of(est, t([0]), ids(1), torch.ones(1, 2), teacher_logprobs=torch.zeros(1, 2))


# --- properties ------------------------------------------------------------------------------

group_sizes = st.lists(st.integers(1, 5), min_size=1, max_size=5)
reward_values = st.sampled_from([0.0, 0.5, 1.0, -1.0, 3.0])


def _batch(data, sizes):
    groups = ids(*sizes)
    n = len(groups)
    rewards = t(data.draw(st.lists(reward_values, min_size=n, max_size=n)))
    lengths = torch.tensor(data.draw(st.lists(st.integers(1, 4), min_size=n, max_size=n)))
    mask = (torch.arange(4)[None, :] < lengths[:, None]).float()
    perm = torch.tensor(data.draw(st.permutations(list(range(n)))))
    return groups, rewards, mask, perm


def _estimators():
    yield "rloo", RLOOEstimator(None, None)
    yield "gdpo", GDPOEstimator(None, None)
    yield "gdpo-plain", GDPOEstimator(GDPOEstimatorConfig(use_leave_one_out_baseline=False,
                                                          normalize_rewards=False), None)
    yield "reinforce_plus_plus", ReinforcePlusPlusEstimator(None, kl_context(beta=0.3))
    yield "opd", OPDEstimator(None, None)


@settings(max_examples=60, deadline=None)
@given(st.data(), group_sizes)
def test_permuting_rows_permutes_the_advantages(data, sizes):
    """Rows (with their group ids, components and logprobs) may come in any order, within or across groups."""
    groups, rewards, mask, perm = _batch(data, sizes)
    n = len(groups)
    generator = torch.Generator().manual_seed(n)
    extras = dict(reward_components={"b": rewards, "a": (rewards * 7 + 1) % 3},
                  prev_logprobs=-torch.rand(n, 4, generator=generator),
                  reference_logprobs=-torch.rand(n, 4, generator=generator),
                  teacher_logprobs=-torch.rand(n, 4, generator=generator))
    permuted = {k: v[perm] for k, v in extras.items() if k != "reward_components"}
    permuted["reward_components"] = {k: v[perm] for k, v in extras["reward_components"].items()}
    for name, est in _estimators():
        a = advantages_of(est, rewards, groups, mask, **extras)
        b = advantages_of(est, rewards[perm], groups[perm], mask[perm], **permuted)
        torch.testing.assert_close(b, a[perm], atol=1e-5, rtol=1e-5, msg=name)


@settings(max_examples=60, deadline=None)
@given(st.data(), group_sizes)
def test_zero_variance_groups_get_equal_advantages(data, sizes):
    """A group whose rewards are all equal carries no signal: zero for rloo, one shared value after whitening."""
    groups, rewards, mask, _ = _batch(data, sizes)
    rewards = rewards.clone()
    rewards[groups == 0] = 1.0  # group 0 is flat in the rewards and in every component
    components = {"a": rewards, "b": (groups % 2).float()}  # b is constant inside every group
    rloo = rows(advantages_of(RLOOEstimator(None, None), rewards, groups, mask))
    assert (rloo[groups == 0] == 0).all()
    for est in (GDPOEstimator(None, None), ReinforcePlusPlusEstimator(None, None)):
        a = advantages_of(est, rewards, groups, mask, reward_components=components)
        flat = a[groups == 0]
        assert torch.equal(flat, flat[:1].expand_as(flat))
    # Without leave-one-out every group's advantages sum to 0, so the batch mean is 0 and the flat group stays 0.
    plain = GDPOEstimator(GDPOEstimatorConfig(use_leave_one_out_baseline=False), None)
    flat = advantages_of(plain, rewards, groups, mask, reward_components=components)[groups == 0]
    torch.testing.assert_close(flat, torch.zeros_like(flat), atol=1e-5, rtol=0)


@settings(max_examples=60, deadline=None)
@given(st.data(), group_sizes)
def test_opd_masked_positions_are_zero(data, sizes):
    groups, _, mask, _ = _batch(data, sizes)
    n = len(groups)
    teacher = -torch.rand(n, data.draw(st.integers(1, 4))) * 5
    prev = -torch.rand(n, 4) * 5
    est = OPDEstimator(None, None)
    a = advantages_of(est, torch.zeros(n), groups, mask, teacher_logprobs=teacher, prev_logprobs=prev)
    assert (a[mask == 0] == 0).all()
    torch.testing.assert_close(a[mask > 0], (pad_teacher_logprobs(teacher, 4) - prev)[mask > 0])


def test_plugin_api_1_calls_reach_a_built_in_estimator_with_a_deprecation_warning():
    est, rewards, groups = GRPOEstimator(None, None), t([1, 0, 2, 1]), ids(2, 2)
    valid = torch.tensor([True, True, True, False])
    with pytest.warns(DeprecationWarning, match="plugin API 1"):
        old = est.compute_advantages(rewards, groups, torch.ones(4, 3), valid_mask=valid, metadata=None)
    torch.testing.assert_close(old, advantages_of(est, rewards, groups, torch.ones(4, 3), valid_mask=valid))
    with pytest.raises(TypeError, match=r"unknown keyword\(s\) \['baseline'\]"):
        est.compute_advantages(rewards, groups, torch.ones(4, 3), baseline=rewards)


def test_an_estimator_written_for_plugin_api_1_is_adapted_to_the_typed_call():
    from grpo_sdk.plugins import AdvantageInput
    from grpo_sdk.plugins.advantage_calls import adapt_estimator_class

    class OldMedian:  # a third-party estimator from before AdvantageInput
        def __init__(self, config, context):
            self.seen = None

        def compute_advantages(self, rewards, group_ids, mask, **extras):
            self.seen = extras
            return (rewards - rewards.median())[:, None] * mask

    with pytest.warns(DeprecationWarning, match="'median' .* plugin API 1"):
        adapted = adapt_estimator_class(OldMedian, "median")
    est = adapted(None, None)
    assert isinstance(est, OldMedian) and adapted.api1_estimator is OldMedian
    batch = AdvantageInput(rewards=t([0, 1, 5]), group_ids=ids(3), mask=torch.ones(3, 2),
                           reward_components={"r": t([0, 1, 5])})
    torch.testing.assert_close(est.compute_advantages(batch), torch.tensor([[-1., -1.], [0., 0.], [4., 4.]]))
    assert set(est.seen) == {"reward_components", "valid_mask", "sample_mask", "generation_logprobs",
                             "prev_logprobs", "reference_logprobs", "teacher_logprobs", "metadata"}
    assert adapt_estimator_class(GRPOEstimator, "grpo") is GRPOEstimator  # the typed form is left as it is
