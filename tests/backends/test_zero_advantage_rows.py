"""policy.hf.skip_zero_advantage_rows: rows whose advantages are all 0 add nothing to the loss, so the
hf policy may leave them out of the training passes; the gradient, the loss and the optimizer's
trajectory are those of training every row (up to float summation order)."""

from __future__ import annotations

import pytest
import torch
from test_sequence_packing import DYNAMIC, model_dirs, ragged_rows  # noqa: F401 - model_dirs is a fixture

from grpo_sdk.algorithms.loss import ClippedPGLoss
from grpo_sdk.backends.hf.config import HFPolicyConfig
from grpo_sdk.config.schema import LossConfig
from grpo_sdk.core.records import TrainBatch
from grpo_sdk.plugins import ZeroGradientRows


def batch(idle_rows: tuple[int, ...], rows: int = 8) -> TrainBatch:
    ids, mask, token_mask = ragged_rows(seed=1, rows=rows)
    g = torch.Generator().manual_seed(4)
    advantages = torch.randn(rows, 1, generator=g).expand(rows, ids.shape[1]).clone()
    advantages[list(idle_rows)] = 0.0
    return TrainBatch(input_ids=ids, attention_mask=mask, token_mask=token_mask, sample_mask=torch.ones(rows),
                      generation_logprobs=torch.full(ids.shape, -1.0), group_ids=torch.arange(rows) // 4,
                      rewards=torch.zeros(rows), advantages=advantages)


def test_the_loss_names_rows_with_zero_advantages_only_when_nothing_else_reads_them():
    loss = ClippedPGLoss(LossConfig(reference_policy_kl_penalty=0.0))
    assert isinstance(loss, ZeroGradientRows)
    data = batch(idle_rows=(0, 1, 2, 3))
    data.sample_mask[5] = 0.0  # a masked row adds nothing either
    assert loss.zero_gradient_rows(data).tolist() == [True] * 4 + [False, True, False, False]
    for config in (LossConfig(reference_policy_kl_penalty=0.01),
                   LossConfig(reference_policy_kl_penalty=0.0, positive_example_nll_weight=0.1)):
        assert ClippedPGLoss(config).zero_gradient_rows(data) is None


def make(model_dir, skip: bool, *overrides):
    from grpo_sdk.backends.hf.policy import HFPolicy
    from grpo_sdk.config.loading import load_config
    from grpo_sdk.config.context import RunContext
    from grpo_sdk.plugins.registry import Registry

    cfg = load_config(None, [f"policy.model_name={model_dir}", "policy.train_micro_batch_size=2",
                             "policy.max_total_sequence_length=16", "policy.generation.max_new_tokens=8",
                             "policy.optimizer.lr=0.001", "grpo.num_prompts_per_step=2",
                             "grpo.num_generations_per_prompt=4", "loss_fn.reference_policy_kl_penalty=0",
                             *overrides], Registry.discover())
    context = RunContext(config=cfg, run_dir=model_dir, model_path=str(model_dir), tokenizer_path=str(model_dir),
                         device="cpu", seed=0, needs_reference=False)
    return HFPolicy(HFPolicyConfig(skip_zero_advantage_rows=skip), context), cfg


@pytest.mark.parametrize("batching", [(), DYNAMIC], ids=["padded", "dynamic_batching"])
@pytest.mark.parametrize("idle", [(0, 1, 2, 3), tuple(range(8))], ids=["half", "all"])
def test_skipping_trains_fewer_rows_to_the_same_weights(model_dirs, batching, idle):
    runs = {}
    for skip in (False, True):
        policy, cfg = make(model_dirs["llama"], skip, *batching)
        rows_run = []
        policy.model.model.embed_tokens.register_forward_hook(
            lambda module, args, out: rows_run.append(args[0].shape[0]) if torch.is_grad_enabled() else None)
        data = batch(idle)
        metrics = [policy.train(data, ClippedPGLoss(cfg.loss_fn)) for _ in range(2)]  # Adam's moments carry over
        runs[skip] = (sum(rows_run), metrics, [p.detach().clone() for p in policy.params], policy.optimizer_steps)
    (all_rows, full, weights, steps), (some_rows, skipped, skipped_weights, skipped_steps) = runs[False], runs[True]
    assert all_rows == 16 and some_rows == 2 * max(1, 8 - len(idle))  # one row still runs when none is needed
    assert steps == skipped_steps == 2
    for a, b in zip(weights, skipped_weights):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)
    for got, want in zip(skipped, full):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-4, abs=1e-7)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4, abs=1e-7)
        assert got["skipped_zero_advantage_rows"] == 8 - max(1, 8 - len(idle))
        if len(idle) < 8:  # means over the rows trained on: the ratio of an on-policy step is 1 there too
            assert got["probs_ratio"] == pytest.approx(1.0, abs=1e-5) and want["probs_ratio"] == pytest.approx(1.0)
    if len(idle) < 8:
        assert full[0]["grad_norm"] > 0  # not vacuous


def test_a_kl_penalty_keeps_every_row(model_dirs):
    policy, cfg = make(model_dirs["llama"], True, "loss_fn.reference_policy_kl_penalty=0.01")
    data = batch((0, 1, 2, 3))
    data.reference_logprobs = torch.zeros(data.input_ids.shape)
    assert "skipped_zero_advantage_rows" not in policy.train(data, ClippedPGLoss(cfg.loss_fn))
