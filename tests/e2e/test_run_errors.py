"""Bad input gets a clear answer naming the row, sample, path, step or quantity, and nothing is
silently corrupted: malformed data, long prompts, missing models, failing or NaN rewards,
non-finite losses and gradients.

Components the tests need (a flaky environment, a NaN estimator) are registered in-process
through the ``grpo_components`` hook, the way a notebook would.
"""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from grpo_sdk.core.errors import DataError, EnvironmentStepError, ModelLoadError, NonFiniteError
from grpo_sdk.core.records import EnvironmentReturn
from grpo_sdk.environments.reverse_digits import ReverseDigitsEnvironment
from grpo_sdk.plugins import ComponentSpec, hookimpl
from helpers import trainer_for


class FlakyEnvironment(ReverseDigitsEnvironment):
    """Reverse-digits scoring, except that prompts starting with 7 raise and with 9 score NaN."""

    def step(self, message_logs, metadata):
        if any(log[0].content.startswith("7") for log in message_logs):
            raise ValueError("cannot score a 7")
        ret = super().step(message_logs, metadata)
        rewards = [math.nan if log[0].content.startswith("9") else r
                   for log, r in zip(message_logs, ret.rewards["correct_digits"])]
        return EnvironmentReturn(rewards={"correct_digits": rewards}, metrics=ret.metrics)

    def sample_prompts(self, num_prompts, rng):
        prompts = super().sample_prompts(num_prompts, rng)
        lead = "79" + "0123456789" * num_prompts
        return [(lead[i] + text[1:], {"target": meta["target"][:-1] + lead[i]})
                for i, (text, meta) in enumerate(prompts)]


class NaNEstimator:
    def __init__(self, config, context):
        pass

    def compute_advantages(self, batch):
        return torch.full(batch.mask.shape, math.nan)


class Components:
    @hookimpl
    def grpo_components(self):
        return [ComponentSpec(name="flaky", kind="environment", impl=f"{__name__}:FlakyEnvironment",
                              config="grpo_sdk.environments.specs:ReverseDigitsConfig",
                              capabilities={"generates_prompts"}),
                ComponentSpec(name="nan_adv", kind="estimator", impl=f"{__name__}:NaNEstimator")]


pytestmark = pytest.mark.hook_plugin(Components())  # the `registry` fixture registers them


def test_malformed_dataset_row_is_named_by_line(registry, tmp_path, tiny_model_dir):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "12345>", "target": "54321"}\n{"prompt": "123\n')
    with pytest.raises(DataError, match=r"prompts.jsonl line 2: not valid JSON"):
        trainer_for(registry, tmp_path, tiny_model_dir, f"data.train_path={data}")


def test_dataset_row_without_prompt_key_is_named(registry, tmp_path, tiny_model_dir):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "12345>"}\n\n{"question": "x"}\n')
    with pytest.raises(DataError, match=r"line 3: no 'prompt' key .*keys: \['question'\]"):
        trainer_for(registry, tmp_path, tiny_model_dir, f"data.train_path={data}")


def test_prompt_longer_than_the_context_is_named(registry, tmp_path, tiny_model_dir):
    data = tmp_path / "prompts.jsonl"
    rows = [{"prompt": "12345>", "target": "54321"}] * 3 + [{"prompt": "1" * 80 + ">", "target": "1"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError, match=r"prompts.jsonl line 4: prompt is 82 tokens, longer than the 59"):
        trainer_for(registry, tmp_path, tiny_model_dir, f"data.train_path={data}", "data.shuffle=false")


def test_missing_model_directory_names_the_path(registry, tmp_path):
    with pytest.raises(ModelLoadError, match=r"policy.model_name: no model directory at /nonexistent/model"):
        trainer_for(registry, tmp_path, "/nonexistent/model")


def test_failing_environment_names_the_sample(registry, tmp_path, tiny_model_dir):
    trainer = trainer_for(registry, tmp_path, tiny_model_dir, "env.name=flaky")
    with pytest.raises(EnvironmentStepError, match=r"'flaky' failed on sample 0 \(flaky prompt 0, prompt '7.*ValueError: "
                                                   r"cannot score a 7"):
        trainer.train()


def test_masked_reward_failures_leave_the_loss_and_are_counted(registry, tmp_path, tiny_model_dir):
    trainer = trainer_for(registry, tmp_path, tiny_model_dir, "env.name=flaky", "env.on_reward_error=mask",
                          "grpo.num_prompts_per_step=8", "grpo.num_generations_per_prompt=8")
    metrics, rollouts = trainer.train_step()
    # prompt 0 raises and prompt 1 scores NaN: their 16 of 64 rows are masked, the rest train
    assert metrics["reward/num_failed"] == 16
    assert rollouts.reward_valid.tolist() == [False] * 16 + [True] * 48
    assert math.isfinite(metrics["loss"]) and math.isfinite(metrics["reward/mean"])
    assert 0 < metrics["grad_norm"] < math.inf


def test_nan_loss_stops_before_the_optimizer_step(registry, tmp_path, tiny_model_dir):
    trainer = trainer_for(registry, tmp_path, tiny_model_dir, "grpo.adv_estimator.name=nan_adv")
    before = {k: v.clone() for k, v in trainer.components.policy.model.state_dict().items()}
    with pytest.raises(NonFiniteError, match=r"step 1: loss is nan in optimizer step 1, rows 0\.\.15"):
        trainer.train()
    assert all(torch.equal(before[k], v) for k, v in trainer.components.policy.model.state_dict().items())


def test_infinite_gradient_names_the_parameter(registry, tmp_path, tiny_model_dir):
    trainer = trainer_for(registry, tmp_path, tiny_model_dir)
    weight = dict(trainer.components.policy.model.named_parameters())["transformer.h.1.mlp.c_fc.weight"]
    weight.register_hook(lambda grad: grad * math.inf)
    before = weight.detach().clone()
    with pytest.raises(NonFiniteError, match=r"step 1: gradient norm is (inf|nan) in optimizer step 1 "
                                             r"\(first non-finite gradient: transformer\.h\.1\.mlp\.c_fc\.weight\)"):
        trainer.train()
    assert torch.equal(weight.detach(), before)


def test_random_rewards_do_not_need_a_real_model(registry):
    """The flaky environment itself behaves as the tests above assume."""
    env = FlakyEnvironment(None, None)
    prompts = env.sample_prompts(3, random.Random(0))
    assert [p[0][0] for p in prompts] == ["7", "9", "0"]
