"""Config-time validation of incompatible algorithm switches: each is a ConfigError naming the
keys, raised by `load_config` before any model is loaded (and so by `grpoctl config validate`)."""

from __future__ import annotations

import json

import pytest

from grpo_sdk.config.loading import load_config
from helpers import config_problems


@pytest.mark.parametrize("overrides, key, text", [
    (["loss_fn.force_on_policy_ratio=true", "policy.train_global_batch_size=64"],
     "loss_fn.force_on_policy_ratio", "train_global_batch_size == grpo.num_prompts_per_step x"),
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


# --- issue 12: absurd sizes, the model's limits, metric names, configs that would do nothing ------


@pytest.mark.parametrize("overrides, key, text", [
    (["grpo.num_prompts_per_step=100000000000000000000"], "grpo.num_prompts_per_step", "fit in 64 bits"),
    (["grpo.num_prompts_per_step=2000000"], "grpo.num_prompts_per_step", "must be <= 1048576"),
    (["grpo.num_prompts_per_step=65536", "grpo.num_generations_per_prompt=32"], "grpo.num_prompts_per_step",
     "= 2,097,152 rows, more than the 1,048,576"),
    (["grpo.max_val_samples=1000000000"], "grpo.max_val_samples", "must be <= 1048576"),
    (["grpo.max_val_samples=4096", "grpo.val_num_generations_per_prompt=4096"], "grpo.max_val_samples",
     "grpo.max_val_samples x grpo.val_num_generations_per_prompt = 16,777,216 rows"),
    (["grpo.use_dynamic_sampling=true", "grpo.batch_multiplier=100000"], "grpo.batch_multiplier",
     "int(grpo.num_prompts_per_step x grpo.batch_multiplier)"),
    (["policy.generation.stop_token_ids=[3, -1]"], "policy.generation.stop_token_ids", "must be >= 0: -1"),
    (["policy.generation.stop_token_ids=[2, 25, 99]"], "policy.generation.stop_token_ids",
     "[25, 99] are not below vocab_size = 25 of built-in model builtin:tiny-gpt2"),
    (["policy.max_total_sequence_length=65"], "policy.max_total_sequence_length", "gives n_positions = 64"),
    (["policy.model_name=builtin:tiny-mistral"], "policy.model_name", "unknown built-in model 'builtin:tiny-mistral'"),
    (["policy.optimizer.betas=[0.9, 1.0]"], "policy.optimizer.betas", "each beta must be in [0, 1)"),
    (["policy.max_grad_norm=0"], "policy.max_grad_norm", "must be > 0"),
    (["cluster.num_threads=0"], "cluster.num_threads", "must be > 0"),
    (["cluster.startup_timeout_s=1e12"], "cluster.startup_timeout_s", "must be <= 2592000"),
    (["data.prompt_key="], "data.prompt_key", "must not be empty"),
    (["grpo.num_generations_per_prompt=1"], "grpo.num_generations_per_prompt", "every advantage is 0"),
    (["grpo.num_generations_per_prompt=1", "grpo.adv_estimator.name=rloo"], "grpo.num_generations_per_prompt",
     "estimator 'rloo'"),
    (["grpo.num_generations_per_prompt=1", "grpo.adv_estimator.name=reinforce_plus_plus"],
     "grpo.num_generations_per_prompt", "estimator 'reinforce_plus_plus'"),
    (["checkpointing.metric_name=val:acuracy"], "checkpointing.metric_name", "(did you mean 'val:accuracy'?)"),
    (["checkpointing.metric_name=val:env/exact_match"], "checkpointing.metric_name",
     "(did you mean 'val:exact_match'?)"),
    (["checkpointing.metric_name=train:grad_nrom"], "checkpointing.metric_name", "(did you mean 'train:grad_norm'?)"),
    (["grpo.stop_at_validation_metric=val/accuracy", "grpo.stop_at_validation_threshold=1"],
     "grpo.stop_at_validation_metric", "(did you mean 'accuracy'?)"),
    (["grpo.stop_at_validation_metric=accuracy", "grpo.stop_at_validation_threshold=1", "grpo.val_period=0"],
     "grpo.stop_at_validation_metric", "would never stop early"),
    (["data.prompt_template='Q: {prompt'"], "data.prompt_template", "is not a format string"),
    (["data.prompt_template='{0} {prompt}'"], "data.prompt_template", "positional field {0} has nothing to fill"),
    (["data.prompt_template='{prompt!x}'"], "data.prompt_template", "unknown conversion !x"),
    (["data.prompt_template='{prompt:>100000}'"], "data.prompt_template", "pads to more than 10,000 characters"),
    (["logger.log_dir=runs/" + "x" * 256], "logger.log_dir", "has a name of 256 bytes"),
])
def test_absurd_or_inert_settings_are_config_errors(registry, overrides, key, text):
    found = config_problems(registry, *overrides)
    assert key in found, found
    assert text in found[key]


@pytest.mark.parametrize("overrides", [
    ["grpo.num_generations_per_prompt=1", "grpo.adv_estimator.name=reinforce_plus_plus",
     "grpo.adv_estimator.reinforce_plus_plus.minus_baseline=false"],  # batch whitening: a signal without groups
    ["checkpointing.metric_name=train:reward/correct_digits"],  # a family components extend
    ["checkpointing.metric_name=val:pass_k", "grpo.val_num_generations_per_prompt=4"],
    ["policy.generation.stop_token_ids=[24]", "policy.max_total_sequence_length=64"],
    ["data.prompt_template='{{literal}} {prompt!r:>20} {answer[0]}'"],
])
def test_limits_accept_what_is_in_range(registry, overrides):
    load_config(None, overrides, registry)


def write_model(tmp_path, **config):
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_a_local_model_directory_bounds_the_context_and_the_token_ids(registry, tmp_path):
    model = write_model(tmp_path, model_type="llama", vocab_size=100, max_position_embeddings=48)
    found = config_problems(registry, f"policy.model_name={model}", "policy.generation.stop_token_ids=[100]")
    assert found["policy.max_total_sequence_length"].startswith(
        f"64 exceeds the model's context: {tmp_path}/config.json gives max_position_embeddings = 48")
    assert "vocab_size = 100" in found["policy.generation.stop_token_ids"]
    load_config(None, [f"policy.model_name={model}", "policy.max_total_sequence_length=48"], registry)


def test_context_follows_text_config_and_rope_scaling(tmp_path):
    from grpo_sdk.config.checks.model import context_length, model_facts

    model = write_model(tmp_path, text_config={"vocab_size": 10, "max_position_embeddings": 4096})
    assert model_facts(model)[1]["max_position_embeddings"] == 4096
    yarn = {"max_position_embeddings": 32768, "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                              "original_max_position_embeddings": 32768}}
    assert context_length(yarn) == ("max_position_embeddings x rope_scaling.factor", 131072)
    llama3 = {"max_position_embeddings": 131072, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}
    assert context_length(llama3) == ("max_position_embeddings", 131072)  # already the extended length
    assert context_length({"n_positions": 1024, "max_position_embeddings": 2048}) == ("n_positions", 1024)


def test_an_unreadable_model_config_is_left_to_the_model_loader(registry, tmp_path):
    (tmp_path / "config.json").write_bytes(b"\xff{not json")
    load_config(None, [f"policy.model_name={tmp_path}"], registry)


def without_declared_metrics(registry, monkeypatch):
    """reverse_digits as an environment that declares no metrics (as most third-party ones today)."""
    import attrs

    info = registry.info("environment", "reverse_digits")
    bare = attrs.evolve(info, spec=attrs.evolve(info.spec, metrics=()))
    monkeypatch.setattr(registry, "info", lambda kind, name, _real=registry.info: (
        bare if (kind, name) == ("environment", "reverse_digits") else _real(kind, name)))


def test_unknown_metric_names_are_loud_warnings_when_the_environment_declares_none(registry, caplog, monkeypatch):
    without_declared_metrics(registry, monkeypatch)
    load_config(None, ["checkpointing.metric_name=val:exact_match", "grpo.stop_at_validation_metric=exact_match",
                       "grpo.stop_at_validation_threshold=0.9"], registry)
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 2 and all("environment 'reverse_digits' reports it" in w for w in warned), warned
    assert warned[0].startswith("grpo-sdk: warning: grpo.stop_at_validation_metric: 'exact_match' is not one of")


def test_declared_environment_metrics_make_unknown_names_errors(registry, caplog):
    assert registry.info("environment", "reverse_digits").spec.metrics == {"exact_match", "format_fraction"}  # its spec
    load_config(None, ["checkpointing.metric_name=val:exact_match"], registry)
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    found = config_problems(registry, "checkpointing.metric_name=val:exakt_match")
    assert "(did you mean 'val:exact_match'?)" in found["checkpointing.metric_name"]
    found = config_problems(registry, "checkpointing.metric_name=val:bleu")
    assert found["checkpointing.metric_name"] == ("'val:bleu' is not a validation metric: those are accuracy, "
                                                  "avg_length, num_samples, pass_k, exact_match, format_fraction")


def test_a_batch_larger_than_this_machine_is_a_warning(registry, caplog, monkeypatch):
    from grpo_sdk.config.checks import model

    monkeypatch.setattr(model, "_physical_memory", lambda: 2**26)
    load_config(None, ["grpo.num_prompts_per_step=4096", "grpo.num_generations_per_prompt=16"], registry)
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warned == ["grpo-sdk: warning: grpo.num_prompts_per_step: the rollout batch of 65,536 rows x "
                      "policy.max_total_sequence_length=64 needs at least 128 MiB, more than this machine's 64 MiB"]
    caplog.clear()
    load_config(None, ["grpo.num_prompts_per_step=4096", "grpo.num_generations_per_prompt=16",
                       "cluster.runtime=ray", "cluster.address=auto"], registry)
    assert not [r for r in caplog.records if "rollout batch" in r.getMessage()]
