"""The clipped policy-gradient loss against NeMo-RL's upstream numbers, masking, and
micro-batch invariance of a real optimizer step.

Upstream cases (shared/research/nemo-rl-reference.md §4.4) use one row of 4 tokens with
token_mask [0, 1, 1, 1]; our tensors are input-aligned, so column 0 is the prompt token.
"""

from __future__ import annotations

import math

import pytest
import torch

from grpo_sdk.algorithms.loss import ClippedPGLoss, calculate_kl, masked_mean
from grpo_sdk.core.config import LossConfig
from grpo_sdk.core.records import TrainBatch


def row(values):
    return torch.tensor([[0.0] + list(values)])


def batch(advantages, prev, gen, ref=None, token_mask=(0, 1, 1, 1), sample_mask=(1.0,)):
    b = len(sample_mask)
    return TrainBatch(
        input_ids=torch.zeros(b, 4, dtype=torch.long), attention_mask=torch.ones(b, 4, dtype=torch.long),
        token_mask=torch.tensor([token_mask] * b, dtype=torch.float32), sample_mask=torch.tensor(sample_mask),
        generation_logprobs=gen, group_ids=torch.zeros(b, dtype=torch.long), rewards=torch.zeros(b),
        advantages=advantages, prev_logprobs=prev, reference_logprobs=ref)


def call(loss_fn, curr, data):
    mask = data.token_mask[:, 1:] * data.sample_mask[:, None]
    return loss_fn(curr, data, global_valid_seqs=data.sample_mask.sum(), global_valid_toks=mask.sum())


CURR = row([-1.69315, -1.0, -0.59453])  # ratios 0.5, 1, 1.5 against prev = -1
PREV = row([-1.0, -1.0, -1.0])
GEN = row([-0.5, -1.5, -0.8])
ADV = row([1.0, -1.0, 2.0])


def test_ppo_clip_matches_upstream():
    loss, metrics = call(ClippedPGLoss(LossConfig(reference_policy_kl_penalty=0.0)), CURR, batch(ADV, PREV, GEN))
    assert loss.item() == pytest.approx(-0.6333, abs=1e-4)
    assert metrics["probs_ratio"] == pytest.approx(1.0, abs=1e-4)
    assert metrics["clip_fraction"] == pytest.approx(2 / 3, abs=1e-4)


def test_clip_higher_uses_the_asymmetric_bound():
    loss, _ = call(ClippedPGLoss(LossConfig(reference_policy_kl_penalty=0.0, ratio_clip_max=0.28)), CURR,
                   batch(ADV, PREV, GEN))
    assert loss.item() == pytest.approx(-(0.5 - 1.0 + 2 * 1.28) / 3, abs=1e-4)  # [-0.5, 1.0, -2.56]


def test_kl_penalty_matches_upstream():
    curr = row([0.0, -1.0, -2.0])
    data = batch(row([0, 0, 0]), curr.clone(), curr.clone(), ref=row([-1.0, -1.0, -1.0]))
    loss, metrics = call(ClippedPGLoss(LossConfig(reference_policy_kl_penalty=0.1)), curr, data)
    assert loss.item() == pytest.approx(0.0362, abs=1e-4)
    assert metrics["kl_penalty"] == pytest.approx(0.362, abs=1e-3)


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


def test_an_all_zero_mask_gives_exactly_zero():
    data = batch(ADV, PREV, GEN, ref=row([-1.0] * 3), token_mask=(0, 0, 0, 0))
    loss, _ = call(ClippedPGLoss(LossConfig(reference_policy_kl_penalty=0.1)), CURR, data)
    assert loss.item() == 0.0


def test_masked_tokens_never_contribute_even_when_not_finite():
    curr = torch.tensor([[0.0, -1.0, -2.0, float("-inf")], [0.0, -1.0, -1.0, -1.0]])
    data = batch(torch.tensor([[0.0, 1, 1, float("nan")], [0.0, 5, 5, 5]]), curr.clone(), curr.clone(),
                 token_mask=(0, 1, 1, 0), sample_mask=(1.0, 0.0))
    loss, _ = call(ClippedPGLoss(LossConfig(reference_policy_kl_penalty=0.0)), curr, data)
    assert loss.item() == pytest.approx(-1.0)  # row 0, two tokens of -A*1; row 1 is sample-masked


def test_sequence_level_loss_averages_per_sequence_first():
    curr = torch.zeros(2, 4)
    adv = torch.tensor([[0.0, 1, 1, 1], [0.0, 4, 0, 0]])
    data = batch(adv, curr.clone(), curr.clone(), token_mask=(0, 1, 1, 1), sample_mask=(1.0, 1.0))
    data.token_mask[1] = torch.tensor([0.0, 1, 0, 0])
    token_loss, _ = call(ClippedPGLoss(LossConfig(reference_policy_kl_penalty=0.0)), curr, data)
    seq_loss, _ = call(ClippedPGLoss(LossConfig(reference_policy_kl_penalty=0.0, token_level_loss=False)), curr, data)
    assert token_loss.item() == pytest.approx(-(1 + 1 + 1 + 4) / 4)
    assert seq_loss.item() == pytest.approx(-(1 + 4) / 2)


def test_masked_mean_with_global_normaliser_sums_across_splits():
    values, mask = torch.randn(6, 5), (torch.rand(6, 5) > 0.3).float()
    whole = masked_mean(values, mask)
    parts = sum(masked_mean(values[i:i + 2], mask[i:i + 2], global_normalization=mask.sum()) for i in (0, 2, 4))
    torch.testing.assert_close(parts, whole)


# --- micro-batch invariance of a real optimizer step ------------------------------------------


def _policy(model_dir, micro, token_level=True, kl=0.0):
    from grpo_sdk.backends.hf.policy import HFPolicy
    from grpo_sdk.core.config_loader import load_config
    from grpo_sdk.core.context import RunContext
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
