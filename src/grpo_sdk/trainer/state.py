"""The training run's two records: ``TrainerState`` (what a checkpoint's ``training_state.json``
holds besides files) and ``Components`` (what ``GRPOTrainer.setup`` built for the run).

A module of its own so that ``grpo_sdk.trainer.trainer`` reads as the loop, top to bottom; these
are plain records with no behaviour of the run in them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from grpo_sdk.algorithms.loss import ClippedPGLoss
    from grpo_sdk.config.context import RunContext
    from grpo_sdk.core.protocols import AdvantageEstimator, Environment, Generation, Logger, Policy, WeightSync
    from grpo_sdk.core.records import SamplingParams
    from grpo_sdk.data.prompt_sources import DatasetPrompts, EnvironmentPrompts, MixturePrompts
    from grpo_sdk.data.prompts import Prompt
    from grpo_sdk.rollouts.step_rollouts import StepRollouts
    from grpo_sdk.runtime import Runtime

REWARD_TAIL = 10  # the summary's reward_last is the mean over this many last steps


@attrs.define(kw_only=True)
class TrainerState:
    """Everything besides files (weights, optimizer, torch's RNG) that decides what the run does
    next. It is ``training_state.json`` in each checkpoint: ``to_json`` / ``from_json`` round-trip."""

    step: int = 0
    next_group_id: int = 0  # group ids keep counting across steps, so groups never collide
    data: dict[str, Any] = attrs.field(factory=dict)  # the prompt source's position
    python_random: list[Any] | None = None  # random.getstate(), as JSON lists
    reward_first: float | None = None  # mean reward of the first step: the starting level
    reward_tail: list[float] = attrs.field(factory=list)  # the last REWARD_TAIL steps' mean rewards
    validation: dict[str, float] = attrs.field(factory=dict)  # the last validation's metrics
    ranking_metric: float | None = None  # checkpointing.metric_name's value at this checkpoint
    reward_failures: list[list[int]] = attrs.field(factory=list)  # [failed, scored] of recent batches
    rollouts: dict[str, Any] = attrs.field(factory=dict)  # async GRPO: the trained epoch, the data cut

    def record_reward(self, reward: float) -> None:
        if self.reward_first is None:
            self.reward_first = reward
        self.reward_tail = (self.reward_tail + [reward])[-REWARD_TAIL:]

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TrainerState:
        known = {f.name for f in attrs.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})  # older checkpoints lack newer fields


@attrs.frozen(kw_only=True)
class Components:
    """What ``setup`` built for the run, and what the step derives once from the config."""

    context: RunContext
    runtime: Runtime
    policy: Policy
    generation: Generation
    environment: Environment
    estimator: AdvantageEstimator
    weight_sync: WeightSync
    loss_fn: ClippedPGLoss
    teacher: Policy | None  # on-policy distillation's teacher policy
    tokenizer: PreTrainedTokenizerBase
    prompts: DatasetPrompts | MixturePrompts | EnvironmentPrompts  # the training prompt source
    step_rollouts: StepRollouts  # draws, generates and scores a step's rollouts from ``prompts``
    val_prompts: list[Prompt]
    sampling: SamplingParams
    max_prompt_tokens: int
    needs_prev_logprobs: bool  # frozen "old" logprobs: several optimizer steps, or a consumer of them
    loggers: list[Logger] = attrs.field(factory=list)
