"""The run plan's memory estimate (``grpo_sdk.cli.memory_plan``): every part is there, each grows with
the settings that grow it in a run, and the per-model figures are counted again on real models:
the activations autograd saves (``saved_tensors_hooks``) on architectures of other shapes than
the ones the coefficients were counted on, the KV cache transformers builds, the LoRA adapters peft
adds. How close the total comes to measured peak RSS is benchmarks/memory_plan.py's to say
(docs/benchmarks.md#memory-plan): a machine-dependent figure, not a unit test.
"""

from __future__ import annotations

import pytest

from grpo_sdk.cli.memory_plan import PROCESS_BYTES, activation_bytes_per_token, model_shape
from grpo_sdk.cli.plan import make_plan
from grpo_sdk.config.loading import load_config

PHASES = ("activations", "logits", "kv_cache")
EVERY_PART = {"process", "weights", "gradients", "adamw_moments", "generation_weights", *PHASES, "total"}


def plan_parts(registry, *overrides, longest_prompt=None):
    cfg = load_config(None, list(overrides), registry)
    return make_plan(cfg, registry, longest_prompt=longest_prompt).memory_bytes


def test_the_built_in_recipe_has_every_part_and_the_total_is_the_peak_phase(registry):
    parts = plan_parts(registry)
    assert EVERY_PART <= set(parts) and all(v >= 0 for v in parts.values())
    assert parts["process"] == PROCESS_BYTES and parts["generation_weights"] == 0  # the hf generation shares
    lasting = sum(v for k, v in parts.items() if k not in (*PHASES, "total"))
    training, sampling = parts["activations"] + parts["logits"], parts["kv_cache"]
    assert parts["total"] == lasting + max(training, sampling)


@pytest.mark.parametrize("part, small, large", [
    ("activations", ["policy.train_micro_batch_size=16"], ["policy.train_micro_batch_size=64"]),
    ("activations", ["policy.generation.max_new_tokens=5"], ["policy.generation.max_new_tokens=20"]),
    ("kv_cache", ["grpo.num_generations_per_prompt=4", "grpo.val_period=0", "grpo.val_at_end=false"],
     ["grpo.num_generations_per_prompt=16", "grpo.val_period=0", "grpo.val_at_end=false"]),
    ("kv_cache", ["policy.generation.max_new_tokens=5"], ["policy.generation.max_new_tokens=20"]),
    ("logits", ["policy.logprob_chunk_size=8"], ["policy.logprob_chunk_size=64"]),
    ("activations", ["policy.hf.gradient_checkpointing=true"], []),
    ("activations", ["policy.hf.autocast=bfloat16"], []),
    ("generation_weights", [], ["policy.generation.hf.share_policy_model=false"]),
    ("gradients", ["policy.lora.enabled=true"], []),
    ("adamw_moments", ["policy.lora.enabled=true"], []),
])
def test_each_part_grows_with_the_setting_that_grows_it(registry, part, small, large):
    # the longest prompt as --dry-run finds it: without it, sequences are the config's bound whatever max_new_tokens
    assert plan_parts(registry, *small, longest_prompt=6)[part] < plan_parts(registry, *large, longest_prompt=6)[part]


def test_autocast_lora_and_the_kl_penalty_add_their_own_parts(registry):
    assert "autocast_copies" not in plan_parts(registry)
    assert plan_parts(registry, "policy.hf.autocast=bfloat16")["autocast_copies"] > 0
    lora = plan_parts(registry, "policy.lora.enabled=true", "loss_fn.reference_policy_kl_penalty=0.05")
    assert lora["lora_adapters"] > 0 and "reference_model" not in lora  # the base with the adapters off
    full = plan_parts(registry, "loss_fn.reference_policy_kl_penalty=0.05")
    assert full["reference_model"] == full["weights"]
    halved = plan_parts(registry, "policy.lora.enabled=true", "policy.optimizer.moments_dtype=bfloat16")
    plain = plan_parts(registry, "policy.lora.enabled=true")
    assert halved["lora_adapters"] * 16 == plain["lora_adapters"] * 12  # 4 + 4 + 4 B against 4 + 4 + 8 B a value


def test_the_longest_prompt_found_in_the_data_replaces_the_config_bound(registry):
    overrides = ["policy.max_total_sequence_length=64", "policy.generation.max_new_tokens=8"]
    bound = plan_parts(registry, *overrides)
    measured = plan_parts(registry, *overrides, longest_prompt=10)
    assert measured["activations"] == pytest.approx(bound["activations"] * 18 / 64)  # 10 + 8 tokens, not 64
    assert measured["kv_cache"] < bound["kv_cache"]


# --- counted on real models -------------------------------------------------------------------------------


def saved_bytes_per_token(model, tokens_a: int, tokens_b: int, autocast: bool) -> float:
    """What autograd saves for backward per token, summed over the layers: the slope between two
    lengths, so whatever does not grow with the tokens (autocast's weight copies) drops out."""
    import torch

    def saved(length: int) -> int:
        storages: dict[int, int] = {}

        def pack(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        ids = torch.randint(0, 30, (2, length))
        model.eval()  # as the policy runs it: no dropout
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model.base_model(input_ids=ids, attention_mask=torch.ones_like(ids))
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        return sum(n for ptr, n in storages.items() if ptr not in params)

    return (saved(tokens_b) - saved(tokens_a)) / (2 * (tokens_b - tokens_a))


LLAMA = dict(hidden_size=96, intermediate_size=352, num_hidden_layers=3, num_attention_heads=6,
             num_key_value_heads=2, head_dim=16, vocab_size=64, tie_word_embeddings=True)


@pytest.mark.parametrize("family, autocast", [("llama", False), ("llama", True), ("gpt2", False)])
def test_the_activation_coefficients_hold_on_a_model_of_another_shape(tmp_path, family, autocast):
    import torch
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

    torch.manual_seed(0)
    torch.set_num_threads(1)
    config = LlamaConfig(**LLAMA) if family == "llama" else GPT2Config(n_embd=48, n_layer=3, n_head=4, vocab_size=64,
                                                                        n_positions=256)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    config.save_pretrained(tmp_path)
    shape = model_shape(str(tmp_path))
    counted = saved_bytes_per_token(model, 64, 192, autocast)
    assert activation_bytes_per_token(shape, autocast) == pytest.approx(counted, rel=0.15)


def test_the_kv_cache_is_the_one_transformers_builds(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**LLAMA)
    model = AutoModelForCausalLM.from_config(config)
    config.save_pretrained(tmp_path)
    shape = model_shape(str(tmp_path))
    rows, length = 3, 40
    with torch.no_grad():
        cache = model(input_ids=torch.randint(0, 30, (rows, length)), use_cache=True).past_key_values
    built = sum(t.nbytes for layer in cache.layers for t in (layer.keys, layer.values))
    assert built == rows * length * shape.layers * 2 * shape.kv_heads * shape.head_dim * 4


def test_the_lora_adapters_are_the_ones_peft_adds(tmp_path):
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**LLAMA)
    model = get_peft_model(AutoModelForCausalLM.from_config(config), LoraConfig(r=4, target_modules="all-linear"))
    config.save_pretrained(tmp_path)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert model_shape(str(tmp_path)).lora_parameters(4) == trainable


def test_a_model_of_unknown_shape_leaves_the_phases_out_and_says_so(registry, tmp_path):
    import torch
    from safetensors.torch import save_file

    (tmp_path / "config.json").write_text('{"model_type": "mamba", "vocab_size": 10}')
    save_file({"w": torch.zeros(10, 4)}, str(tmp_path / "model.safetensors"))  # counted from the headers
    cfg = load_config(None, [f"policy.model_name={tmp_path}"], registry)
    plan = make_plan(cfg, registry)
    assert plan.model.params == 40 and model_shape(str(tmp_path)) is None
    assert not set(PHASES) & set(plan.memory_bytes) and plan.memory_bytes["weights"] == 160
    assert "not counted: activations, logits and the KV cache (no shape known" in plan.render()
