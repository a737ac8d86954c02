"""Async GRPO's config (issue 15, docs/async.md): `grpo.async_grpo`, `checkpointing.load_replay_buffer`,
the config-time rules of `check_async` (each a ConfigError naming the key and the fix, exit 2), the
`in_flight_weight_updates` capability, the round trip through config.resolved.yaml and the docs.

Each rule is asserted alone: a config that breaks one rule gets that one problem and no other.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import attrs
import pytest
import yaml

from helpers import config_problems, run_grpoctl
from grpo_sdk.config import schema as C
from grpo_sdk.core.capabilities import Capability
from grpo_sdk.config.checks import check_config, config_warnings
from grpo_sdk.config.checks.components import check_components
from grpo_sdk.config.loading import dump_config, load_config, structurer_for, to_yaml
from grpo_sdk.plugins import ComponentSpec

ROOT = Path(__file__).resolve().parents[2]
ON = ("grpo.async_grpo.enabled=true", "loss_fn.use_importance_sampling_correction=true")
NEWEST = "grpo.async_grpo.schedule=newest"


def load(registry, *overrides: str) -> C.MasterConfig:
    return load_config(None, list(overrides), registry)


def enabled(cfg: C.MasterConfig, **changes) -> C.MasterConfig:
    """``cfg`` with async on (and ``changes`` to its section): what the loader refuses today."""
    section = attrs.evolve(cfg.grpo.async_grpo, enabled=True, **changes)
    return attrs.evolve(cfg, grpo=attrs.evolve(cfg.grpo, async_grpo=section))


# --- defaults -------------------------------------------------------------------------------------


def test_defaults_are_the_seeds_plus_schedule_and_deadline(registry):
    cfg = load(registry)
    assert dump_config(cfg.grpo.async_grpo) == {
        "enabled": False, "max_trajectory_age_steps": 1, "schedule": "deterministic",
        "in_flight_weight_updates": False, "recompute_kv_cache_after_weight_updates": False,
        "max_generation_failures": 0, "starvation_timeout_s": 3600.0}
    assert cfg.checkpointing.load_replay_buffer is True
    # The default deadline outlasts a generation call plus a scoring call at their own deadline.
    assert cfg.grpo.async_grpo.starvation_timeout_s >= 2 * cfg.cluster.call_timeout_s


def test_the_seeds_null_block_means_off(registry):
    """NeMo-RL types the section `AsyncGRPOConfig | None`; its configs may say `async_grpo: null`."""
    assert load(registry, "grpo.async_grpo=null").grpo.async_grpo == C.AsyncGRPOConfig()


@pytest.mark.parametrize("override, key, fragment", [
    ("grpo.async_grpo.max_trajectory_age_steps=-1", "grpo.async_grpo.max_trajectory_age_steps", "must be >= 0: -1"),
    ("grpo.async_grpo.max_generation_failures=-1", "grpo.async_grpo.max_generation_failures", "must be >= 0: -1"),
    ("grpo.async_grpo.starvation_timeout_s=0", "grpo.async_grpo.starvation_timeout_s", "must be > 0"),
    ("grpo.async_grpo.starvation_timeout_s=1e12", "grpo.async_grpo.starvation_timeout_s", "must be <="),
    ("grpo.async_grpo.schedule=fast", "grpo.async_grpo.schedule", "'deterministic', 'newest'"),
    ("checkpointing.load_replay_buffer=maybe", "checkpointing.load_replay_buffer", "maybe"),
])
def test_values_out_of_range(registry, override, key, fragment):
    assert fragment in config_problems(registry, override)[key]


def test_off_the_section_is_inert_and_its_rules_silent(registry):
    """One config runs sync or async by flipping `enabled` alone: with it off nothing else is checked."""
    cfg = load(registry, "grpo.async_grpo.in_flight_weight_updates=true",
               "grpo.async_grpo.recompute_kv_cache_after_weight_updates=true", "grpo.async_grpo.schedule=newest",
               "grpo.use_dynamic_sampling=true", "grpo.batch_multiplier=2", "checkpointing.load_replay_buffer=false",
               "grpo.async_grpo.max_trajectory_age_steps=0")
    assert cfg.grpo.async_grpo.in_flight_weight_updates and not cfg.grpo.async_grpo.enabled
    assert not [w for w in config_warnings(cfg, registry) if w[0] == "checkpointing.load_replay_buffer"]


# --- the rules --------------------------------------------------------------------------------------


def test_both_schedules_validate_through_the_cli():
    for extra in ([], [NEWEST, "grpo.async_grpo.in_flight_weight_updates=true"]):
        result = run_grpoctl("config", "validate", *ON, *extra)
        assert result.returncode == 0, result.stdout + result.stderr


def test_a_rule_exits_2_through_the_cli_with_the_key_and_the_fix():
    result = run_grpoctl("config", "validate", "grpo.async_grpo.enabled=true")
    assert result.returncode == 2, result.stdout + result.stderr
    assert ("loss_fn.use_importance_sampling_correction: must be true with grpo.async_grpo.enabled=true"
            in result.stderr)
    assert "set loss_fn.use_importance_sampling_correction=true" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("overrides", [
    [],  # deterministic, A=1
    ["grpo.async_grpo.max_trajectory_age_steps=0"],  # the sync loop, exactly
    [NEWEST, "grpo.async_grpo.max_trajectory_age_steps=3",
     "grpo.async_grpo.max_generation_failures=5", "grpo.use_dynamic_sampling=true", "grpo.batch_multiplier=2"],
    [NEWEST, "grpo.async_grpo.in_flight_weight_updates=true",
     "grpo.async_grpo.recompute_kv_cache_after_weight_updates=true"],  # hf declares the capability
    ["grpo.use_dynamic_sampling=true", "grpo.batch_multiplier=2"],  # deterministic draws batches as sync does
    ["cluster.runtime=ray", "policy.generation.colocated.enabled=false"],
    ["cluster.runtime=ray", "policy.generation.colocated.enabled=false", NEWEST,
     "grpo.async_grpo.in_flight_weight_updates=true"],  # Ray generation workers take the update concurrently
])
def test_valid_async_configs_load(registry, overrides):
    assert check_config(load(registry, *ON, *overrides), registry) == []


@pytest.mark.parametrize("overrides, key, fragments", [
    ([], "loss_fn.use_importance_sampling_correction",
     ["must be true with grpo.async_grpo.enabled=true", "max_trajectory_age_steps=1 step(s)",
      "set loss_fn.use_importance_sampling_correction=true"]),
    (["grpo.async_grpo.recompute_kv_cache_after_weight_updates=true"],
     "grpo.async_grpo.recompute_kv_cache_after_weight_updates",
     ["does nothing without grpo.async_grpo.in_flight_weight_updates=true", "set both or neither"]),
    (["cluster.runtime=ray"], "policy.generation.colocated.enabled",
     ["must be false with grpo.async_grpo.enabled=true on cluster.runtime=ray", "could never overlap training",
      "set policy.generation.colocated.enabled=false"]),
    (["grpo.async_grpo.max_trajectory_age_steps=1048575", "grpo.num_prompts_per_step=2",
      "grpo.num_generations_per_prompt=2"], "grpo.async_grpo.max_trajectory_age_steps",
     ["(max_trajectory_age_steps + 1) x grpo.num_prompts_per_step x grpo.num_generations_per_prompt = "
      "4,194,304 rows", "1,048,576"]),
])
def test_each_rule_names_the_key_and_the_fix(registry, overrides, key, fragments):
    with_is = [] if key == "loss_fn.use_importance_sampling_correction" else [ON[1]]
    found = config_problems(registry, ON[0], *with_is, *overrides)
    assert key in found, found
    for fragment in fragments:
        assert fragment in found[key]
    # Exactly this rule: no rule fires for another's setting.
    assert set(found) == {key}, found


def _without_in_flight(registry):
    """``registry`` with no generation backend declaring in_flight_weight_updates (hf declares it)."""
    from grpo_sdk.plugins.registry import Registry

    def strip(info):
        if info.kind != "generation" or info.spec is None:
            return info
        return attrs.evolve(info, spec=attrs.evolve(
            info.spec, capabilities=info.spec.capabilities - {Capability.IN_FLIGHT_WEIGHT_UPDATES}))

    return Registry([strip(info) for info in registry.list()], registry.host)


def test_in_flight_needs_the_backend_capability_and_names_the_backend(registry):
    registry = _without_in_flight(registry)
    found = config_problems(registry, *ON, "grpo.async_grpo.in_flight_weight_updates=true",
                            "grpo.async_grpo.schedule=newest")
    message = found["grpo.async_grpo.in_flight_weight_updates"]
    assert "needs a generation backend that declares the in_flight_weight_updates capability" in message
    assert "'hf' (policy.generation.backend) does not (no installed backend declares it yet)" in message
    assert "set grpo.async_grpo.in_flight_weight_updates=false" in message
    assert set(found) == {"grpo.async_grpo.in_flight_weight_updates"}


def test_every_problem_is_reported_at_once(registry):
    found = config_problems(_without_in_flight(registry), "grpo.async_grpo.enabled=true", "grpo.async_grpo.in_flight_weight_updates=true",
                            "cluster.runtime=ray", "grpo.advantage_clip_low=2", "grpo.advantage_clip_high=1")
    assert set(found) == {"loss_fn.use_importance_sampling_correction",
                          "grpo.async_grpo.in_flight_weight_updates", "grpo.async_grpo.schedule",
                          "policy.generation.colocated.enabled", "grpo.advantage_clip_low"}, found


def _with_generation_backend(registry, name: str, capabilities: set[str]):
    """``registry`` plus a copy of the hf generation backend, named ``name``, declaring ``capabilities``."""
    from grpo_sdk.plugins.registry import Registry

    hf = registry.info("generation", "hf")
    spec = attrs.evolve(hf.spec, name=name, capabilities=frozenset(Capability(c) for c in capabilities))
    return Registry(registry.list() + [attrs.evolve(hf, name=name, spec=spec)], registry.host)


def test_a_backend_declaring_the_capability_passes_and_is_named_for_the_others(registry):
    extended = _with_generation_backend(_without_in_flight(registry), "streaming", {"in_flight_weight_updates"})
    flags = (*ON, "grpo.async_grpo.in_flight_weight_updates=true", "grpo.async_grpo.schedule=newest")
    assert check_config(load(extended, *flags, "policy.generation.backend=streaming"), extended) == []
    message = config_problems(extended, *flags)["grpo.async_grpo.in_flight_weight_updates"]
    assert "'hf' (policy.generation.backend) does not (those that do: streaming)" in message


def test_in_flight_with_the_deterministic_schedule_is_refused_whatever_the_backend(registry):
    extended = _with_generation_backend(registry, "streaming", {"in_flight_weight_updates"})
    found = config_problems(extended, *ON, "grpo.async_grpo.in_flight_weight_updates=true",
                            "policy.generation.backend=streaming")
    assert set(found) == {"grpo.async_grpo.schedule"}, found
    for fragment in ("deterministic cannot take in-flight weight updates", "depends on timing",
                     "set grpo.async_grpo.schedule=newest, or grpo.async_grpo.in_flight_weight_updates=false"):
        assert fragment in found["grpo.async_grpo.schedule"]


def test_a_valid_async_config_has_no_problem(registry):
    for schedule in ("deterministic", "newest"):
        assert check_config(enabled(load(registry, ON[1]), schedule=schedule), registry) == []


def test_vllm_sleep_mode_is_refused_by_the_vllm_backend(registry):
    from grpo_sdk.backends.vllm.config import VLLMConfig

    cfg = enabled(load(registry, ON[1]))
    gen = attrs.evolve(cfg.policy.generation, backend="vllm", raw_blocks={},
                       structured_blocks={"vllm": VLLMConfig(enable_sleep_mode=True)})
    vllm_cfg = attrs.evolve(cfg, policy=attrs.evolve(cfg.policy, generation=gen))
    found = dict(check_components(vllm_cfg, registry))  # through the spec's check, as config validate runs it
    assert "a sleeping engine" in found["policy.generation.vllm.enable_sleep_mode"]
    assert "set policy.generation.vllm.enable_sleep_mode=false" in found["policy.generation.vllm.enable_sleep_mode"]
    awake = attrs.evolve(gen, structured_blocks={"vllm": VLLMConfig()})
    assert check_components(attrs.evolve(vllm_cfg, policy=attrs.evolve(cfg.policy, generation=awake)), registry) == []
    sync = attrs.evolve(vllm_cfg, grpo=attrs.evolve(cfg.grpo, async_grpo=C.AsyncGRPOConfig()))
    assert check_components(sync, registry) == []


def test_no_replay_buffer_with_deterministic_is_a_warning(registry, caplog):
    cfg = load(registry, ON[1], "checkpointing.load_replay_buffer=false")
    warned = dict(config_warnings(enabled(cfg), registry))
    assert "no longer bit-identical to an uninterrupted run" in warned["checkpointing.load_replay_buffer"]
    assert "checkpointing.load_replay_buffer" not in dict(config_warnings(enabled(cfg, schedule="newest"), registry))
    assert "checkpointing.load_replay_buffer" not in dict(config_warnings(
        enabled(load(registry, ON[1])), registry))
    # Not fatal: a sync config with the key set loads without a word about it.
    with caplog.at_level(logging.WARNING, logger="grpo_sdk"):
        load(registry, "checkpointing.load_replay_buffer=false")
    assert "load_replay_buffer" not in caplog.text


# --- the resolved config --------------------------------------------------------------------------


def test_round_trip_through_config_resolved_yaml(registry, tmp_path):
    cfg = load(registry, "grpo.async_grpo.max_trajectory_age_steps=3", "grpo.async_grpo.schedule=newest",
               "grpo.async_grpo.in_flight_weight_updates=true", "grpo.async_grpo.max_generation_failures=2",
               "grpo.async_grpo.starvation_timeout_s=90.5", "checkpointing.load_replay_buffer=false")
    path = tmp_path / "config.resolved.yaml"
    path.write_text(to_yaml(cfg))
    written = yaml.safe_load(path.read_text())
    assert written["grpo"]["async_grpo"]["schedule"] == "newest"
    assert written["checkpointing"]["load_replay_buffer"] is False
    again = load_config([str(path)], [], registry)
    assert again.grpo.async_grpo == cfg.grpo.async_grpo and dump_config(again) == dump_config(cfg)


def test_an_enabled_section_survives_the_dump(registry):
    """An async run's config.resolved.yaml (once runs can be async) structures back to the same section."""
    cfg = enabled(load(registry, ON[1]), max_trajectory_age_steps=0, starvation_timeout_s=5.0)
    again = structurer_for(registry).structure(yaml.safe_load(to_yaml(cfg)))
    assert again.grpo.async_grpo == cfg.grpo.async_grpo and dump_config(again) == dump_config(cfg)


# --- the capability ---------------------------------------------------------------------------------


def test_the_capability_is_for_generation_and_hf_declares_it(registry):
    declared = ComponentSpec(name="acme", kind="generation", impl="acme:G",
                             capabilities={"in_flight_weight_updates"}).capabilities
    assert declared == {Capability.IN_FLIGHT_WEIGHT_UPDATES}
    with pytest.raises(ValueError, match="'in_flight_weight_updates' is for generation components, not estimator"):
        ComponentSpec(name="acme", kind="estimator", impl="acme:E", capabilities={"in_flight_weight_updates"})
    builtins = [i for i in registry.list("generation") if i.dist == "grpo-sdk"]
    assert {i.name for i in builtins} >= {"hf", "vllm"}
    assert "hf" in [i.name for i in builtins if Capability.IN_FLIGHT_WEIGHT_UPDATES in i.spec.capabilities]


# --- docs ---------------------------------------------------------------------------------------------


def test_the_config_reference_has_the_section():
    sys.path.insert(0, str(ROOT / "docs"))
    try:
        import gen_reference
    finally:
        sys.path.remove(str(ROOT / "docs"))
    page = gen_reference.config_reference()
    assert "{#grpo.async_grpo}" in page
    for field in attrs.fields(C.AsyncGRPOConfig):
        assert f"`grpo.async_grpo.{field.name}`" in page
    assert "`checkpointing.load_replay_buffer`" in page


def test_the_async_page_lists_every_switch_and_is_in_the_nav():
    page = (ROOT / "docs" / "async.md").read_text()
    for field in attrs.fields(C.AsyncGRPOConfig):
        assert f"`grpo.async_grpo.{field.name}`" in page, field.name
    assert "`checkpointing.load_replay_buffer`" in page
    assert "async.md" in (ROOT / "mkdocs.yml").read_text()
