"""The public plugin API: the one module plugin authors import.

Everything a backend, estimator, environment, weight-sync transport, logger or hook plugin
needs is re-exported here; anything not listed in ``__all__`` is private and may change.
Importing this module does not import torch.

Three documented submodules are public too: ``grpo_sdk.plugins.toolkit`` (helpers that do not
import torch: tokenizer loading and model-source checks, micro-batch metric sums, atomic writes,
the device picker, the node address, config validators), ``grpo_sdk.plugins.tensors`` (helpers
that import torch: the temperature/top-k/top-p logits transform with logprobs, group statistics,
weights files) and ``grpo_sdk.plugins.tools`` (tool-using environments: the ``ToolEnvironment``
base, tool-call parsers). The built-in components import nothing else of grpo-sdk.

A minimal third-party estimator package::

    # acme_estimators/spec.py  (light: imported by `grpoctl plugins list`)
    from grpo_sdk.plugins import ComponentSpec
    SPEC = ComponentSpec(name="median", kind="estimator",
                         impl="acme_estimators.median:MedianBaseline",
                         summary="Group median as the baseline.")

    # acme_estimators/median.py  (heavy: imported when a run selects `grpo.adv_estimator.name: median`)
    import torch
    class MedianBaseline:
        def __init__(self, config, context): ...
        def compute_advantages(self, batch: AdvantageInput):
            ...
            return advantages  # [B, S]

    # pyproject.toml
    [project.entry-points."grpo_sdk.estimators"]
    median = "acme_estimators.spec:SPEC"
"""

from grpo_sdk.core.capabilities import Capability
from grpo_sdk.config.schema import option
from grpo_sdk.config.context import RunContext
from grpo_sdk.core.errors import (
    ConfigError,
    DataError,
    EnvironmentStepError,
    ExitCode,
    GrpoSdkError,
    ModelLoadError,
    NonFiniteError,
    PluginError,
)
from grpo_sdk.core.protocols import (
    AdvantageEstimator,
    AsyncGeneration,
    Checkpointable,
    DeclaresRewardComponents,
    Environment,
    ExportsMergedModel,
    Generation,
    Logger,
    LossFunction,
    PausesForRefit,
    Policy,
    PromptSampler,
    ReceivesBroadcast,
    ReportsMetrics,
    RunsOnMainThread,
    SupportsShutdown,
    SurvivorNormalizedLoss,
    WeightFileLoader,
    WeightFileWriter,
    WeightSync,
    Worker,
    WorkerGroup,
    ZeroGradientRows,
)
from grpo_sdk.core.agents import AgentResult, AgentTask, EndpointConfig, RunsAgents
from grpo_sdk.core.multi_turn import DeclaresTools, MultiTurnEnvironment
from grpo_sdk.core.records import (
    AdvantageInput,
    EnvironmentReturn,
    GenerationInput,
    GenerationOutput,
    Message,
    MessageLog,
    RunStatus,
    SamplingParams,
    SyncStats,
    TrainBatch,
)
from grpo_sdk.plugins.hookspecs import hookimpl, hookspec
from grpo_sdk.plugins.specs import (
    HOOKS_GROUP,
    KINDS,
    PLUGIN_API_VERSION,
    SUPPORTED_PLUGIN_APIS,
    ComponentInfo,
    ComponentSpec,
    ConfigSection,
)

__all__ = [
    "AdvantageEstimator",
    "AdvantageInput",
    "AgentResult",
    "AgentTask",
    "AsyncGeneration",
    "Capability",
    "Checkpointable",
    "ComponentInfo",
    "ComponentSpec",
    "ConfigError",
    "ConfigSection",
    "DataError",
    "DeclaresRewardComponents",
    "DeclaresTools",
    "EndpointConfig",
    "Environment",
    "EnvironmentReturn",
    "EnvironmentStepError",
    "ExitCode",
    "ExportsMergedModel",
    "Generation",
    "GenerationInput",
    "GenerationOutput",
    "GrpoSdkError",
    "HOOKS_GROUP",
    "KINDS",
    "Logger",
    "LossFunction",
    "Message",
    "MultiTurnEnvironment",
    "MessageLog",
    "ModelLoadError",
    "NonFiniteError",
    "PLUGIN_API_VERSION",
    "PausesForRefit",
    "PluginError",
    "Policy",
    "PromptSampler",
    "ReceivesBroadcast",
    "ReportsMetrics",
    "RunsAgents",
    "RunsOnMainThread",
    "RunContext",
    "RunStatus",
    "SUPPORTED_PLUGIN_APIS",
    "SamplingParams",
    "SupportsShutdown",
    "SurvivorNormalizedLoss",
    "SyncStats",
    "TrainBatch",
    "WeightFileLoader",
    "WeightFileWriter",
    "WeightSync",
    "Worker",
    "WorkerGroup",
    "ZeroGradientRows",
    "hookimpl",
    "hookspec",
    "option",
]
