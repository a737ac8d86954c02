"""Validation's own sampling (``policy.generation.val_temperature`` / ``val_top_p`` / ``val_top_k``,
NeMo-RL's keys): greedy held-out accuracy while training samples at its own temperature."""

from __future__ import annotations

import pytest

from helpers import config_problems, small_trainer

from grpo_sdk.algorithms.sampling import validation_sampling
from grpo_sdk.config.schema import GenerationConfig
from grpo_sdk.core.records import SamplingParams

TRAIN = SamplingParams(max_new_tokens=5, temperature=0.7, top_p=0.9, top_k=None, seed=None)


def test_unset_keys_keep_the_training_sampling():
    assert validation_sampling(TRAIN, GenerationConfig(), seed=3) == SamplingParams(
        max_new_tokens=5, temperature=0.7, top_p=0.9, top_k=None, seed=3)


def test_zero_temperature_is_greedy_and_set_keys_win():
    greedy = validation_sampling(TRAIN, GenerationConfig(val_temperature=0.0), seed=1)
    assert (greedy.temperature, greedy.top_k, greedy.top_p) == (1.0, 1, 0.9)
    other = validation_sampling(TRAIN, GenerationConfig(val_temperature=1.3, val_top_p=0.5, val_top_k=7), seed=1)
    assert (other.temperature, other.top_p, other.top_k) == (1.3, 0.5, 7)


@pytest.mark.parametrize("override, key", [("policy.generation.val_temperature=-1", "val_temperature"),
                                           ("policy.generation.val_top_p=0", "val_top_p"),
                                           ("policy.generation.val_top_k=-2", "val_top_k")])
def test_bad_values_are_config_errors(registry, override, key):
    assert f"policy.generation.{key}" in config_problems(registry, override)


def test_greedy_validation_is_the_argmax_whatever_the_seed(registry, tmp_path, tiny_model_dir):
    greedy = small_trainer(registry, tmp_path / "g", tiny_model_dir, "policy.generation.val_temperature=0",
                           "grpo.max_val_samples=8")
    first, batches = greedy.validate(0)
    again, _ = greedy.validate(5)  # another step: another seed, the same argmax
    assert first == again
    sampled = small_trainer(registry, tmp_path / "s", tiny_model_dir, "grpo.max_val_samples=8")
    texts = lambda bs: [log[-1].content for b in bs for log in b.message_logs]  # noqa: E731
    assert texts(batches) != texts(sampled.validate(0)[1])  # a random-init model at temperature 1 is not greedy


def test_greedy_keeps_one_token_of_a_tie_whatever_the_draw():
    """bfloat16 logits tie often: greedy must still be one token, the first maximal one (as argmax),
    not a draw among the tied ones that moves with the seed."""
    import torch

    from grpo_sdk.algorithms.sampling import process_logits
    from grpo_sdk.algorithms.sampling import sample_token

    logits = torch.tensor([[1.0, 3.0, 3.0, 0.5], [2.0, 2.0, 2.0, 2.0]], dtype=torch.bfloat16).float()
    kept = process_logits(logits, top_k=1)
    assert torch.isfinite(kept).tolist() == [[False, True, False, False], [True, False, False, False]]
    greedy = SamplingParams(max_new_tokens=1, temperature=1.0, top_k=1)
    for seed in range(20):
        token, logprob = sample_token(logits, greedy, torch.Generator().manual_seed(seed))
        assert token.tolist() == [1, 0] and logprob.tolist() == [0.0, 0.0]
    two = process_logits(logits, top_k=2)  # k > 1 keeps every token at least the k-th value, ties included
    assert torch.isfinite(two).sum(-1).tolist() == [2, 4]
