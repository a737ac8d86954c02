"""Config-time validation of incompatible algorithm switches: each is a ConfigError naming the
keys, raised by `load_config` before any model is loaded (and so by `grpoctl config validate`)."""

from __future__ import annotations

import pytest

from grpo_sdk.core.config_loader import load_config
from grpo_sdk.plugins.registry import Registry
from conftest import config_problems


@pytest.fixture(scope="module")
def registry():
    return Registry.discover()


@pytest.mark.parametrize("overrides, key, text", [
    (["loss_fn.force_on_policy_ratio=true", "policy.train_global_batch_size=64"],
     "loss_fn.force_on_policy_ratio", "train_global_batch_size == grpo.num_prompts_per_step x"),
    (["grpo.skip_reference_policy_logprobs_calculation=true", "loss_fn.reference_policy_kl_penalty=0.1"],
     "grpo.skip_reference_policy_logprobs_calculation", "reference_policy_kl_penalty == 0"),
    (["grpo.batch_multiplier=2"], "grpo.batch_multiplier", "use_dynamic_sampling=true"),
    (["grpo.reward_scaling.enabled=true", "grpo.reward_scaling.source_max=0"],
     "grpo.reward_scaling.source_max", "greater than grpo.reward_scaling.source_min"),
    (["grpo.reward_shaping.enabled=true"], "grpo.reward_shaping.overlong_buffer_length", "buffer length > 0"),
    (["grpo.reward_shaping.enabled=true", "grpo.reward_shaping.stop_properly_penalty_coef=1.5"],
     "grpo.reward_shaping.stop_properly_penalty_coef", "[0, 1]"),
    (["grpo.reward_shaping.enabled=true", "grpo.reward_shaping.overlong_buffer_length=10",
      "grpo.reward_shaping.overlong_buffer_penalty=1.0"], "grpo.reward_shaping.overlong_buffer_length",
     "exceeds the max response length 5"),
    (["grpo.advantage_clip_low=2", "grpo.advantage_clip_high=1"], "grpo.advantage_clip_low", "above"),
    (["grpo.seq_logprob_error_threshold=0.5"], "grpo.seq_logprob_error_threshold", "at least 1"),
    (["loss_fn.use_kl_in_reward=true"], "loss_fn.use_kl_in_reward", "silently vanish"),
    (["grpo.adv_estimator.name=opd"], "on_policy_distillation.teacher_model", "needs a teacher"),
    (["on_policy_distillation.teacher_model=/models/t"], "on_policy_distillation.teacher_model", "uses no teacher"),
    (["grpo.adv_estimator.name=opd", "on_policy_distillation.teacher_model=/t",
      "on_policy_distillation.teacher_backend=nope"], "on_policy_distillation.teacher_backend", "no policy backend"),
    (["loss_fn.sequence_level_importance_ratios=true"], "loss_fn.sequence_level_importance_ratios", "token_level_loss"),
    (["loss_fn.truncated_importance_sampling_type=tis"], "loss_fn.truncated_importance_sampling_type",
     "use_importance_sampling_correction"),
    (["loss_fn.ratio_clip_c=1.0"], "loss_fn.ratio_clip_c", "must be > 1"),
    (["loss_fn.truncated_importance_sampling_ratio=2.0"], "loss_fn.truncated_importance_sampling_ratio",
     "type is null"),
    (["loss_fn.use_importance_sampling_correction=true", "loss_fn.truncated_importance_sampling_type=icepop",
      "loss_fn.truncated_importance_sampling_ratio=2.0"], "loss_fn.truncated_importance_sampling_ratio_min",
     "must be set for icepop"),
    (["loss_fn.seq_logprob_error_in_loss=true"], "grpo.seq_logprob_error_threshold",
     "must be set with loss_fn.seq_logprob_error_in_loss=true"),
    (["loss_fn.seq_logprob_error_in_loss=true", "grpo.seq_logprob_error_threshold=2", "loss_fn.force_on_policy_ratio=true",
      "grpo.adv_estimator.name=opd", "on_policy_distillation.teacher_model=/t"], "loss_fn.seq_logprob_error_in_loss",
     "skips the old-logprob pass"),
    (["loss_fn.use_cispo=true", "loss_fn.ratio_clip_c=3"], "loss_fn.ratio_clip_c", "use_cispo"),
])
def test_incompatible_switches_are_config_errors(registry, overrides, key, text):
    found = config_problems(registry, *overrides)
    assert key in found, found
    assert text in found[key]


def test_every_problem_is_reported_at_once(registry):
    found = config_problems(registry, "grpo.batch_multiplier=2", "loss_fn.ratio_clip_c=0.5", "loss_fn.use_kl_in_reward=true",
                     "grpo.advantage_clip_low=1", "grpo.advantage_clip_high=0")
    assert {"grpo.batch_multiplier", "loss_fn.ratio_clip_c", "loss_fn.use_kl_in_reward",
            "grpo.advantage_clip_low"} <= set(found)


@pytest.mark.parametrize("overrides", [
    ["grpo.use_dynamic_sampling=true", "grpo.batch_multiplier=3"],
    ["loss_fn.force_on_policy_ratio=true"],
    ["grpo.adv_estimator.name=reinforce_plus_plus", "loss_fn.use_kl_in_reward=true"],
    ["grpo.adv_estimator.name=opd", "on_policy_distillation.teacher_model=/models/teacher"],
    ["loss_fn.use_importance_sampling_correction=true", "loss_fn.truncated_importance_sampling_type=tis",
     "loss_fn.truncated_importance_sampling_ratio=2.0"],
    ["loss_fn.sequence_level_importance_ratios=true", "loss_fn.token_level_loss=false"],
    ["grpo.reward_shaping.enabled=true", "grpo.reward_shaping.overlong_buffer_length=2",
     "grpo.reward_shaping.overlong_buffer_penalty=1.0"],
    ["grpo.seq_logprob_error_threshold=2.0", "loss_fn.seq_logprob_error_in_loss=true",
     "loss_fn.force_on_policy_ratio=true"],
])
def test_compatible_combinations_validate(registry, overrides):
    load_config(None, overrides, registry)


def test_config_validate_reports_algorithm_problems_without_torch(tmp_path):
    import subprocess
    import sys

    code = ("import sys\nfrom grpo_sdk.cli.app import main\n"
            "code = main(['config', 'validate', 'loss_fn.ratio_clip_c=0.5', 'grpo.batch_multiplier=2'])\n"
            "print('torch' in sys.modules, code)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert result.stdout.split() == ["False", "2"], result.stderr
    assert "loss_fn.ratio_clip_c" in result.stderr and "grpo.batch_multiplier" in result.stderr


def test_a_dataset_environment_without_validation_data_names_the_switches_that_are_on(registry):
    found = config_problems(registry, "env.name=math", "data.train_path=train.jsonl", "grpo.val_period=0")
    assert found["data.validation_path"].endswith(
        "(grpo.val_at_end=true): environment 'math' does not generate prompts; set grpo.val_at_end=false to train "
        "without validation")
    cfg = load_config(None, ["env.name=math", "data.train_path=train.jsonl", "grpo.val_period=0",
                             "grpo.val_at_end=false"], registry)
    assert cfg.data.validation_path is None
