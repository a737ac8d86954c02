"""The optional protocols (``grpo_sdk.plugins``: Checkpointable, PromptSampler, ReportsMetrics,
WeightFileWriter, WeightFileLoader, SurvivorNormalizedLoss, SupportsShutdown): the built-ins
implement the ones they should, and the runtimes' wrappers and proxies answer ``isinstance``
exactly as the component they stand for (docs/plugins.md, "Optional protocols")."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from grpo_sdk.plugins import (
    Checkpointable,
    PromptSampler,
    ReportsMetrics,
    SupportsShutdown,
    SurvivorNormalizedLoss,
    WeightFileLoader,
    WeightFileWriter,
)
from grpo_sdk.runtime.deadlines import EnvironmentDeadline
from grpo_sdk.runtime.groups import EnvironmentPool, GenerationGroup, PolicyGroup
from grpo_sdk.runtime.workers import optional_methods


class Plain:
    """An environment with no optional method."""

    def step(self, message_logs, metadata): ...


class Sampling(Plain):
    """An environment that makes prompts and holds a resource."""

    closed = False

    def sample_prompts(self, num_prompts: int, rng: random.Random):
        return [(str(rng.randrange(10)), {}) for _ in range(num_prompts)]

    def shutdown(self) -> None:
        self.closed = True


class StatefulGeneration:
    def save_checkpoint(self, path: str) -> None: ...

    def load_checkpoint(self, path: str) -> None: ...


def test_the_built_ins_implement_their_optional_protocols():
    from grpo_sdk.algorithms.loss import ClippedPGLoss
    from grpo_sdk.backends.hf.generation import HFGeneration
    from grpo_sdk.backends.hf.policy import HFPolicy
    from grpo_sdk.config.schema import LossConfig
    from grpo_sdk.environments.math_env import MathEnvironment
    from grpo_sdk.environments.reverse_digits import ReverseDigitsEnvironment
    from grpo_sdk.estimators.grpo import GRPOEstimator
    from grpo_sdk.estimators.opd import OPDEstimator

    assert issubclass(HFGeneration, Checkpointable) and not issubclass(HFGeneration, WeightFileLoader)
    assert issubclass(HFPolicy, Checkpointable) and not issubclass(HFPolicy, WeightFileWriter)
    assert issubclass(ReverseDigitsEnvironment, PromptSampler)
    assert not issubclass(ReverseDigitsEnvironment, SupportsShutdown)
    assert issubclass(MathEnvironment, SupportsShutdown) and not issubclass(MathEnvironment, PromptSampler)
    assert isinstance(OPDEstimator(None, None), ReportsMetrics)
    assert not isinstance(GRPOEstimator(None, None), ReportsMetrics)
    loss = ClippedPGLoss(LossConfig())
    assert isinstance(loss, SurvivorNormalizedLoss) and not loss.requires_survivor_normalization


def test_the_local_deadline_wrapper_has_exactly_the_environments_optional_methods():
    plain = EnvironmentDeadline(Plain(), "plain", timeout=5.0)
    assert not isinstance(plain, PromptSampler) and not isinstance(plain, SupportsShutdown)
    with pytest.raises(AttributeError):
        plain.sample_prompts  # noqa: B018 - the attribute is absent, as on the environment

    env = Sampling()
    wrapped = EnvironmentDeadline(env, "sampling", timeout=5.0)
    assert isinstance(wrapped, PromptSampler) and isinstance(wrapped, SupportsShutdown)
    assert wrapped.sample_prompts(3, random.Random(0)) == env.sample_prompts(3, random.Random(0))
    wrapped.shutdown()
    assert env.closed


class NoRuntime:
    failure = None
    call_timeout = 5.0


@pytest.mark.parametrize("component", [StatefulGeneration(), Plain()], ids=["checkpointable", "plain"])
def test_a_generation_proxy_exposes_exactly_the_remote_components_optional_methods(component):
    group = GenerationGroup(NoRuntime(), [], tokenizer_path="unused")
    assert not isinstance(group, Checkpointable)  # nothing reported yet
    group.methods = optional_methods(component)  # what the worker reports from setup
    assert isinstance(group, Checkpointable) == isinstance(component, Checkpointable)
    assert ("save_checkpoint" in vars(group)) == isinstance(component, Checkpointable)
    group.methods = ()
    assert not isinstance(group, Checkpointable)
    # The disk transport's file work is the group's own (in the workers), whatever the component.
    assert isinstance(group, WeightFileLoader)
    assert isinstance(PolicyGroup(NoRuntime(), []), WeightFileWriter)


def test_an_environment_pool_samples_prompts_only_when_the_environment_does():
    assert not isinstance(EnvironmentPool(NoRuntime(), [], max_concurrency=1, local_factory=None), PromptSampler)
    pool = EnvironmentPool(NoRuntime(), [], max_concurrency=1, local_factory=Sampling)
    assert isinstance(pool, PromptSampler)
    assert pool.sample_prompts(2, random.Random(1)) == Sampling().sample_prompts(2, random.Random(1))


def test_workers_report_the_methods_of_the_protocols_a_component_implements():
    assert optional_methods(Plain()) == []
    assert optional_methods(Sampling()) == ["sample_prompts", "shutdown"]
    assert optional_methods(StatefulGeneration()) == ["load_checkpoint", "save_checkpoint"]


class FileGeneration:
    """A generation backend that reads the weights file itself (an inference server's way)."""

    def __init__(self):
        self.loaded: list[tuple[str, int]] = []

    def load_weights(self, path: str, *, version: int) -> None:
        assert Path(path).is_file()  # complete when the call comes; the transport may delete it after
        self.loaded.append((path, version))


class TensorGeneration:
    def __init__(self):
        self.updated: list[tuple[list[str], int]] = []

    def update_weights(self, weights, *, version: int) -> None:
        self.updated.append(([name for name, _ in weights], version))


class TinyPolicy:
    def named_weights(self):
        yield "w", torch.ones(2, 3)


def test_the_disk_transport_uses_load_weights_when_generation_has_it(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from grpo_sdk.weight_sync.disk import DiskWeightSync
    from grpo_sdk.weight_sync.specs import DiskWeightSyncConfig

    monkeypatch.chdir(tmp_path)
    sync = DiskWeightSync(DiskWeightSyncConfig(directory="relative/dir"), SimpleNamespace(run_dir="unused"))
    files = FileGeneration()
    stats = sync.sync_weights(TinyPolicy(), files, version=2)
    assert stats.num_tensors == 1
    assert files.loaded == [(str(tmp_path / "relative" / "dir" / "weights_v2.safetensors"), 2)]  # absolute

    tensors = TensorGeneration()
    sync.sync_weights(TinyPolicy(), tensors, version=3)
    assert tensors.updated == [(["w"], 3)]


class Tooled(Plain):
    """An environment that offers a tool (DeclaresTools) and makes no prompts."""

    def __init__(self, config=None, context=None):
        pass

    def tool_schemas(self):
        return [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


def test_tool_schemas_reach_the_prompt_builder_through_the_wrappers_and_pools():
    from grpo_sdk.plugins import DeclaresTools
    from grpo_sdk.runtime.groups import local_methods, local_sampler_factory

    assert isinstance(EnvironmentDeadline(Tooled(), "tooled", timeout=5.0), DeclaresTools)
    assert not isinstance(EnvironmentDeadline(Sampling(), "sampling", timeout=5.0), DeclaresTools)
    assert local_methods(Tooled) == ("tool_schemas",) and local_methods(Plain) == ()
    pool = EnvironmentPool(NoRuntime(), [], max_concurrency=1, local_factory=local_sampler_factory(Tooled, None, None),
                           local_methods=local_methods(Tooled))
    assert isinstance(pool, DeclaresTools) and not isinstance(pool, PromptSampler)
    assert pool.tool_schemas() == Tooled().tool_schemas()  # from a local instance, no remote call
    assert not isinstance(EnvironmentPool(NoRuntime(), [], max_concurrency=1, local_factory=None), DeclaresTools)
