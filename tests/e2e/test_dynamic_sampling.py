"""Rollout batches across generation rounds, dynamic sampling in the real loop, and the reward
pipeline's place in a step (scaling, shaping, overlong filtering, advantage clipping)."""

from __future__ import annotations

import pytest
import torch

from grpo_sdk.algorithms.rewards import trivial_groups
from grpo_sdk.core.errors import GrpoSdkError
from grpo_sdk.core.records import EnvironmentReturn, Message
from grpo_sdk.rollouts.rollout import RolloutBatch
from grpo_sdk.environments.reverse_digits import ReverseDigitsEnvironment
from grpo_sdk.plugins import ComponentSpec, hookimpl
from helpers import trainer_for


def rollouts(prompts, responses, group_offset=0, pad=0):
    """A RolloutBatch from token lists: prompts left-padded, responses right-padded."""
    from grpo_sdk.plugins.tensors import left_pad

    prompt_ids, prompt_mask = left_pad(prompts, pad)
    width = max(len(r) for r in responses)
    response_ids = torch.tensor([r + [pad] * (width - len(r)) for r in responses])
    logprobs = torch.tensor([[-0.1 * (i + 1)] * len(r) + [0.0] * (width - len(r)) for i, r in enumerate(responses)])
    rows = len(prompts)
    return RolloutBatch(
        prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
        response_lengths=torch.tensor([len(r) for r in responses]), generation_logprobs=logprobs,
        truncated=torch.zeros(rows, dtype=torch.bool), group_ids=torch.arange(rows) // 2 + group_offset,
        reward_components={"r": torch.arange(rows, dtype=torch.float32)}, reward_valid=torch.ones(rows, dtype=torch.bool),
        reward_missing=torch.zeros(rows, dtype=torch.bool),
        message_logs=[[Message(role="user", content=str(i))] for i in range(rows)], metadata=[{"i": i} for i in range(rows)],
        pad_token_id=pad, rewards=torch.arange(rows, dtype=torch.float32))


def unpadded_rows(batch):
    train = batch.to_train_batch(torch.ones(batch.batch_size))
    out = []
    for i in range(batch.batch_size):
        tokens = train.input_ids[i][train.attention_mask[i].bool()].tolist()
        gen = train.generation_logprobs[i][train.token_mask[i].bool()].tolist()
        out.append((tokens, gen))
    return out


def test_concat_repads_prompts_left_and_responses_right():
    a = rollouts([[5, 6], [5, 6]], [[7], [8, 9, 10]])
    b = rollouts([[1, 2, 3, 4], [1, 2, 3, 4]], [[11, 12], [13]], group_offset=1)
    both = RolloutBatch.concat([a, b])
    assert both.prompt_ids.shape == (4, 4) and both.response_ids.shape == (4, 3)
    assert unpadded_rows(both) == unpadded_rows(a) + unpadded_rows(b)
    assert both.group_ids.tolist() == [0, 0, 1, 1] and [m["i"] for m in both.metadata] == [0, 1, 0, 1]


def test_select_keeps_rows_in_order_with_their_lists():
    batch = rollouts([[1], [2], [3], [4]], [[5], [6], [7], [8]])
    picked = batch.select(torch.tensor([False, True, False, True]))
    assert picked.response_ids[:, 0].tolist() == [6, 8] and [m["i"] for m in picked.metadata] == [1, 3]
    assert picked.reward_components["r"].tolist() == [1.0, 3.0]


class ConstantEnvironment(ReverseDigitsEnvironment):
    """Every response scores 0.5: every group is trivial."""

    def step(self, message_logs, metadata):
        return EnvironmentReturn(rewards={"flat": [0.5] * len(message_logs)})


class Components:
    @hookimpl
    def grpo_components(self):
        return [ComponentSpec(name="constant", kind="environment", impl=f"{__name__}:ConstantEnvironment",
                              capabilities={"generates_prompts"})]


pytestmark = pytest.mark.hook_plugin(Components())  # the `registry` fixture registers them


def test_dynamic_sampling_keeps_only_groups_with_a_signal(registry, tmp_path, tiny_model_dir):
    trainer = trainer_for(registry, tmp_path, tiny_model_dir, "grpo.use_dynamic_sampling=true",
                          "grpo.batch_multiplier=2", "grpo.dynamic_sampling_max_gen_batches=30")
    batch, metrics = trainer.collect_rollouts()
    assert batch.batch_size == 16
    assert not trivial_groups(batch.unshaped_rewards, batch.group_ids).any()
    assert metrics["dynamic_sampling_num_gen_batches"] >= 1
    assert 0 <= metrics["trivial_group_fraction"] <= 1
    assert metrics["dynamic_sampling_num_discarded_valid_samples"] >= 0 and "filtered_reward" in metrics
    # the groups that were kept are whole groups of 4 rows
    assert torch.bincount(torch.unique(batch.group_ids, return_inverse=True)[1]).tolist() == [4, 4, 4, 4]
    metrics, _ = trainer.train_step()  # and a full step trains on it
    assert metrics["grad_norm"] > 0


def test_dynamic_sampling_gives_up_with_a_clear_error(registry, tmp_path, tiny_model_dir):
    trainer = trainer_for(registry, tmp_path, tiny_model_dir, "env.name=constant", "grpo.use_dynamic_sampling=true",
                          "grpo.dynamic_sampling_max_gen_batches=3")
    with pytest.raises(GrpoSdkError, match=r"found 0 of the 16 rows it needs in 3 generation batches of 4 prompts"):
        trainer.collect_rollouts()


def test_without_dynamic_sampling_trivial_groups_are_counted_not_dropped(registry, tmp_path, tiny_model_dir):
    trainer = trainer_for(registry, tmp_path, tiny_model_dir, "env.name=constant")
    batch, metrics = trainer.collect_rollouts()
    assert batch.batch_size == 16 and metrics["trivial_group_fraction"] == 1.0
    metrics, _ = trainer.train_step()
    assert metrics["advantages/max"] == 0 and metrics["advantages/min"] == 0  # no signal, no update direction


def test_scaling_shaping_filtering_and_clipping_in_a_step(registry, tmp_path, tiny_model_dir):
    trainer = trainer_for(registry, tmp_path, tiny_model_dir, "grpo.reward_scaling.enabled=true",
                          "grpo.reward_scaling.target_min=-1", "grpo.reward_shaping.enabled=true",
                          "grpo.reward_shaping.stop_properly_penalty_coef=0.5", "grpo.overlong_filtering=true",
                          "grpo.advantage_clip_low=-0.5", "grpo.advantage_clip_high=0.5")
    batch, _ = trainer.collect_rollouts()
    raw = batch.reward_components["correct_digits"]  # scaled from [0, 1] to [-1, 1]
    assert raw.min() >= -1 and raw.max() <= 1
    expected = torch.where(batch.truncated, raw * 0.5, raw)  # stop-properly penalty on truncated rows
    torch.testing.assert_close(batch.rewards, expected)
    metrics, rollouts = trainer.train_step()
    assert -0.5 <= metrics["advantages/min"] and metrics["advantages/max"] <= 0.5
    assert metrics["truncated_fraction"] > 0  # 5 new tokens and no EOS: most responses are truncated


def test_step_rollouts_serve_any_target_step_with_their_own_counters(registry, tmp_path, tiny_model_dir):
    """The async collector (issue 15) calls StepRollouts per target step with counters it owns; the
    group ids continue from those counters and the failure window is theirs."""
    from types import SimpleNamespace

    trainer = trainer_for(registry, tmp_path, tiny_model_dir)
    step_rollouts = trainer.components.step_rollouts
    counters = SimpleNamespace(next_group_id=40, reward_failures=[])
    batch, _ = step_rollouts.collect(7, counters)
    assert counters.next_group_id == 44 and sorted(set(batch.group_ids.tolist())) == [40, 41, 42, 43]
    assert counters.reward_failures == [[0, 16]] and trainer.state.next_group_id == 0  # the trainer's untouched
    counters.reward_failures = [[16, 16]] * 9  # nine failed batches in the window: the tenth decides
    batch.reward_valid[:] = False
    with pytest.raises(GrpoSdkError, match="every one of the 16 samples of step 7 failed"):
        step_rollouts.check_reward_failures(batch, 7, counters)
