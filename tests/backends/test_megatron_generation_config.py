"""The megatron generation's config check where megatron-core and mbridge are not installed (the main
lane): colocated megatron generation needs the megatron policy, async GRPO cannot share the training
weights, the architecture must be one mbridge bridges; each with its key path, and ``grpoctl config
validate`` exits 2 with it. The backend itself runs in the megatron lane (.ci/megatron-lane)."""

from __future__ import annotations

import json
import subprocess
import sys

import attrs
import pytest

from grpo_sdk.backends.megatron import colocated
from grpo_sdk.backends.megatron.config import MegatronPolicyConfig
from grpo_sdk.config.checks.components import check_components
from grpo_sdk.config.loading import load_config

LLAMA = {"model_type": "llama", "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
         "max_position_embeddings": 2048, "vocab_size": 128}


@pytest.fixture
def llama_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    return str(tmp_path)


def problems(registry, model_name, *, policy="hf", colocated_enabled=True, runtime="local", async_grpo=False):
    """Problems of a config selecting the megatron generation, built without megatron installed (the
    loader would stop at the missing requirement, exit 3, before the backend's own check)."""
    cfg = load_config(None, [], registry)
    gen = attrs.evolve(cfg.policy.generation, backend="megatron", raw_blocks={}, structured_blocks={},
                       colocated=attrs.evolve(cfg.policy.generation.colocated, enabled=colocated_enabled))
    blocks = {"megatron": MegatronPolicyConfig()} if policy == "megatron" else {}
    cfg = attrs.evolve(
        cfg, policy=attrs.evolve(cfg.policy, backend=policy, model_name=model_name, generation=gen, raw_blocks={},
                                 structured_blocks=blocks),
        cluster=attrs.evolve(cfg.cluster, runtime=runtime),
        grpo=attrs.evolve(cfg.grpo, async_grpo=attrs.evolve(cfg.grpo.async_grpo, enabled=async_grpo)))
    found: dict[str, str] = {}
    for key, message in check_components(cfg, registry):
        found[key] = f"{found[key]} | {message}" if key in found else message
    return found, cfg


def test_the_generation_is_registered(registry):
    info = registry.info("generation", "megatron")
    assert info is not None and info.spec is not None
    assert info.spec.check == "grpo_sdk.backends.megatron.spec:check_megatron_generation"
    assert not info.spec.capabilities  # no in-flight weight updates, no CUDA IPC


def test_colocated_megatron_generation_needs_the_megatron_policy(registry, llama_dir):
    found, _ = problems(registry, llama_dir, policy="hf")
    assert list(found) == ["policy.generation.backend"]
    assert "needs policy.backend=megatron (it is 'hf')" in found["policy.generation.backend"]
    assert "policy.generation.colocated.enabled=false" in found["policy.generation.backend"]
    # Not colocated: a model of its own, refit in Hugging Face names from any policy.
    assert problems(registry, llama_dir, policy="hf", colocated_enabled=False)[0] == {}


def test_with_the_megatron_policy_in_one_process_it_shares_the_model(registry, llama_dir):
    found, cfg = problems(registry, llama_dir, policy="megatron")
    assert found == {}
    assert colocated.shares_policy_model(cfg)
    # On Ray the policy and the generation are separate actors: nothing to share.
    assert not colocated.shares_policy_model(problems(registry, llama_dir, policy="megatron", runtime="ray")[1])
    assert not colocated.shares_policy_model(problems(registry, llama_dir, policy="megatron",
                                                      colocated_enabled=False)[1])


def test_async_grpo_cannot_sample_on_the_weights_being_trained(registry, llama_dir):
    found, _ = problems(registry, llama_dir, policy="megatron", async_grpo=True)
    assert list(found) == ["grpo.async_grpo.enabled"]
    assert "policy.generation.colocated.enabled=false" in found["grpo.async_grpo.enabled"]
    assert problems(registry, llama_dir, policy="megatron", async_grpo=True, colocated_enabled=False)[0] == {}


def test_an_architecture_mbridge_does_not_bridge_is_refused(registry, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA, "model_type": "gpt2"}))
    found, _ = problems(registry, str(tmp_path), colocated_enabled=False)
    assert list(found) == ["policy.model_name"]
    assert "model_type 'gpt2'" in found["policy.model_name"] and "megatron generation" in found["policy.model_name"]
    found, _ = problems(registry, "builtin:tiny-gpt2", colocated_enabled=False)
    assert "model_type 'gpt2'" in found["policy.model_name"]
    # With the megatron policy its own check reports the model once, not twice.
    found, _ = problems(registry, str(tmp_path), policy="megatron")
    assert [key for key in found if key == "policy.model_name"] == ["policy.model_name"]
    assert found["policy.model_name"].count("model_type 'gpt2'") == 1


def test_the_spec_and_colocated_module_are_light():
    code = ("import sys, grpo_sdk.backends.megatron.spec as s, grpo_sdk.backends.megatron.colocated\n"
            "heavy = sorted(m for m in ('torch', 'transformers', 'megatron', 'mbridge') if m in sys.modules)\n"
            "assert not heavy, heavy\n"
            "assert s.GENERATION.impl == 'grpo_sdk.backends.megatron.generation:MegatronGeneration'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_grpoctl_config_validate_exits_2_with_the_key(make_site, llama_dir):
    site = make_site()  # megatron-core and mbridge "installed" as metadata only: the loader reaches the check
    site.add("megatron-core", version="0.16.1", entry_points={}, files={})
    site.add("mbridge", version="0.15.1", entry_points={}, files={})
    args = ("config", "validate", "policy.generation.backend=megatron", f"policy.model_name={llama_dir}",
            "policy.tokenizer.name=builtin:tiny-gpt2")
    result = site.grpoctl(*args)
    out = result.stdout + result.stderr
    assert result.returncode == 2, out
    assert "Traceback" not in out and "policy.generation.backend:" in out
    result = site.grpoctl(*args, "policy.backend=megatron")
    assert result.returncode == 0, result.stdout + result.stderr
