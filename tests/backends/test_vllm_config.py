"""The vLLM backend's options where vLLM is not installed (the main lane): ``async_engine`` parses,
the sync engine stays the default, and what the backend's own check refuses. The engines
themselves are tested in the vLLM lane (tests/backends/test_vllm.py, tests/backends/test_vllm_async.py)."""

from __future__ import annotations

import attrs
import pytest

from grpo_sdk.backends.vllm.config import VLLMConfig
from grpo_sdk.config import schema as C
from grpo_sdk.config.checks import check_config
from grpo_sdk.config.checks.components import check_components
from grpo_sdk.config.loading import Structurer, load_config
from grpo_sdk.core.errors import ConfigError


def with_vllm(registry, block: VLLMConfig, *overrides: str) -> C.MasterConfig:
    """A config that selects vLLM with ``block``, built without vLLM installed (the loader would
    stop at the missing requirement, exit 3, before the backend's own check)."""
    cfg = load_config(None, list(overrides), registry)
    gen = attrs.evolve(cfg.policy.generation, backend="vllm", raw_blocks={}, structured_blocks={"vllm": block})
    return attrs.evolve(cfg, policy=attrs.evolve(cfg.policy, generation=gen))


def test_async_engine_parses_and_the_sync_engine_stays_the_default(registry):
    structure = Structurer(registry).structure
    assert VLLMConfig().async_engine is False
    assert structure({}, VLLMConfig) == VLLMConfig() == structure({"async_engine": False}, VLLMConfig)
    assert structure({"async_engine": True}, VLLMConfig) == VLLMConfig(async_engine=True)
    with pytest.raises(ConfigError) as info:
        structure({"async_engine": "sometimes"}, VLLMConfig)
    assert info.value.problems == [("async_engine", "expected true or false, got 'sometimes'")]


def test_async_engine_true_constructs_the_async_backend_and_false_the_sync_one(monkeypatch):
    from grpo_sdk.backends.vllm import async_engine
    from grpo_sdk.backends.vllm.generation import VLLMGeneration

    built = []

    class Recorder:
        def __init__(self, config, context):
            built.append((config, context))

    monkeypatch.setattr(async_engine, "VLLMAsyncGeneration", Recorder)
    got = VLLMGeneration(VLLMConfig(async_engine=True), "ctx")
    assert isinstance(got, Recorder) and built == [(VLLMConfig(async_engine=True), "ctx")]
    # The default goes down the in-process LLM path, which needs vLLM itself.
    with pytest.raises(ModuleNotFoundError, match="vllm"):
        VLLMGeneration(VLLMConfig(), "ctx")
    assert len(built) == 1


def test_sleep_mode_with_the_async_engine_is_refused(registry):
    found = dict(check_components(with_vllm(registry, VLLMConfig(async_engine=True, enable_sleep_mode=True)),
                                  registry))
    assert found["policy.generation.vllm.enable_sleep_mode"] == (
        "must be false with policy.generation.vllm.async_engine=true: sleep mode is implemented for the in-process "
        "engine only; set one of them to false")
    assert check_components(with_vllm(registry, VLLMConfig(async_engine=True)), registry) == []
    assert check_components(with_vllm(registry, VLLMConfig(enable_sleep_mode=True)), registry) == []


IS_CORRECTION = ["loss_fn.use_importance_sampling_correction=true"]  # async GRPO requires it


def in_flight(cfg: C.MasterConfig, **section) -> C.MasterConfig:
    """``cfg`` with async GRPO on, schedule newest and in-flight weight updates (``section`` overrides)."""
    section = attrs.evolve(cfg.grpo.async_grpo, **{"enabled": True, "schedule": "newest",
                                                  "in_flight_weight_updates": True, **section})
    return attrs.evolve(cfg, grpo=attrs.evolve(cfg.grpo, async_grpo=section))


def test_in_flight_updates_need_the_async_engine(registry):
    """vLLM declares in_flight_weight_updates (capabilities are per backend), but only the async
    engine delivers it, so the backend's own check refuses it with the in-process engine."""
    from grpo_sdk.core.capabilities import Capability

    assert Capability.IN_FLIGHT_WEIGHT_UPDATES in registry.info("generation", "vllm").spec.capabilities
    cfg = load_config(None, IS_CORRECTION, registry)
    message = (
        "must be true with grpo.async_grpo.in_flight_weight_updates=true: only vLLM's async engine (AsyncLLM) can "
        "freeze its requests between two decode steps for a weight update and record which weights sampled each "
        "token; the in-process engine finishes its whole batch first. Set policy.generation.vllm.async_engine=true, "
        "or grpo.async_grpo.in_flight_weight_updates=false (a weight update then waits for the generation in "
        "flight)")
    sync_engine = with_vllm(registry, VLLMConfig(), *IS_CORRECTION)
    assert check_config(in_flight(sync_engine), registry) == [("policy.generation.vllm.async_engine", message)]
    # Reported with the other problems at once: sleep mode cannot overlap training either.
    sleeping = with_vllm(registry, VLLMConfig(enable_sleep_mode=True), *IS_CORRECTION)
    assert [key for key, _ in check_config(in_flight(sleeping), registry)] == [
        "policy.generation.vllm.async_engine", "policy.generation.vllm.enable_sleep_mode"]
    async_engine = with_vllm(registry, VLLMConfig(async_engine=True), *IS_CORRECTION)
    assert check_config(in_flight(async_engine), registry) == []  # the capability check passes too
    assert check_config(in_flight(async_engine, recompute_kv_cache_after_weight_updates=True), registry) == []
    # Without in-flight updates (or with async GRPO off) either engine is fine.
    assert check_config(in_flight(sync_engine, in_flight_weight_updates=False), registry) == []
    assert check_config(in_flight(sync_engine, enabled=False), registry) == []
    # The same config on hf is untouched by vLLM's check.
    assert check_config(in_flight(cfg), registry) == []


def test_the_in_process_engine_refuses_a_pause_it_cannot_keep():
    """The contract kit requires PausesForRefit of the class the spec names; the in-process engine's
    methods refuse, naming the fix (reached only past the config check)."""
    from grpo_sdk.backends.vllm.generation import VLLMGeneration
    from grpo_sdk.core.errors import PluginError

    engine = object.__new__(VLLMGeneration)  # the methods need no engine: they refuse before using one
    for call in (lambda: engine.pause_generation(keep_in_flight=True),
                 lambda: engine.resume_generation(recompute_kv_cache=False)):
        with pytest.raises(PluginError, match=r"set policy\.generation\.vllm\.async_engine=true"):
            call()
