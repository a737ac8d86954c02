"""Rules that span config fields, checked after structuring and before any model is loaded.

Each rule returns a problem naming the keys involved; all problems are reported together. These
replace NeMo-RL's bare ``assert``s, which ``python -O`` would have dropped, and several of
NeMo-RL's silent no-ops (a switch set where nothing reads it) are errors here.

One module per domain: ``algorithm`` (batch shape, rewards, loss, estimator), ``loss``
(``loss_fn.*``), ``rewards`` (reward penalties and length bands), ``lifecycle`` (data, validation,
checkpoints, metric names), ``model`` (context, vocabulary, paths, memory), ``policy`` (backend
options), ``runtime`` (cluster, weight sync), ``async_grpo``, ``episodes`` and ``components`` (each
selected component's own check). ``check_config`` below runs every rule;
``grpo_sdk.config.load_config`` calls it after structuring.
"""

from __future__ import annotations

from typing import Any

from grpo_sdk.config import schema as C
from grpo_sdk.config.checks.algorithm import check_algorithm, check_batch_shape, check_rewards
from grpo_sdk.config.checks.async_grpo import async_warnings, check_async
from grpo_sdk.config.checks.components import check_components
from grpo_sdk.config.checks.episodes import check_episodes, episode_warnings
from grpo_sdk.config.checks.lifecycle import check_lifecycle, check_metrics
from grpo_sdk.config.checks.model import check_memory, check_model, check_paths
from grpo_sdk.config.checks.policy import check_lora, check_optimizer, check_policy_batching
from grpo_sdk.config.checks.rewards import check_reward_penalties
from grpo_sdk.config.checks.runtime import check_runtime, check_weight_sync

__all__ = ["check_config", "config_warnings"]


def check_config(cfg: C.MasterConfig, registry: Any = None) -> list[tuple[str, str]]:
    """Every cross-field problem of ``cfg``; ``registry`` enables the capability checks."""
    return (check_batch_shape(cfg) + check_paths(cfg) + check_model(cfg) + check_rewards(cfg) + check_algorithm(cfg, registry)
            + check_reward_penalties(cfg)
            + check_lifecycle(cfg, registry) + check_metrics(cfg, registry)[0] + check_runtime(cfg, registry)
            + check_weight_sync(cfg, registry) + check_policy_batching(cfg, registry) + check_lora(cfg, registry)
            + check_optimizer(cfg)
            + check_async(cfg, registry) + check_episodes(cfg, registry)
            + check_components(cfg, registry))


def config_warnings(cfg: C.MasterConfig, registry: Any = None) -> list[tuple[str, str]]:
    """Settings that are allowed but probably not what was meant; printed, never fatal."""
    return check_metrics(cfg, registry)[1] + check_memory(cfg) + async_warnings(cfg) + episode_warnings(cfg, registry)
