"""The vLLM backend's options where vLLM is not installed (the main lane): ``async_engine`` parses,
the sync engine stays the default, and what the backend's own check refuses. The engines
themselves are tested in the vLLM lane (tests/test_vllm.py, tests/test_vllm_async.py)."""

from __future__ import annotations

import attrs
import pytest

from grpo_sdk.backends.vllm.config import VLLMConfig
from grpo_sdk.core import config as C
from grpo_sdk.core.config_checks import check_components, check_config
from grpo_sdk.core.config_loader import Structurer, load_config
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


def test_in_flight_updates_stay_refused_for_vllm_even_with_the_async_engine(registry):
    """Capabilities are declared per backend, not per config: vLLM declares in_flight_weight_updates
    for neither engine, so async GRPO's in-flight updates are refused with vLLM (docs/vllm.md)."""
    cfg = with_vllm(registry, VLLMConfig(async_engine=True), "loss_fn.use_importance_sampling_correction=true")
    section = attrs.evolve(cfg.grpo.async_grpo, enabled=True, schedule="newest", in_flight_weight_updates=True)
    cfg = attrs.evolve(cfg, grpo=attrs.evolve(cfg.grpo, async_grpo=section))
    found = dict(check_config(cfg, registry))
    assert "'vllm' (policy.generation.backend) does not" in found["grpo.async_grpo.in_flight_weight_updates"]
