"""Entry-point targets and config classes of the built-in estimators (light: no torch).

Capabilities tell the training loop what an estimator needs beyond rewards, without the loop
knowing estimator names: ``prev_logprobs`` (real old-policy logprobs, not the detached current
ones), ``teacher_logprobs`` (a teacher model under ``on_policy_distillation``),
``kl_in_reward`` (it folds ``loss_fn.use_kl_in_reward``'s KL into the advantages),
``group_baseline`` (the advantage is relative to the group, so a group of one carries no signal:
``num_generations_per_prompt: 1`` is a config error).
"""

from __future__ import annotations

import attrs

from typing import TYPE_CHECKING, Any

from grpo_sdk.plugins import ComponentSpec, DeclaresRewardComponents, option

if TYPE_CHECKING:
    from grpo_sdk.plugins.toolkit import MasterConfig

MULTI_REWARD_HINT = ("use an environment whose reward has several named components: "
                     "env.reverse_digits.format_weight=0.1 (correct_digits and format), or env.name=reward_functions "
                     "with several env.reward_functions.functions")


@attrs.frozen(kw_only=True)
class GRPOEstimatorConfig:
    normalize_rewards: bool = option(True, "Divide by the group's reward std (+1e-6) where it is > 0; "
                                     "false is Dr.GRPO.")
    use_leave_one_out_baseline: bool = option(True, "Baseline is the mean of the *other* rows of the group "
                                              "(RLOO), and the std is theirs too.")


@attrs.frozen(kw_only=True)
class GDPOEstimatorConfig:
    normalize_rewards: bool = option(True, "Per component: divide by the group's std (+1e-6) where it is > 0.")
    use_leave_one_out_baseline: bool = option(True, "Per component: leave-one-out baseline and std.")
    reward_weights: list[float] | None = option(None, "Weight of each reward component, in the alphabetical "
                                                "order of their names; null weighs all 1.")


def check_gdpo(config: MasterConfig, options: GDPOEstimatorConfig | None, registry: Any) -> list[tuple[str, str]]:
    """gdpo against the environment's reward components, when its config block declares how many
    (``DeclaresRewardComponents``): at least two, and one weight per component."""
    env = config.env
    block = env.structured_blocks.get(env.name)
    if not isinstance(block, DeclaresRewardComponents):
        return []
    count = block.num_reward_components()
    if count < 2:
        return [("grpo.adv_estimator.name", f"gdpo weighs several reward components, but environment {env.name!r} "
                 f"as configured reports {count}; {MULTI_REWARD_HINT}, or use grpo for a single reward")]
    weights = options.reward_weights if options is not None else None
    if weights is not None and len(weights) != count:
        return [("grpo.adv_estimator.reward_weights", f"{len(weights)} weights for the {count} reward components "
                 f"of environment {env.name!r}; give one per component (in the alphabetical order of their "
                 "names), or null for all 1")]
    return []


@attrs.frozen(kw_only=True)
class ReinforcePlusPlusConfig:
    minus_baseline: bool = option(True, "Subtract the group's mean reward before the batch whitening.")


GRPO = ComponentSpec(
    name="grpo",
    kind="estimator",
    impl="grpo_sdk.estimators.grpo:GRPOEstimator",
    config="grpo_sdk.estimators.specs:GRPOEstimatorConfig",
    capabilities={"group_baseline"},
    summary="Group-relative advantages: leave-one-out or group-mean baseline, optional std normalization.",
)

RLOO = ComponentSpec(
    name="rloo",
    kind="estimator",
    impl="grpo_sdk.estimators.rloo:RLOOEstimator",
    capabilities={"group_baseline"},
    summary="REINFORCE leave-one-out: reward minus the mean of the group's other rewards, no std normalization.",
)

GDPO = ComponentSpec(
    name="gdpo",
    kind="estimator",
    impl="grpo_sdk.estimators.gdpo:GDPOEstimator",
    config="grpo_sdk.estimators.specs:GDPOEstimatorConfig",
    capabilities={"group_baseline"},
    check="grpo_sdk.estimators.specs:check_gdpo",
    summary="Multi-reward: one GRPO advantage per reward component, weighted sum, whitened over the batch.",
)

REINFORCE_PLUS_PLUS = ComponentSpec(
    name="reinforce_plus_plus",
    kind="estimator",
    impl="grpo_sdk.estimators.reinforce_plus_plus:ReinforcePlusPlusEstimator",
    config="grpo_sdk.estimators.specs:ReinforcePlusPlusConfig",
    capabilities={"kl_in_reward"},
    summary="REINFORCE++: optional group-mean baseline, optional KL in the reward, masked batch whitening.",
)

OPD = ComponentSpec(
    name="opd",
    kind="estimator",
    impl="grpo_sdk.estimators.opd:OPDEstimator",
    capabilities={"prev_logprobs", "teacher_logprobs"},
    summary="On-policy distillation: per-token teacher minus student logprobs.",
)
