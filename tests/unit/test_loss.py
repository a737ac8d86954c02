"""The clipped policy-gradient loss against NeMo-RL's upstream numbers, its config checks, masking,
and micro-batch invariance of the loss, its gradient and its metrics.

Upstream cases (NeMo-RL's loss-function unit tests; the math: docs/algorithms.md) use one row of 4 tokens with
token_mask [0, 1, 1, 1]; our tensors are input-aligned, so column 0 is the prompt token.
"""

from __future__ import annotations

import math

import pytest
import torch

from grpo_sdk.algorithms.loss import ClippedPGLoss, calculate_kl, check_loss_config, masked_mean
from grpo_sdk.config.schema import LossConfig
from grpo_sdk.core.errors import ConfigError
from grpo_sdk.core.records import TrainBatch


def row(values, dtype=torch.float32):
    return torch.tensor([[0.0] + list(values)], dtype=dtype)


def batch(advantages, prev, gen, ref=None, token_mask=None, sample_mask=None, rewards=None):
    b, s = advantages.shape
    token_mask = torch.tensor([[0.0] + [1.0] * (s - 1)] * b) if token_mask is None else token_mask
    if not isinstance(token_mask, torch.Tensor):
        token_mask = torch.tensor([token_mask] * b, dtype=torch.float32)
    return TrainBatch(
        input_ids=torch.zeros(b, s, dtype=torch.long), attention_mask=torch.ones(b, s, dtype=torch.long),
        token_mask=token_mask.to(advantages.dtype),
        sample_mask=torch.ones(b, dtype=advantages.dtype) if sample_mask is None else torch.tensor(
            sample_mask, dtype=advantages.dtype),
        generation_logprobs=gen, group_ids=torch.zeros(b, dtype=torch.long),
        rewards=torch.zeros(b) if rewards is None else torch.tensor(rewards),
        advantages=advantages, prev_logprobs=prev, reference_logprobs=ref)


def call(loss_fn, curr, data, **kwargs):
    mask = data.token_mask[:, 1:] * data.sample_mask[:, None]
    return loss_fn(curr, data, global_valid_seqs=data.sample_mask.sum(), global_valid_toks=mask.sum(), **kwargs)


def grad(loss_fn, curr, data, **kwargs):
    curr = curr.clone().requires_grad_(True)
    loss, _ = call(loss_fn, curr, data, **kwargs)
    loss.backward()
    return curr.grad


def loss_fn(**options):
    options.setdefault("reference_policy_kl_penalty", 0.0)
    return ClippedPGLoss(LossConfig(**options))


CURR = row([-1.69315, -1.0, -0.59453])  # ratios 0.5, 1, 1.5 against prev = -1
PREV = row([-1.0, -1.0, -1.0])
GEN = row([-0.5, -1.5, -0.8])
ADV = row([1.0, -1.0, 2.0])
IS = {"use_importance_sampling_correction": True}


# --- upstream cases ---------------------------------------------------------------------------


def test_ppo_clip_matches_upstream():
    loss, metrics = call(loss_fn(), CURR, batch(ADV, PREV, GEN))
    assert loss.item() == pytest.approx(-0.6333, abs=1e-4)  # max(-A r, -A clip(r)) = [-0.5, 1.0, -2.4]
    assert metrics["probs_ratio"] == pytest.approx(1.0, abs=1e-4)
    assert metrics["probs_ratio_clamped"] == pytest.approx(1.0, abs=1e-4)
    assert (metrics["probs_ratio_min"], metrics["probs_ratio_max"]) == pytest.approx((0.5, 1.5), abs=1e-4)
    assert (metrics["probs_ratio_clamped_min"], metrics["probs_ratio_clamped_max"]) == pytest.approx((0.8, 1.2))
    assert metrics["clip_fraction"] == pytest.approx(2 / 3, abs=1e-4)
    assert metrics["num_valid_samples"] == 1.0
    assert "is_oob_ratio" not in metrics and metrics["positive_nll_loss"] == 0.0  # upstream logs it always


def test_clip_higher_uses_the_asymmetric_bound():
    loss, _ = call(loss_fn(ratio_clip_max=0.28), CURR, batch(ADV, PREV, GEN))
    assert loss.item() == pytest.approx(-(0.5 - 1.0 + 2 * 1.28) / 3, abs=1e-4)  # [-0.5, 1.0, -2.56]


def test_reinforce_is_minus_advantage_times_logprob():
    curr = row([-0.5, -1.0, -1.5])
    loss, metrics = call(loss_fn(disable_ppo_ratio=True, ratio_clip_min=0.0, ratio_clip_max=0.0), curr,
                         batch(ADV, torch.zeros(1, 4), GEN))
    assert loss.item() == pytest.approx(0.8333, abs=1e-4)  # -A c = [0.5, -1, 3]
    assert metrics["probs_ratio"] == pytest.approx(-1.0)  # the "ratio" is the logprob itself
    torch.testing.assert_close(grad(loss_fn(disable_ppo_ratio=True), curr, batch(ADV, PREV, GEN)),
                               row([-1.0, 1.0, -2.0]) / 3)


def test_force_on_policy_ratio_is_one_and_ignores_prev_logprobs():
    fn = loss_fn(force_on_policy_ratio=True)
    loss, metrics = call(fn, CURR, batch(ADV, PREV, GEN))
    assert loss.item() == pytest.approx(-0.6667, abs=1e-4)  # -A
    for key in ("probs_ratio", "probs_ratio_clamped", "probs_ratio_min", "probs_ratio_max",
                "probs_ratio_clamped_min", "probs_ratio_clamped_max"):
        assert metrics[key] == 1.0
    assert metrics["clip_fraction"] == 0.0
    for prev in (row([-10.0] * 3), None, row([float("nan")] * 3)):
        other_loss, other_metrics = call(fn, CURR, batch(ADV, prev, GEN))
        assert other_loss.item() == loss.item() and other_metrics == metrics
    torch.testing.assert_close(grad(fn, CURR, batch(ADV, PREV, GEN)), -ADV / 3)  # the ratio keeps d/dc


def test_missing_prev_logprobs_means_the_detached_current_ones():
    on_policy, _ = call(loss_fn(), CURR, batch(ADV, CURR.clone(), GEN))
    implicit, _ = call(loss_fn(), CURR, batch(ADV, None, GEN))
    assert implicit.item() == on_policy.item() == pytest.approx(-2 / 3, abs=1e-6)


def test_cispo_stops_the_gradient_of_the_clipped_ratio():
    clipped = torch.tensor([0.8, 1.0, 1.2])
    loss, _ = call(loss_fn(use_cispo=True), CURR, batch(ADV, PREV, GEN))
    expected = (-ADV[0, 1:] * clipped * CURR[0, 1:]).mean()  # [1.35452, -1, 1.42687]
    assert loss.item() == pytest.approx(expected.item(), abs=1e-5)
    assert loss.item() == pytest.approx(0.59380, abs=1e-4)
    torch.testing.assert_close(grad(loss_fn(use_cispo=True), CURR, batch(ADV, PREV, GEN)),
                               torch.cat([torch.zeros(1), -ADV[0, 1:] * clipped / 3])[None])


def test_cispo_with_importance_sampling_correction():
    weights = torch.exp(PREV - GEN)[0, 1:]  # [0.6065, 1.6487, 0.8187]
    loss, _ = call(loss_fn(use_cispo=True, use_importance_sampling_correction=True), CURR, batch(ADV, PREV, GEN))
    expected = (weights * -ADV[0, 1:] * torch.tensor([0.8, 1.0, 1.2]) * CURR[0, 1:]).mean()
    assert loss.item() == pytest.approx(expected.item(), abs=1e-5)
    assert loss.item() == pytest.approx(0.11368, abs=1e-4)


def test_kl_penalty_matches_upstream():
    curr = row([0.0, -1.0, -2.0])
    data = batch(row([0, 0, 0]), curr.clone(), curr.clone(), ref=row([-1.0, -1.0, -1.0]))
    loss, metrics = call(loss_fn(reference_policy_kl_penalty=0.1), curr, data)
    assert loss.item() == pytest.approx(0.0362, abs=1e-4)  # k3 = [0.368, 0, 0.718]
    assert metrics["kl_penalty"] == pytest.approx(0.362, abs=1e-3)


def test_kl_in_reward_removes_the_kl_term_from_the_loss():
    curr = row([0.0, -1.0, -2.0])
    data = batch(row([0, 0, 0]), curr.clone(), curr.clone(), ref=None)  # no reference needed either
    loss, metrics = call(loss_fn(reference_policy_kl_penalty=0.1, use_kl_in_reward=True), curr, data)
    assert loss.item() == 0.0 and metrics["kl_penalty"] == 0.0
    with pytest.raises(ValueError, match="reference_logprobs"):
        call(loss_fn(reference_policy_kl_penalty=0.1), curr, data)


@pytest.mark.parametrize("on_policy_kl", [False, True])
def test_kl_gradient_keeps_the_sampling_term(on_policy_kl):
    curr, gen, ref = torch.tensor([[-1.2, -0.7]]), torch.tensor([[-1.5, -0.4]]), torch.tensor([[-0.9, -1.1]])
    pad = lambda x: torch.cat([torch.zeros(1, 1), x], dim=1)  # noqa: E731
    data = batch(pad(torch.tensor([[0.4, -0.2]])), pad(torch.tensor([[-1.0, -0.8]])), pad(gen), ref=pad(ref))

    def gradient(beta):
        return grad(loss_fn(reference_policy_kl_penalty=beta, use_on_policy_kl_approximation=on_policy_kl),
                    pad(curr), data)[:, 1:]

    log_ratio = ref - curr
    kl = torch.exp(log_ratio) - 1 - log_ratio
    weight = torch.exp(curr - gen) if on_policy_kl else torch.ones_like(curr)
    torch.testing.assert_close(gradient(0.3) - gradient(0.0), 0.3 * weight * (kl + 1 - torch.exp(log_ratio)) / 2)


@pytest.mark.parametrize("kl_type, clamps, expected", [
    ("k1", (None, None), [-1, 14, 29]), ("k2", (None, None), [0.5, 98, 420.5]), ("k3", (None, None), [0.7183, 13, 28]),
    ("k1", (20, 10), [-1, 10, 10]), ("k2", (20, 10), [0.5, 10, 10]), ("k3", (20, 10), [0.7183, 10, 10]),
])
def test_kl_estimators_and_clamps_match_upstream(kl_type, clamps, expected):
    kl = calculate_kl(torch.tensor([-1.0, -1, -1]), torch.tensor([0.0, -15, -30]), kl_type, *clamps)
    torch.testing.assert_close(kl, torch.tensor(expected, dtype=torch.float32), atol=1e-4, rtol=1e-4)


def test_kl_input_clamp_stops_the_gradient_through_the_weight():
    logprobs = torch.tensor([-3.0, -1.0], requires_grad=True)
    weights = torch.exp(logprobs - logprobs.detach())
    kl = calculate_kl(logprobs, torch.zeros(2), "k3", input_clamp_value=2.0, output_clamp_value=None,
                      importance_weights=weights)
    torch.testing.assert_close(kl.detach(), torch.tensor([4.389056, 0.7182818]))
    kl.sum().backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([0.0, -1.0]))


def test_kl_output_clamp_applies_after_the_weight_and_stops_its_gradient():
    logprobs = torch.tensor([-1.0], requires_grad=True)
    kl = calculate_kl(logprobs, torch.zeros(1), "k3", None, 1.0, 100.0 * torch.exp(logprobs - logprobs.detach()))
    kl.sum().backward()
    assert kl.item() == 1.0 and logprobs.grad.item() == 0.0


@pytest.mark.parametrize("weights", ["score_function", "on_policy", None])
def test_an_overflowing_kl_without_input_clamp_has_a_finite_gradient_where_the_output_clamp_bites(weights):
    """k3's exp(ref - c) is inf in float32 past 88.7; the output clamp makes the value finite, and the
    gradient there must be 0, not 0 * inf = NaN (upstream's is NaN)."""
    logprobs = torch.tensor([-2.1, -100.27, -1.0], requires_grad=True)
    ref = torch.tensor([-2.2, -3.9, -1.5])
    w = {"score_function": torch.exp(logprobs - logprobs.detach()), "on_policy": torch.exp(logprobs + 1.0),
         None: None}[weights]
    kl = calculate_kl(logprobs, ref, "k3", input_clamp_value=None, output_clamp_value=1.0, importance_weights=w)
    kl.sum().backward()
    assert kl[1].item() == 1.0 and torch.isfinite(kl).all()
    assert torch.isfinite(logprobs.grad).all() and logprobs.grad[1] == 0
    expected = logprobs.detach().clone().requires_grad_(True)  # unclamped positions: the plain formula
    w2 = None if w is None else {"score_function": torch.exp(expected - expected.detach()),
                                 "on_policy": torch.exp(expected + 1.0)}[weights]
    plain = calculate_kl(expected, ref, "k3", None, None, w2)
    plain[[0, 2]].sum().backward()
    torch.testing.assert_close(kl.detach()[[0, 2]], plain.detach()[[0, 2]])
    torch.testing.assert_close(logprobs.grad[[0, 2]], expected.grad[[0, 2]])


def test_an_overflowing_kl_in_the_loss_gives_a_finite_loss_and_gradient():
    data = batch(row([0.0]), row([-100.27]), row([-100.27]), ref=row([-3.9]))
    fn = loss_fn(reference_policy_kl_penalty=0.1, kl_input_clamp_value=None, kl_output_clamp_value=1.0)
    g = grad(fn, row([-100.27]), data)
    assert torch.isfinite(g).all()


def test_unfiltered_logprobs_feed_only_the_kl_term():
    ref, unfiltered = row([-1.0] * 3), row([-0.5, -2.0, -1.5])
    data = batch(ADV, PREV, GEN, ref=ref)
    plain, _ = call(loss_fn(), CURR, data)
    with_kl, _ = call(loss_fn(reference_policy_kl_penalty=0.1), CURR, data, unfiltered_logprobs=unfiltered)
    log_ratio = (ref - unfiltered)[0, 1:]
    expected_kl = 0.1 * (torch.exp(log_ratio) - 1 - log_ratio).mean()
    assert (with_kl - plain).item() == pytest.approx(expected_kl.item(), abs=1e-6)


def test_masking_a_token_or_a_sample():
    g = torch.Generator().manual_seed(0)
    prev, ref = 0.1 * torch.randn(2, 4, generator=g), 0.1 * torch.randn(2, 4, generator=g)
    curr, adv = prev + 0.3 * torch.randn(2, 4, generator=g), torch.randn(2, 4, generator=g) + 1.0
    fn = loss_fn(reference_policy_kl_penalty=0.1)
    full, _ = call(fn, curr, batch(adv, prev, prev - 0.1, ref))
    token_mask = torch.tensor([[0.0, 0, 1, 1], [0, 1, 1, 1]])
    one_masked, _ = call(fn, curr, batch(adv, prev, prev - 0.1, ref, token_mask=token_mask))
    assert abs(full.item() - one_masked.item()) > 1e-4
    row0_only, _ = call(fn, curr, batch(adv, prev, prev - 0.1, ref, sample_mask=[1.0, 0.0]))
    alone, _ = call(fn, curr[:1], batch(adv[:1], prev[:1], prev[:1] - 0.1, ref[:1]))
    torch.testing.assert_close(row0_only, alone)


def test_an_all_zero_mask_gives_exactly_zero():
    data = batch(ADV, PREV, GEN, ref=row([-1.0] * 3), token_mask=(0, 0, 0, 0))
    loss, metrics = call(loss_fn(reference_policy_kl_penalty=0.1), CURR, data)
    assert loss.item() == 0.0
    assert metrics["probs_ratio_min"] == math.inf and metrics["probs_ratio_max"] == -math.inf
    assert metrics["probs_ratio_clamped_min"] == math.inf and metrics["probs_ratio_clamped_max"] == -math.inf


def test_masked_tokens_never_contribute_even_when_not_finite():
    curr = torch.tensor([[0.0, -1.0, -2.0, float("-inf")], [0.0, -1.0, -1.0, -1.0]], requires_grad=True)
    bad = torch.tensor([[0.0, 0.0, 0.0, float("nan")], [0.0, float("inf"), float("-inf"), float("nan")]])
    data = batch(torch.tensor([[0.0, 1, 1, float("nan")], [0.0, 5, 5, 5]]), curr.detach() + bad, curr.detach() + bad,
                 ref=curr.detach() + bad, token_mask=(0, 1, 1, 0), sample_mask=(1.0, 0.0))
    for options in ({}, {"reference_policy_kl_penalty": 0.1, "use_on_policy_kl_approximation": True},
                    {"sequence_level_importance_ratios": True, "token_level_loss": False,
                     "use_importance_sampling_correction": True},
                    {"use_importance_sampling_correction": True, "truncated_importance_sampling_type": "seq-mask-tis",
                     "truncated_importance_sampling_ratio": 2.0, "truncated_importance_sampling_ratio_min": 0.5}):
        curr.grad = None
        loss, metrics = call(loss_fn(**options), curr, data)
        loss.backward()
        # row 0 has two valid tokens of -A * 1 (token mean) or one sequence of mean -1 (GSPO); row 1 is masked
        assert loss.item() == pytest.approx(-1.0)
        assert torch.isfinite(curr.grad).all() and (curr.grad[1] == 0).all() and curr.grad[0, 3] == 0
        assert all(math.isfinite(v) for k, v in metrics.items() if not k.endswith(("_min", "_max")))


def test_importance_sampling_with_on_policy_kl_matches_upstream():
    data = batch(ADV, PREV, GEN, ref=row([-1.0] * 3))
    options = {"use_on_policy_kl_approximation": True, "use_importance_sampling_correction": True}
    loss, metrics = call(loss_fn(**options), CURR, data)
    assert loss.item() == pytest.approx(-0.2065, abs=1e-4)  # w = [0.6065, 1.6487, 0.8187] x [-0.5, 1, -2.4]
    assert metrics["sampling_importance_ratio"] == pytest.approx((0.60653 + 1.64872 + 0.81873) / 3, abs=1e-4)
    with_kl, _ = call(loss_fn(reference_policy_kl_penalty=0.1, **options), CURR, data)
    assert with_kl.item() == pytest.approx(-0.2004457, abs=1e-4)  # + 0.1 * mean(exp(c - g) * k3)


@pytest.mark.parametrize("gspo, expected", [(False, -0.4744), (True, -0.4846)])
def test_truncated_importance_sampling_matches_upstream(gspo, expected):
    options = {"use_importance_sampling_correction": True, "truncated_importance_sampling_type": "tis",
               "truncated_importance_sampling_ratio": 0.8}
    if gspo:  # ratio exp(mean(c - p)) = 0.9086; weight exp(sum(p - g)) = 0.8187 -> 0.8
        options.update(sequence_level_importance_ratios=True, token_level_loss=False)
    loss, metrics = call(loss_fn(**options), CURR, batch(ADV, PREV, GEN))
    assert loss.item() == pytest.approx(expected, abs=1e-4)
    assert metrics["sampling_importance_ratio"] == pytest.approx(0.8 if gspo else (0.60653 + 1.6) / 3, abs=1e-4)
    assert metrics["is_oob_ratio"] == pytest.approx(1.0 if gspo else 2 / 3)  # token fraction, also under GSPO


def test_icepop_drops_tokens_outside_the_bounds():
    options = {"use_importance_sampling_correction": True, "truncated_importance_sampling_type": "icepop",
               "truncated_importance_sampling_ratio": 5.0, "truncated_importance_sampling_ratio_min": 0.5}
    loss, metrics = call(loss_fn(**options), PREV, batch(ADV, PREV, row([-0.5, -3.5, -0.8])))
    # weights exp(p - g) = [0.6065, 12.18 -> 0, 0.8187]; ratios 1, so the loss is mean(w * -A)
    assert loss.item() == pytest.approx((-0.60653 - 2 * 0.81873) / 3, abs=1e-4)
    assert metrics["is_oob_ratio"] == pytest.approx(1 / 3)


def test_is_oob_ratio_of_tis_matches_upstream():
    options = {"use_importance_sampling_correction": True, "truncated_importance_sampling_type": "tis",
               "truncated_importance_sampling_ratio": 2.0}
    prev = torch.log(row([1.0, 3.0, 0.5]))
    _, metrics = call(loss_fn(**options), torch.zeros(1, 4), batch(row([1.0] * 3), prev, torch.zeros(1, 4)))
    assert metrics["is_oob_ratio"] == pytest.approx(1 / 3)


@pytest.mark.parametrize("tis_min, weights, oob", [(None, [0.1, 1.0, 2.0], 1 / 3), (0.5, [0.5, 1.0, 2.0], 2 / 3)])
def test_tis_lower_bound_defaults_to_zero(tis_min, weights, oob):
    fn = loss_fn(**IS, force_on_policy_ratio=True, truncated_importance_sampling_type="tis",
                 truncated_importance_sampling_ratio=2.0, truncated_importance_sampling_ratio_min=tis_min)
    loss, metrics = call(fn, torch.log(row([0.1, 1.0, 3.0])), batch(row([1.0] * 3), None, torch.zeros(1, 4)))
    assert loss.item() == pytest.approx(-sum(weights) / 3, abs=1e-6)
    assert metrics["is_oob_ratio"] == pytest.approx(oob)


def test_seq_mask_tis_keeps_raw_weights_or_drops_the_sequence():
    options = {"use_importance_sampling_correction": True, "truncated_importance_sampling_type": "seq-mask-tis",
               "truncated_importance_sampling_ratio": 1.002, "truncated_importance_sampling_ratio_min": 0.999}
    loss, metrics = call(loss_fn(**options), PREV, batch(ADV, PREV, PREV - 0.0005))
    assert loss.item() == pytest.approx(math.exp(0.0005) * -2 / 3, abs=1e-6)  # geometric mean 1.0005: kept
    assert metrics["is_oob_ratio"] == 0.0
    loss, metrics = call(loss_fn(**options), PREV, batch(ADV, PREV, PREV - 0.01))  # 1.01: dropped
    assert loss.item() == 0.0 and metrics["is_oob_ratio"] == 1.0
    gen = PREV - 0.0005
    gen[0, 2] = -math.inf  # its weight is nan_to_num'ed to 0 and its log-weight to 0
    loss, _ = call(loss_fn(**options), PREV, batch(ADV, PREV, gen))
    assert loss.item() == pytest.approx(math.exp(0.0005) * -(1 + 2) / 3, abs=1e-6)


def test_dual_clip_caps_negative_advantages():
    curr = row([-1.69315, -1.0, -0.69741])  # ratios 0.5, 1, 10 against prev [-1, -1, -3]
    loss, _ = call(loss_fn(ratio_clip_c=3.0), curr, batch(row([1.0, -1.0, -4.0]), row([-1.0, -1.0, -3.0]), GEN))
    assert loss.item() == pytest.approx(4.1667, abs=1e-4)  # [-0.5, 1, min(40, 12)]
    g = grad(loss_fn(ratio_clip_c=3.0), curr, batch(row([1.0, -1.0, -4.0]), row([-1.0, -1.0, -3.0]), GEN))
    assert g[0, 3] == 0.0  # the capped token is constant in c


def test_approx_entropy_matches_upstream():
    curr = row([-0.5, -1.0, -1.5])
    _, metrics = call(loss_fn(), curr, batch(row([0.0] * 3), curr - 0.1, curr - 0.1))
    assert metrics["approx_entropy"] == pytest.approx(math.exp(0.1) * 1.0, abs=1e-5)  # -mean(e^(c-g) c)


def test_gspo_matches_upstream():
    gspo = {"sequence_level_importance_ratios": True, "token_level_loss": False}
    loss, metrics = call(loss_fn(**gspo), CURR, batch(ADV, PREV, GEN))
    assert loss.item() == pytest.approx(-0.6057, abs=1e-4)  # one ratio exp(mean(c - p)) = 0.9086
    assert metrics["probs_ratio_min"] == pytest.approx(0.9086, abs=1e-4) == metrics["probs_ratio_max"]
    two_rows = batch(ADV.repeat(2, 1), torch.cat([PREV, PREV - 1]), GEN.repeat(2, 1))
    loss, _ = call(loss_fn(**gspo), CURR.repeat(2, 1), two_rows)
    assert loss.item() == pytest.approx(-0.4912, abs=1e-4)  # row 2: ratio 2.4697, clipped 1.2
    loss, metrics = call(loss_fn(use_importance_sampling_correction=True, **gspo), CURR, batch(ADV, PREV, GEN))
    assert loss.item() == pytest.approx(-0.4959, abs=1e-4)  # weight exp(SUM(p - g)) = 0.8187
    assert metrics["sampling_importance_ratio"] == pytest.approx(0.8187, abs=1e-4)


def test_positive_example_nll_is_normalised_by_the_micro_batch_correct_tokens():
    curr = torch.tensor([[0.0, -1.0, -2.0, -3.0], [0.0, -4.0, -5.0, -6.0]])
    data = batch(torch.zeros(2, 4), None, curr.clone(), token_mask=(0, 1, 1, 0), rewards=[1.0, 0.0])
    loss, metrics = call(loss_fn(positive_example_nll_weight=0.5), curr, data)
    assert metrics["positive_nll_loss"] == pytest.approx(1.5)  # mean(-c) over row 0's two tokens only
    assert loss.item() == pytest.approx(0.75)
    data.rewards = torch.zeros(2)
    loss, metrics = call(loss_fn(positive_example_nll_weight=0.5), curr, data)
    assert loss.item() == 0.0 and metrics["positive_nll_loss"] == 0.0


def test_sequence_level_loss_averages_per_sequence_first():
    curr = torch.zeros(2, 4)
    adv = torch.tensor([[0.0, 1, 1, 1], [0.0, 4, 0, 0]])
    data = batch(adv, curr.clone(), curr.clone(), token_mask=torch.tensor([[0.0, 1, 1, 1], [0.0, 1, 0, 0]]))
    token_loss, _ = call(loss_fn(), curr, data)
    seq_loss, _ = call(loss_fn(token_level_loss=False), curr, data)
    assert token_loss.item() == pytest.approx(-(1 + 1 + 1 + 4) / 4)
    assert seq_loss.item() == pytest.approx(-(1 + 4) / 2)


def test_masked_mean_matches_upstream():
    values = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert masked_mean(values, torch.zeros(4)).item() == 0.0
    assert masked_mean(values, torch.tensor([1.0, 0, 0, 0])).item() == pytest.approx(1.0)
    torch.testing.assert_close(masked_mean(values.view(2, 2), torch.zeros(2, 2), dim=1), torch.zeros(2))


def test_masked_mean_with_global_normaliser_sums_across_splits():
    values, mask = torch.randn(6, 5), (torch.rand(6, 5) > 0.3).float()
    whole = masked_mean(values, mask)
    parts = sum(masked_mean(values[i:i + 2], mask[i:i + 2], global_normalization=mask.sum()) for i in (0, 2, 4))
    torch.testing.assert_close(parts, whole)


# --- config checks ----------------------------------------------------------------------------

IN_LOSS = {"seq_logprob_error_in_loss": True, "force_on_policy_ratio": True}


@pytest.mark.parametrize("options, threshold, key", [
    ({"sequence_level_importance_ratios": True}, None, "loss_fn.sequence_level_importance_ratios"),
    ({"truncated_importance_sampling_type": "tis", "truncated_importance_sampling_ratio": 2.0}, None,
     "loss_fn.truncated_importance_sampling_type"),
    ({**IS, "truncated_importance_sampling_type": "tis"}, None, "loss_fn.truncated_importance_sampling_ratio"),
    ({**IS, "truncated_importance_sampling_type": "tis", "truncated_importance_sampling_ratio": 0.0}, None,
     "loss_fn.truncated_importance_sampling_ratio"),
    ({**IS, "truncated_importance_sampling_ratio": 2.0}, None, "loss_fn.truncated_importance_sampling_ratio"),
    ({**IS, "truncated_importance_sampling_type": "tis", "truncated_importance_sampling_ratio": 1.0,
      "truncated_importance_sampling_ratio_min": 2.0}, None, "loss_fn.truncated_importance_sampling_ratio_min"),
    ({**IS, "truncated_importance_sampling_type": "icepop", "truncated_importance_sampling_ratio": 1.0,
      "truncated_importance_sampling_ratio_min": 2.0}, None, "loss_fn.truncated_importance_sampling_ratio_min"),
    ({**IS, "truncated_importance_sampling_type": "seq-mask-tis", "truncated_importance_sampling_ratio": 1.0,
      "truncated_importance_sampling_ratio_min": 2.0}, None, "loss_fn.truncated_importance_sampling_ratio_min"),
    ({**IS, "truncated_importance_sampling_type": "icepop", "truncated_importance_sampling_ratio": 5.0}, None,
     "loss_fn.truncated_importance_sampling_ratio_min"),
    ({**IS, "truncated_importance_sampling_type": "seq-mask-tis", "truncated_importance_sampling_ratio": 1.002},
     None, "loss_fn.truncated_importance_sampling_ratio_min"),
    ({**IS, "truncated_importance_sampling_type": "seq-mask-tis", "truncated_importance_sampling_ratio": 1.002,
      "truncated_importance_sampling_ratio_min": 0.999, "sequence_level_importance_ratios": True,
      "token_level_loss": False}, None, "loss_fn.sequence_level_importance_ratios"),
    ({**IS, "truncated_importance_sampling_type": "clip", "truncated_importance_sampling_ratio": 2.0}, None,
     "loss_fn.truncated_importance_sampling_type"),
    ({"ratio_clip_c": 1.0}, None, "loss_fn.ratio_clip_c"),
    ({"ratio_clip_c": 0.5}, None, "loss_fn.ratio_clip_c"),
    ({"reference_policy_kl_type": "k4"}, None, "loss_fn.reference_policy_kl_type"),
    ({"reference_policy_kl_penalty": math.inf}, None, "loss_fn.reference_policy_kl_penalty"),
    ({"use_cispo": True, "disable_ppo_ratio": True}, None, "loss_fn.disable_ppo_ratio"),
    ({"use_cispo": True, "force_on_policy_ratio": True}, None, "loss_fn.force_on_policy_ratio"),
    ({"use_cispo": True, "sequence_level_importance_ratios": True, "token_level_loss": False}, None,
     "loss_fn.sequence_level_importance_ratios"),
    ({"use_cispo": True, "ratio_clip_c": 3.0}, None, "loss_fn.ratio_clip_c"),
    ({"use_cispo": True, "token_level_loss": False}, None, "loss_fn.token_level_loss"),
    (IN_LOSS, None, "grpo.seq_logprob_error_threshold"),
    ({**IN_LOSS, "force_on_policy_ratio": False}, 2.0, "loss_fn.force_on_policy_ratio"),
    ({**IN_LOSS, "token_level_loss": False}, 2.0, "loss_fn.token_level_loss"),
    ({**IN_LOSS, "positive_example_nll_weight": 0.1}, 2.0, "loss_fn.positive_example_nll_weight"),
    ({**IN_LOSS, "use_kl_in_reward": True}, 2.0, "loss_fn.use_kl_in_reward"),
])
def test_every_incompatible_option_is_a_config_error_naming_the_key(options, threshold, key):
    cfg = LossConfig(**options)
    assert key in [path for path, _ in check_loss_config(cfg, threshold)]
    with pytest.raises(ConfigError) as caught:
        ClippedPGLoss(cfg, seq_logprob_error_threshold=threshold)
    assert key in [path for path, _ in caught.value.problems]


def test_all_problems_are_reported_at_once():
    cfg = LossConfig(use_cispo=True, disable_ppo_ratio=True, ratio_clip_c=3.0, token_level_loss=False,
                     truncated_importance_sampling_type="icepop")
    keys = {path for path, _ in check_loss_config(cfg, None)}
    assert keys == {"loss_fn.disable_ppo_ratio", "loss_fn.ratio_clip_c", "loss_fn.token_level_loss",
                    "loss_fn.truncated_importance_sampling_type", "loss_fn.truncated_importance_sampling_ratio",
                    "loss_fn.truncated_importance_sampling_ratio_min"}


@pytest.mark.parametrize("options, threshold", [
    ({}, None), ({"sequence_level_importance_ratios": True, "token_level_loss": False}, None),
    ({**IS, "truncated_importance_sampling_type": "tis", "truncated_importance_sampling_ratio": 2.0}, None),
    ({**IS, "truncated_importance_sampling_type": "icepop", "truncated_importance_sampling_ratio": 5.0,
      "truncated_importance_sampling_ratio_min": 0.5}, None),
    ({"use_cispo": True, **IS}, None), ({"ratio_clip_c": 3.0}, None), (IN_LOSS, 1.5),
    ({"seq_logprob_error_in_loss": False}, 1.5),
])
def test_compatible_options_pass_the_checks(options, threshold):
    assert check_loss_config(LossConfig(**options), threshold) == []
    ClippedPGLoss(LossConfig(**options), seq_logprob_error_threshold=threshold)


# --- micro-batch invariance -------------------------------------------------------------------


def random_batch(seed=0, rows=8, width=10):
    """Ragged responses, one sample-masked row and a NaN in a masked position, in float64."""
    g = torch.Generator().manual_seed(seed)
    token_mask = torch.zeros(rows, width, dtype=torch.float64)
    for i in range(rows):
        token_mask[i, 3:3 + int(torch.randint(1, width - 3, (1,), generator=g))] = 1
    prev = -torch.rand(rows, width, generator=g, dtype=torch.float64) * 2
    curr = prev + 0.3 * torch.randn(rows, width, generator=g, dtype=torch.float64)
    noise = lambda: 0.2 * torch.randn(rows, width, generator=g, dtype=torch.float64)  # noqa: E731
    data = TrainBatch(
        input_ids=torch.zeros(rows, width, dtype=torch.long), attention_mask=torch.ones(rows, width, dtype=torch.long),
        token_mask=token_mask, sample_mask=torch.tensor([1.0, 1, 0, 1, 1, 1, 1, 1], dtype=torch.float64),
        generation_logprobs=prev + noise(), group_ids=torch.arange(rows) // 4, rewards=torch.randn(rows, generator=g),
        advantages=torch.randn(rows, 1, generator=g, dtype=torch.float64).expand(rows, width).contiguous(),
        prev_logprobs=prev, reference_logprobs=prev + noise())
    curr[2, 4] = math.nan  # row 2 is sample-masked
    return curr, data


TIS = {**IS, "truncated_importance_sampling_ratio": 1.1}
COMBOS = {
    "token": {}, "kl_k3": {"reference_policy_kl_penalty": 0.1},
    "kl_k2_on_policy": {"reference_policy_kl_penalty": 0.1, "reference_policy_kl_type": "k2",
                        "use_on_policy_kl_approximation": True, "use_importance_sampling_correction": True},
    "seq_level": {"token_level_loss": False, "reference_policy_kl_penalty": 0.1},
    "gspo": {"sequence_level_importance_ratios": True, "token_level_loss": False},
    "gspo_is_tis": {"sequence_level_importance_ratios": True, "token_level_loss": False,
                    **TIS, "truncated_importance_sampling_type": "tis"},
    "is_tis": {**TIS, "truncated_importance_sampling_type": "tis", "truncated_importance_sampling_ratio_min": 0.95},
    "icepop": {**TIS, "truncated_importance_sampling_type": "icepop", "truncated_importance_sampling_ratio_min": 0.9},
    "seq_mask_tis": {**TIS, "truncated_importance_sampling_type": "seq-mask-tis",
                     "truncated_importance_sampling_ratio_min": 0.95},
    "dual_clip": {"ratio_clip_c": 1.5}, "cispo_is": {"use_cispo": True, **IS},
    "reinforce": {"disable_ppo_ratio": True}, "force": {"force_on_policy_ratio": True, **IS},
}


def combine(micro_metrics):
    """The caller's aggregation: sums, except min/max for extrema."""
    out = {}
    for key in micro_metrics[0]:
        values = [m[key] for m in micro_metrics]
        out[key] = min(values) if key.endswith("_min") else max(values) if key.endswith("_max") else sum(values)
    return out


def run_chunks(fn, curr, data, chunks, n_seq=None, n_tok=None):
    """Loss, gradient and per-micro-batch metrics of one optimizer step split into ``chunks`` rows."""
    curr = curr.clone().requires_grad_(True)
    mask = data.token_mask[:, 1:] * data.sample_mask[:, None]
    n_seq = data.sample_mask.sum() if n_seq is None else torch.tensor(n_seq)
    n_tok = mask.sum() if n_tok is None else torch.tensor(n_tok)
    total, metrics, start = 0.0, [], 0
    for size in chunks:
        loss, m = fn(curr[start:start + size], data.rows(start, start + size), global_valid_seqs=n_seq,
                     global_valid_toks=n_tok)
        loss.backward()
        total, start = total + loss.item(), start + size
        metrics.append(m)
    return total, curr.grad, metrics


@pytest.mark.parametrize("combo", COMBOS)
def test_loss_gradient_and_metrics_do_not_depend_on_the_micro_batch_split(combo):
    curr, data = random_batch()
    fn = loss_fn(**COMBOS[combo])
    loss, gradient, (metrics,) = run_chunks(fn, curr, data, [8])
    assert math.isfinite(loss) and torch.isfinite(gradient).all() and gradient.abs().sum() > 0
    assert (gradient[2] == 0).all()  # the sample-masked row, NaN included
    if "tis" in combo or combo == "icepop":
        assert 0 < metrics["is_oob_ratio"] < 1  # the truncation really bites
    for chunks in ([3, 3, 2], [1] * 8):
        split_loss, split_gradient, split_metrics = run_chunks(fn, curr, data, chunks)
        assert split_loss == pytest.approx(loss, rel=1e-12, abs=1e-12)
        torch.testing.assert_close(split_gradient, gradient, rtol=1e-12, atol=1e-12)
        combined = combine(split_metrics)
        assert combined.keys() == metrics.keys()
        for key, value in metrics.items():
            assert combined[key] == pytest.approx(value, rel=1e-10, abs=1e-12), key


def test_metrics_are_normalised_by_the_global_counts():
    curr, data = random_batch()
    fn = loss_fn(reference_policy_kl_penalty=0.1, **IS)
    _, _, (metrics,) = run_chunks(fn, curr, data, [8])
    _, _, (doubled,) = run_chunks(fn, curr, data, [8], n_seq=2 * float(data.sample_mask.sum()),
                                  n_tok=2 * float((data.token_mask[:, 1:] * data.sample_mask[:, None]).sum()))
    for key, how in fn.metric_normalizations.items():
        if key in metrics:
            factor = 1.0 if how == "none" else 0.5
            assert doubled[key] == pytest.approx(factor * metrics[key], rel=1e-9), key


# --- [newer] in-loss sequence logprob-error filter --------------------------------------------


def filter_batch():
    """Upstream's 4 rows: row 1 has |g - c| = ln 4 (error 4 > 2), row 2 only fails seq-mask-tis
    (geometric-mean weight 1.3 > 1.2), row 3 was masked before training."""
    current = torch.full((4, 3), -2.0, dtype=torch.float64)
    delta = torch.tensor([[0.0, 0, 0], [math.log(4), -math.log(4), 0], [math.log(1.3), 0, 0], [0, 0, 0]],
                         dtype=torch.float64)
    pad = lambda x: torch.cat([torch.zeros(4, 1, dtype=torch.float64), x], dim=1)  # noqa: E731
    generation = pad(current - delta)
    data = TrainBatch(
        input_ids=torch.zeros(4, 4, dtype=torch.long), attention_mask=torch.ones(4, 4, dtype=torch.long),
        token_mask=torch.tensor([[0, 1, 1, 1], [0, 1, 1, 0], [0, 1, 0, 0], [0, 1, 1, 1]], dtype=torch.float64),
        sample_mask=torch.tensor([1.0, 1.0, 1.0, 0.0], dtype=torch.float64), generation_logprobs=generation,
        group_ids=torch.zeros(4, dtype=torch.long), rewards=torch.zeros(4),
        advantages=torch.tensor([[0.0, 1, 2, -1], [0, 2, 1, 0], [0, -1, 0, 0], [0, 1, 1, 1]], dtype=torch.float64),
        reference_logprobs=generation - 0.2)  # no prev_logprobs: the single-forward path must not read them
    return pad(current), data


SEQ_MASK_TIS = {"force_on_policy_ratio": True, **IS, "truncated_importance_sampling_type": "seq-mask-tis",
                "truncated_importance_sampling_ratio_min": 0.8, "truncated_importance_sampling_ratio": 1.2}


@pytest.mark.parametrize("chunks", [[4], [1, 1, 1, 1], [2, 2], [1, 3]])
@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_in_loss_filter_rescaled_by_survivors_equals_prefiltering(chunks, beta):
    curr, data = filter_batch()
    prefiltered = data.rows(0, 4)
    prefiltered.sample_mask = torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=torch.float64)
    expected_loss, expected_grad, (expected,) = run_chunks(
        loss_fn(reference_policy_kl_penalty=beta, **SEQ_MASK_TIS), curr, prefiltered, [4])

    fn = ClippedPGLoss(LossConfig(reference_policy_kl_penalty=beta, seq_logprob_error_in_loss=True, **SEQ_MASK_TIS),
                       seq_logprob_error_threshold=2.0)
    assert fn.requires_survivor_normalization
    _, gradient, metrics = run_chunks(fn, curr, data, chunks, n_seq=3.0, n_tok=6.0)  # the original counts
    assert sum(m["seq_logprob_error_valid_tokens"] for m in metrics) == 4  # includes the TIS-only rejected row
    assert sum(m["seq_logprob_error_valid_seqs"] for m in metrics) == 2
    assert sum(m["num_masked_seqs_by_logprob_error"] for m in metrics) == 1
    factor, rescaled = fn.survivor_normalization(metrics, global_valid_seqs=3.0, global_valid_toks=6.0)
    assert factor == 1.5
    torch.testing.assert_close(gradient * factor, expected_grad)
    combined = combine(rescaled)
    for key in ("loss", "is_oob_ratio", "probs_ratio", "kl_penalty", "num_valid_samples", "token_mult_prob_error"):
        assert combined[key] == pytest.approx(expected[key], rel=1e-7, abs=1e-12), key  # 1e-8 epsilons differ
    assert combined["loss"] == pytest.approx(expected_loss)
    assert data.sample_mask.tolist() == [1.0, 1.0, 1.0, 0.0]  # the batch itself is not modified


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("beta, poison", [(0.0, "policy"), (0.1, "policy"), (0.1, "reference")])
def test_a_rejected_non_finite_row_does_not_poison_the_loss(bad, beta, poison):
    curr, data = filter_batch()
    if poison == "policy":
        curr[1, 1:3] = bad
    else:
        data.reference_logprobs[1, 1:3] = bad
    fn = ClippedPGLoss(LossConfig(seq_logprob_error_in_loss=True, force_on_policy_ratio=True,
                                  reference_policy_kl_penalty=beta), seq_logprob_error_threshold=2.0)
    loss, gradient, (metrics,) = run_chunks(fn, curr, data, [4], n_seq=3.0, n_tok=6.0)
    assert math.isfinite(loss) and torch.isfinite(gradient).all() and (gradient[1] == 0).all()
    assert metrics["seq_logprob_error_valid_tokens"] == 4 and math.isfinite(metrics["kl_penalty"])


def test_in_loss_filter_rejecting_everything_gives_zero_loss_and_gradient():
    curr, data = filter_batch()
    fn = ClippedPGLoss(LossConfig(seq_logprob_error_in_loss=True, force_on_policy_ratio=True,
                                  reference_policy_kl_penalty=0.0), seq_logprob_error_threshold=0.5)
    loss, gradient, metrics = run_chunks(fn, curr, data, [4], n_seq=3.0, n_tok=6.0)
    assert loss == 0.0 and (gradient == 0).all()
    assert metrics[0]["seq_logprob_error_valid_tokens"] == 0 and metrics[0]["num_masked_seqs_by_logprob_error"] == 3
    assert fn.survivor_normalization(metrics, global_valid_seqs=3.0, global_valid_toks=6.0)[0] == 0.0


@pytest.mark.parametrize("threshold", [None, 2.0])
@pytest.mark.parametrize("force", [False, True])
def test_a_disabled_in_loss_filter_keeps_the_plain_loss(threshold, force):
    curr, data = filter_batch()
    data.prev_logprobs = curr.clone()
    fn = ClippedPGLoss(LossConfig(force_on_policy_ratio=force, reference_policy_kl_penalty=0.0),
                       seq_logprob_error_threshold=threshold)
    assert not fn.requires_survivor_normalization
    actual = run_chunks(fn, curr, data, [4], n_seq=3.0, n_tok=6.0)
    expected = run_chunks(loss_fn(force_on_policy_ratio=force), curr, data, [4], n_seq=3.0, n_tok=6.0)
    assert actual[0] == expected[0] and actual[2] == expected[2] and actual[2][0]["num_valid_samples"] == 3
    assert "seq_logprob_error_valid_tokens" not in actual[2][0]
    torch.testing.assert_close(actual[1], expected[1])


# --- micro-batch invariance of a real optimizer step ------------------------------------------


def _policy(model_dir, micro, token_level=True, kl=0.0):
    from grpo_sdk.backends.hf.policy import HFPolicy
    from grpo_sdk.config.loading import load_config
    from grpo_sdk.config.context import RunContext
    from grpo_sdk.plugins.registry import Registry

    cfg = load_config(None, [f"policy.train_micro_batch_size={micro}", "grpo.num_prompts_per_step=2",
                             "grpo.num_generations_per_prompt=4", f"loss_fn.token_level_loss={str(token_level).lower()}",
                             f"loss_fn.reference_policy_kl_penalty={kl}"], Registry.discover())
    context = RunContext(config=cfg, run_dir=model_dir, model_path=str(model_dir), tokenizer_path=str(model_dir),
                         device="cpu", seed=0, needs_reference=kl > 0)
    return HFPolicy(None, context), cfg


def _random_batch(seed=0, rows=8, width=9, vocab=25):
    g = torch.Generator().manual_seed(seed)
    token_mask = torch.zeros(rows, width)
    for i in range(rows):
        token_mask[i, 4:4 + int(torch.randint(1, width - 4, (1,), generator=g))] = 1  # ragged responses
    return TrainBatch(
        input_ids=torch.randint(4, vocab, (rows, width), generator=g), attention_mask=torch.ones(rows, width).long(),
        token_mask=token_mask, sample_mask=torch.tensor([1.0, 1, 0, 1, 1, 1, 1, 0]),
        generation_logprobs=-torch.rand(rows, width, generator=g), group_ids=torch.arange(rows) // 4,
        rewards=torch.zeros(rows), advantages=torch.randn(rows, 1, generator=g).expand(rows, width).contiguous())


@pytest.mark.parametrize("token_level", [True, False])
@pytest.mark.filterwarnings(r"ignore:Seems like `optimizer.step\(\)` has been overridden")
def test_one_optimizer_step_does_not_depend_on_the_micro_batch_size(tiny_model_dir, token_level):
    """The accumulated gradient, the loss and the grad norm of HFPolicy.train are the same for
    micro-batches of 8, 4, 3 and 1 rows (ragged responses, a masked sample, a KL term)."""
    results = []
    for micro in (8, 4, 3, 1):
        policy, cfg = _policy(tiny_model_dir, micro, token_level, kl=0.05)
        data = _random_batch()
        data.reference_logprobs = policy.reference_logprobs(data) - 0.1
        grads = {}
        # Capture the gradient the optimizer would apply (Adam's first step is ~sign(g), which
        # would amplify rounding noise in near-zero gradients into visible parameter differences).
        policy.optimizer.step = lambda: grads.update(
            {n: p.grad.clone() for n, p in policy.model.named_parameters() if p.grad is not None})
        metrics = policy.train(data, ClippedPGLoss(cfg.loss_fn))
        results.append((metrics, grads))
    base_metrics, base_grads = results[0]
    assert math.isfinite(base_metrics["loss"]) and base_metrics["grad_norm"] > 0 and base_grads
    for metrics, grads in results[1:]:
        assert metrics["loss"] == pytest.approx(base_metrics["loss"], rel=1e-4, abs=1e-6)
        assert metrics["grad_norm"] == pytest.approx(base_metrics["grad_norm"], rel=1e-4)
        for name, grad in base_grads.items():
            torch.testing.assert_close(grads[name], grad, atol=1e-6, rtol=1e-4)
