"""The megatron policy's options and config checks where megatron-core and mbridge are not installed
(the main lane): ``policy.megatron`` parses, ``check_megatron`` reports every problem with its key path,
``grpoctl config validate`` exits 2 with them (no traceback), and the spec stays light. The backend
itself runs in the megatron lane (.ci/megatron-lane)."""

from __future__ import annotations

import json
import subprocess
import sys

import attrs
import pytest

from grpo_sdk.backends.megatron import spec as S
from grpo_sdk.backends.megatron.config import MegatronPolicyConfig
from grpo_sdk.config import schema as C
from grpo_sdk.config.checks.components import check_components
from grpo_sdk.config.loading import Structurer, load_config
from grpo_sdk.core.errors import ConfigError

from helpers import run_grpoctl

LLAMA = {"model_type": "llama", "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 3,
         "max_position_embeddings": 2048, "vocab_size": 128}


@pytest.fixture
def model_dir(tmp_path):
    """A local model directory whose config.json is all the checks read."""
    def make(**overrides):
        path = tmp_path / f"model{len(list(tmp_path.iterdir()))}"
        path.mkdir()
        (path / "config.json").write_text(json.dumps({**LLAMA, **overrides}))
        return str(path)
    return make


def with_megatron(registry, block: MegatronPolicyConfig, model_name: str, *overrides: str,
                  cluster: dict | None = None) -> C.MasterConfig:
    """A config that selects the megatron policy with ``block``, built without megatron installed (the
    loader would stop at the missing requirement, exit 3, before the backend's own check)."""
    cfg = load_config(None, list(overrides), registry)
    policy = attrs.evolve(cfg.policy, backend="megatron", model_name=model_name, raw_blocks={},
                          structured_blocks={"megatron": block})
    return attrs.evolve(cfg, policy=policy, cluster=attrs.evolve(cfg.cluster, **(cluster or {})))


def problems(registry, block, model_name, **cluster) -> dict[str, str]:
    found: dict[str, str] = {}
    for key, message in check_components(with_megatron(registry, block, model_name, cluster=cluster), registry):
        found[key] = f"{found[key]} | {message}" if key in found else message
    return found


def test_options_parse_with_the_seed_key_names_and_validate_sizes(registry):
    structure = Structurer(registry).structure
    assert structure({}, MegatronPolicyConfig) == MegatronPolicyConfig()
    got = structure({"tensor_model_parallel_size": 2, "sequence_parallel": True}, MegatronPolicyConfig)
    assert got == MegatronPolicyConfig(tensor_model_parallel_size=2, sequence_parallel=True)
    assert got.model_parallel_size == 2
    for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                "expert_model_parallel_size"):
        with pytest.raises(ConfigError) as info:
            structure({key: 0}, MegatronPolicyConfig)
        assert info.value.problems == [(key, "must be > 0: 0")]
    with pytest.raises(ConfigError) as info:
        structure({"checkpoint_format": "dist"}, MegatronPolicyConfig)
    assert info.value.problems[0][0] == "checkpoint_format"


def test_a_valid_block_has_no_problems(registry, model_dir):
    assert problems(registry, MegatronPolicyConfig(), model_dir()) == {}
    block = MegatronPolicyConfig(tensor_model_parallel_size=2)
    assert problems(registry, block, model_dir(), runtime="ray", policy_workers=4) == {}
    # One data-parallel replica: the distributed optimizer is a no-op, not an error.
    block = MegatronPolicyConfig(tensor_model_parallel_size=2, use_distributed_optimizer=True)
    assert problems(registry, block, model_dir(), runtime="ray", policy_workers=2) == {}
    # A hub name's config.json is not here: the model checks are skipped, the rest still apply.
    assert problems(registry, MegatronPolicyConfig(), "Qwen/Qwen3-0.6B") == {}


@pytest.mark.parametrize(("block", "cluster", "key", "text"), [
    (dict(tensor_model_parallel_size=2), {}, "tensor_model_parallel_size",
     "(2 x 1 x 1 = 2) must divide the policy's world size, cluster.policy_workers (1)"),
    (dict(expert_model_parallel_size=3), dict(runtime="ray", policy_workers=2), "expert_model_parallel_size",
     "3 must divide cluster.policy_workers (2)"),
    (dict(sequence_parallel=True), {}, "sequence_parallel", "needs tensor_model_parallel_size > 1"),
    (dict(apply_rope_fusion=True), dict(device="cpu"), "apply_rope_fusion", "must be false on CPU"),
    (dict(bias_activation_fusion=True), dict(device="cpu"), "bias_activation_fusion", "must be false on CPU"),
    (dict(context_parallel_size=2), dict(device="cpu", runtime="ray", policy_workers=2), "context_parallel_size",
     "must be 1 on CPU"),
    (dict(tensor_model_parallel_size=4), dict(runtime="ray", policy_workers=4), "tensor_model_parallel_size",
     "4 must divide the model's num_key_value_heads (2, "),
    (dict(pipeline_model_parallel_size=2), dict(runtime="ray", policy_workers=2), "pipeline_model_parallel_size",
     "2 must divide the model's num_hidden_layers (3, "),
])
def test_each_check_names_its_key(registry, model_dir, block, cluster, key, text):
    found = problems(registry, MegatronPolicyConfig(**block), model_dir(), **cluster)
    assert list(found) == [f"policy.megatron.{key}"]
    assert text in found[f"policy.megatron.{key}"]


def test_fusions_are_allowed_on_cuda_and_heads_are_checked_against_tp(registry, model_dir):
    block = MegatronPolicyConfig(apply_rope_fusion=True, bias_activation_fusion=True)
    assert problems(registry, block, model_dir(), device="cuda", runtime="ray", gpus_per_node=2,
                    policy_workers=2) == {}
    found = problems(registry, MegatronPolicyConfig(tensor_model_parallel_size=3), model_dir(num_key_value_heads=3),
                     runtime="ray", policy_workers=3)
    assert "num_attention_heads (4, " in found["policy.megatron.tensor_model_parallel_size"]


def test_unsupported_architectures_are_refused(registry, model_dir):
    found = problems(registry, MegatronPolicyConfig(), model_dir(model_type="gpt2"))
    assert list(found) == ["policy.model_name"]
    assert "model_type 'gpt2'" in found["policy.model_name"] and "mbridge 0.15.1 bridges llama" in found[
        "policy.model_name"]
    found = problems(registry, MegatronPolicyConfig(), "builtin:tiny-gpt2")
    assert "built-in model builtin:tiny-gpt2 is model_type 'gpt2'" in found["policy.model_name"]
    # The built-in recipe's Llama-shaped model is built (its shape is known without building it).
    assert problems(registry, MegatronPolicyConfig(), "builtin:tiny-llama") == {}
    found = problems(registry, MegatronPolicyConfig(tensor_model_parallel_size=4), "builtin:tiny-llama",
                     runtime="ray", policy_workers=4)
    assert "num_key_value_heads (2, built-in model builtin:tiny-llama)" in found[
        "policy.megatron.tensor_model_parallel_size"]
    for model_type in S.ARCHITECTURES:
        assert problems(registry, MegatronPolicyConfig(), model_dir(model_type=model_type)) == {}


def test_the_spec_and_config_are_light():
    code = ("import sys, grpo_sdk.backends.megatron.spec as s, grpo_sdk.backends.megatron.config\n"
            "heavy = sorted(m for m in ('torch', 'transformers', 'megatron', 'mbridge') if m in sys.modules)\n"
            "assert not heavy, heavy\n"
            "assert s.POLICY.config == 'grpo_sdk.backends.megatron.config:MegatronPolicyConfig'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_grpoctl_without_megatron_names_the_extra(tmp_path):
    result = run_grpoctl("plugins", "list", cwd=tmp_path)
    row = next(line for line in result.stdout.splitlines() if line.split()[:2] == ["policy", "megatron"])
    assert "missing-requirements" in row and "pip install 'grpo-sdk[megatron]'" in row


def test_grpoctl_config_validate_reports_every_problem_with_exit_2(make_site, model_dir):
    site = make_site()  # megatron-core and mbridge "installed" as metadata only: the loader reaches the check
    site.add("megatron-core", version="0.16.1", entry_points={}, files={})
    site.add("mbridge", version="0.15.1", entry_points={}, files={})
    good = model_dir()
    # The built-in character tokenizer: the model directory holds a config.json only.
    result = site.grpoctl("config", "validate", "policy.backend=megatron", f"policy.model_name={good}",
                          "policy.tokenizer.name=builtin:tiny-gpt2")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "config ok: policy megatron" in result.stdout.lower()
    result = site.grpoctl("config", "validate", "policy.backend=megatron", f"policy.model_name={good}",
                          "cluster.device=cpu", "policy.megatron.pipeline_model_parallel_size=2",
                          "policy.megatron.sequence_parallel=true", "policy.megatron.apply_rope_fusion=true")
    out = result.stdout + result.stderr
    assert result.returncode == 2, out
    assert "Traceback" not in out
    for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "sequence_parallel",
                "apply_rope_fusion"):
        assert f"policy.megatron.{key}:" in out



@pytest.mark.parametrize(("block", "key", "why"), [
    (dict(pipeline_model_parallel_size=3), "pipeline_model_parallel_size", "forward_backward_func"),
    (dict(context_parallel_size=3), "context_parallel_size", "whole row on one rank"),
    (dict(expert_model_parallel_size=3), "expert_model_parallel_size", "expert-data-parallel group"),
    (dict(tensor_model_parallel_size=3, sequence_parallel=True), "sequence_parallel", "finalize_model_grads"),
    (dict(use_distributed_optimizer=True), "use_distributed_optimizer", "own torch AdamW state"),
])
def test_what_the_policy_does_not_run_yet_is_refused_before_the_run(registry, model_dir, block, key, why):
    """Valid Megatron settings the policy has not built: a config error naming the key and why, on CUDA
    too (the same reasons the policy raises when built directly)."""
    found = problems(registry, MegatronPolicyConfig(**block), model_dir(num_attention_heads=3, num_key_value_heads=3,
                                                                        num_hidden_layers=3),
                     device="cuda", runtime="ray", gpus_per_node=3, policy_workers=3)
    assert list(found) == [f"policy.megatron.{key}"], found
    assert "not supported by the megatron policy yet" in found[f"policy.megatron.{key}"] and why in found[
        f"policy.megatron.{key}"]
