"""Entry-point targets and config classes of the built-in estimators (light: no torch)."""

from __future__ import annotations

import attrs

from grpo_sdk.core.config import option
from grpo_sdk.plugins import ComponentSpec


@attrs.frozen(kw_only=True)
class GRPOEstimatorConfig:
    normalize_rewards: bool = option(True, "Divide by the group's reward std (+1e-6) where it is > 0; "
                                     "false is Dr.GRPO.")
    use_leave_one_out_baseline: bool = option(True, "Baseline is the mean of the *other* rows of the group "
                                              "(RLOO), and the std is theirs too.")


GRPO = ComponentSpec(
    name="grpo",
    kind="estimator",
    impl="grpo_sdk.estimators.grpo:GRPOEstimator",
    config="grpo_sdk.estimators.specs:GRPOEstimatorConfig",
    summary="Group-relative advantages: leave-one-out or group-mean baseline, optional std normalization.",
)
