"""Every estimator, loss variant and reward-pipeline switch trains a few steps of the built-in
recipe (tiny GPT-2, reverse digits) through the real loop without a NaN, and moves the weights."""

from __future__ import annotations

import math

import pytest
import torch

from grpo_sdk.core.records import EnvironmentReturn
from grpo_sdk.environments.reverse_digits import ReverseDigitsEnvironment
from grpo_sdk.plugins import ComponentSpec, hookimpl
from helpers import small_trainer

IS = "loss_fn.use_importance_sampling_correction=true"
KL = "loss_fn.reference_policy_kl_penalty=0.05"
OFF_POLICY = "policy.train_global_batch_size=8"  # two optimizer steps per rollout: real old logprobs, ratios != 1

VARIANTS = {
    # estimators
    "grpo": [],
    "dr_grpo": ["grpo.adv_estimator.grpo.normalize_rewards=false", "grpo.adv_estimator.grpo.use_leave_one_out_baseline=false"],
    "rloo": ["grpo.adv_estimator.name=rloo"],
    "gdpo": ["grpo.adv_estimator.name=gdpo", "env.name=reverse_two_rewards", "grpo.adv_estimator.gdpo.reward_weights=[1.0, 0.5]"],
    "reinforce_plus_plus": ["grpo.adv_estimator.name=reinforce_plus_plus"],
    "reinforce_plus_plus_kl_in_reward": ["grpo.adv_estimator.name=reinforce_plus_plus", KL, "loss_fn.use_kl_in_reward=true"],
    "opd": ["grpo.adv_estimator.name=opd", "on_policy_distillation.teacher_model={teacher_dir}"],
    # loss variants
    "kl_k1": [KL, "loss_fn.reference_policy_kl_type=k1"],
    "kl_k2": [KL, "loss_fn.reference_policy_kl_type=k2"],
    "kl_k3_top_k_top_p": [KL, "policy.generation.top_k=8", "policy.generation.top_p=0.9"],
    "kl_on_policy_approximation": [KL, "loss_fn.use_on_policy_kl_approximation=true"],
    "off_policy_clip_higher": [OFF_POLICY, "loss_fn.ratio_clip_max=0.28"],
    "dual_clip": [OFF_POLICY, "loss_fn.ratio_clip_c=3"],
    "sequence_level_loss": ["loss_fn.token_level_loss=false"],
    "gspo": [OFF_POLICY, "loss_fn.sequence_level_importance_ratios=true", "loss_fn.token_level_loss=false"],
    "reinforce": ["loss_fn.disable_ppo_ratio=true"],
    "force_on_policy": ["loss_fn.force_on_policy_ratio=true"],
    "is_tis": [IS, "loss_fn.truncated_importance_sampling_type=tis", "loss_fn.truncated_importance_sampling_ratio=2.0"],
    "is_icepop": [IS, "loss_fn.truncated_importance_sampling_type=icepop",
                  "loss_fn.truncated_importance_sampling_ratio=5.0", "loss_fn.truncated_importance_sampling_ratio_min=0.2"],
    "is_seq_mask_tis": [IS, "loss_fn.truncated_importance_sampling_type=seq-mask-tis",
                        "loss_fn.truncated_importance_sampling_ratio=1.01", "loss_fn.truncated_importance_sampling_ratio_min=0.99"],
    "cispo": [IS, "loss_fn.use_cispo=true", "loss_fn.ratio_clip_min=1.0", "loss_fn.ratio_clip_max=5.0"],
    "positive_nll": ["loss_fn.positive_example_nll_weight=0.1"],
    "seq_logprob_error_mask": ["grpo.seq_logprob_error_threshold=1.5"],
    "seq_logprob_error_in_loss": ["grpo.seq_logprob_error_threshold=1.5", "loss_fn.seq_logprob_error_in_loss=true",
                                  "loss_fn.force_on_policy_ratio=true"],
    # reward pipeline
    "dynamic_sampling": ["grpo.use_dynamic_sampling=true", "grpo.batch_multiplier=2",
                         "grpo.dynamic_sampling_max_gen_batches=30"],
    "scaling_and_dapo_shaping": ["grpo.reward_scaling.enabled=true", "grpo.reward_scaling.target_min=-1",
                                 "grpo.reward_shaping.enabled=true", "grpo.reward_shaping.overlong_buffer_length=2",
                                 "grpo.reward_shaping.overlong_buffer_penalty=0.5"],
    "stop_properly_and_overlong_filtering": ["policy.generation.max_new_tokens=6", "grpo.reward_shaping.enabled=true",
                                             "grpo.reward_shaping.stop_properly_penalty_coef=0.5",
                                             "grpo.overlong_filtering=true"],
    "advantage_clipping": ["grpo.advantage_clip_low=-1", "grpo.advantage_clip_high=1"],
}


class TwoRewards(ReverseDigitsEnvironment):
    """Reverse digits with two named components, for GDPO."""

    def step(self, message_logs, metadata):
        ret = super().step(message_logs, metadata)
        exact = [float(log[-1].content == meta["target"]) for log, meta in zip(message_logs, metadata)]
        return EnvironmentReturn(rewards={"correct_digits": ret.rewards["correct_digits"], "exact": exact},
                                 metrics=ret.metrics)


class Components:
    @hookimpl
    def grpo_components(self):
        # No config class: ReverseDigitsConfig declares how many components reverse_digits reports
        # (DeclaresRewardComponents), which this subclass changes.
        return [ComponentSpec(name="reverse_two_rewards", kind="environment", impl=f"{__name__}:TwoRewards",
                              capabilities={"generates_prompts"})]


pytestmark = pytest.mark.hook_plugin(Components())  # the `registry` fixture registers them


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """Another tiny GPT-2 with the same tokenizer and different weights: a distillation teacher."""
    from grpo_sdk.recipes.tiny_model import build_tiny_gpt2

    return build_tiny_gpt2(tmp_path_factory.mktemp("teacher"), seed=1)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_trains_without_nan(name, registry, tmp_path, tiny_model_dir, teacher_dir):
    overrides = [o.format(teacher_dir=teacher_dir) for o in VARIANTS[name]]
    trainer = small_trainer(registry, tmp_path / "run", tiny_model_dir, "policy.train_micro_batch_size=5", *overrides)
    before = {k: v.clone() for k, v in trainer.components.policy.model.state_dict().items()}
    for _ in range(3):
        metrics, _ = trainer.train_step()
        trainer.state.step += 1
        bad = {k: v for k, v in metrics.items() if not math.isfinite(v) and not k.endswith(("_min", "_max"))}
        assert not bad, f"non-finite metrics: {bad}"
    after = trainer.components.policy.model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before), "three steps left the weights unchanged"
    for key in ("loss", "grad_norm", "token_mult_prob_error", "reward/mean"):
        assert key in metrics


def test_opd_advantages_are_teacher_minus_student_logprobs(registry, tmp_path, tiny_model_dir, teacher_dir):
    """The synchronous loop feeds the teacher's logprobs to the opd estimator (NeMo-RL only did in async)."""
    trainer = small_trainer(registry, tmp_path / "run", tiny_model_dir, "grpo.num_prompts_per_step=2",
                            "grpo.num_generations_per_prompt=2", "grpo.adv_estimator.name=opd",
                            f"on_policy_distillation.teacher_model={teacher_dir}")
    seen = {}
    train = trainer.components.policy.train
    trainer.components.policy.train = lambda batch, loss_fn: seen.setdefault("batch", batch) and train(batch, loss_fn)
    metrics, _ = trainer.train_step()
    batch = seen["batch"]
    expected = (trainer.components.teacher.logprobs(batch) - batch.prev_logprobs) * batch.token_mask
    torch.testing.assert_close(batch.advantages, expected)
    assert metrics["on_policy_distillation/teacher_student_logprob_gap_mean"] != 0
