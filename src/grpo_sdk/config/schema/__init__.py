"""The run configuration: attrs classes, every field documented where it is declared.

Section and key names follow NeMo-RL's GRPO (``grpo.*``, ``loss_fn.*``, ``policy.*``,
``policy.generation.*``, ``data.*``, ``env.*``, ``logger.*``, ``checkpointing.*``,
``cluster.*``) where they still mean the same thing. Defaults follow NeMo-RL's defaults; the
built-in recipe (``grpo_sdk/recipes/tiny_reverse.yaml``) is what `grpoctl run` uses when no
``-c`` file is given.

Pluggable sections name a plugin with a selector key and hold one block per plugin, keyed by
the plugin's name; only the selected block is validated, against that plugin's config class::

    policy:
      generation:
        backend: hf          # selector: a name in the grpo_sdk.generation group
        max_new_tokens: 5    # fields every backend shares
        hf: {}               # the hf backend's own block
        vllm: {gpu_memory_utilization: 0.6}   # ignored unless backend=vllm

``grpo_sdk.config.loading`` structures YAML into these classes and reports every problem at
once. ``grpoctl config schema`` prints the help texts below.

The classes live in one module per group of sections (``grpo``: grpo, loss_fn,
on_policy_distillation, reward_penalties; ``policy``: policy and policy.generation; ``master``:
data, env, weight_sync, logger, checkpointing, cluster and ``MasterConfig``) over ``base`` (plugin
slots, removed keys, shared validators and bounds); this module gathers them, so
``from grpo_sdk.config import schema as C`` reaches every one.
"""

from grpo_sdk.config.schema.base import (
    MAX_MMAP_THRESHOLD, MAX_ROWS, MAX_THREADS, MAX_TIMEOUT_S, MAX_TOKENS, PluginSlot, RemovedOption, non_empty,
    non_negative, positive, row_count, token_count,
)
from grpo_sdk.config.schema.grpo import (
    AdvEstimatorConfig, AsyncGRPOConfig, EffortLevelsConfig, GRPOConfig, LengthPenaltyConfig, LengthPenaltyParams,
    LossConfig, OnPolicyDistillationConfig, ProfileBandChannel, ProfileBandConfig, ProfileBandDefaults,
    RewardPenaltyConfig, RewardPenaltyTokenIdsConfig, RewardScalingConfig, RewardShapingConfig,
)
from grpo_sdk.config.schema.master import (
    CheckpointingConfig, ClusterConfig, DataConfig, DatasetConfig, EnvConfig, LoggerConfig, MasterConfig,
    WeightSyncConfig, plugin_config,
)
from grpo_sdk.config.schema.policy import (
    ColocatedConfig, DynamicBatchingConfig, GenerationConfig, LoraConfig, OptimizerConfig, PolicyConfig,
    SchedulerConfig, SequencePackingConfig, TokenizerConfig,
)
from grpo_sdk.core.options import option

__all__ = [
    "MAX_MMAP_THRESHOLD", "MAX_ROWS", "MAX_THREADS", "MAX_TIMEOUT_S", "MAX_TOKENS", "AdvEstimatorConfig",
    "AsyncGRPOConfig", "CheckpointingConfig", "ClusterConfig", "ColocatedConfig", "DataConfig", "DatasetConfig",
    "DynamicBatchingConfig", "EffortLevelsConfig", "EnvConfig", "GRPOConfig", "GenerationConfig",
    "LengthPenaltyConfig", "LengthPenaltyParams", "LoggerConfig", "LoraConfig", "LossConfig", "MasterConfig",
    "OnPolicyDistillationConfig", "OptimizerConfig", "PluginSlot", "PolicyConfig", "ProfileBandChannel",
    "ProfileBandConfig", "ProfileBandDefaults", "RemovedOption", "RewardPenaltyConfig",
    "RewardPenaltyTokenIdsConfig", "RewardScalingConfig", "RewardShapingConfig", "SchedulerConfig",
    "SequencePackingConfig", "TokenizerConfig", "WeightSyncConfig", "non_empty", "non_negative", "option",
    "plugin_config", "positive", "row_count", "token_count",
]
