"""The embedded hf backend: sampling contract, logprob agreement with the policy, left padding,
weight sync, reference policy, LR schedule and checkpoints, on a tiny local GPT-2."""

from __future__ import annotations

import pytest
import torch

from grpo_sdk.backends.hf.generation import HFGeneration
from grpo_sdk.backends.hf.policy import HFPolicy
from grpo_sdk.plugins.training import lr_lambda
from grpo_sdk.config.loading import load_config
from grpo_sdk.config.context import RunContext
from grpo_sdk.core.records import SamplingParams, TrainBatch
from grpo_sdk.weight_sync.inprocess import InProcessWeightSync
from helpers import prompt_batch, train_batch


def make_context(model_dir, registry, *overrides, kl=0.0):
    cfg = load_config(None, [f"policy.model_name={model_dir}", f"loss_fn.reference_policy_kl_penalty={kl}",
                             *overrides], registry)
    return RunContext(config=cfg, run_dir=model_dir, model_path=str(model_dir), tokenizer_path=str(model_dir),
                      device="cpu", seed=0, needs_reference=kl > 0)


def test_each_row_stops_at_its_first_stop_token(tiny_model_dir, registry, tokenizer):
    gen = HFGeneration(None, make_context(tiny_model_dir, registry))
    digits = tuple(tokenizer.convert_tokens_to_ids(list("0123456789")))
    inputs = prompt_batch(tokenizer, ["12345>"] * 64)
    out = gen.generate(inputs, SamplingParams(max_new_tokens=6, stop_token_ids=digits))
    stops = set(digits) | {tokenizer.eos_token_id}
    assert out.response_ids.shape[0] == 64 and out.response_ids.shape[1] <= 6
    saw_early_stop = False
    for row, length, truncated, logprobs in zip(out.response_ids.tolist(), out.response_lengths.tolist(),
                                                out.truncated.tolist(), out.logprobs):
        first_stop = next((i for i, tok in enumerate(row[:length]) if tok in stops), None)
        if truncated:
            assert first_stop is None and length == 6
        else:
            assert first_stop == length - 1  # the stop token is the last generated token
            saw_early_stop |= length < 6
        assert all(tok == tokenizer.pad_token_id for tok in row[length:])
        assert torch.all(logprobs[length:] == 0) and torch.all(logprobs[:length] < 0)
    assert saw_early_stop, "with 11 of 25 tokens stopping, some rows must stop early"


@pytest.mark.parametrize("sampling", [
    dict(temperature=1.0), dict(temperature=0.7, top_k=5), dict(temperature=1.3, top_p=0.8),
    dict(temperature=0.9, top_k=8, top_p=0.9),
])
def test_generation_logprobs_equal_the_policys(tiny_model_dir, registry, tokenizer, sampling):
    """The logprob the sampler reports is the one the policy computes for the same token, under the
    same temperature / top-k / top-p transform; prompts of different lengths are left-padded."""
    overrides = [f"policy.generation.{k}={v}" for k, v in sampling.items()]
    context = make_context(tiny_model_dir, registry, *overrides)
    gen, policy = HFGeneration(None, context), HFPolicy(None, context)
    inputs = prompt_batch(tokenizer, ["1>", "12345>", "987>", "55555555>"] * 8)
    out = gen.generate(inputs, SamplingParams(max_new_tokens=8, **sampling))
    batch = train_batch(inputs, out)
    policy_logprobs = policy.logprobs(batch)
    mask = batch.token_mask.bool()
    torch.testing.assert_close(policy_logprobs[mask], batch.generation_logprobs[mask], atol=2e-5, rtol=0)
    assert torch.isfinite(policy_logprobs[mask]).all()


def test_left_padding_does_not_change_logprobs(tiny_model_dir, registry, tokenizer):
    policy = HFPolicy(None, make_context(tiny_model_dir, registry))
    alone = prompt_batch(tokenizer, ["12>34"])
    padded = prompt_batch(tokenizer, ["12>34", "1234567>89"])
    def logprobs(inputs):
        rows = inputs.input_ids.shape[0]
        return policy.logprobs(TrainBatch(
            input_ids=inputs.input_ids, attention_mask=inputs.attention_mask, token_mask=inputs.attention_mask.float(),
            sample_mask=torch.ones(rows), generation_logprobs=torch.zeros(inputs.input_ids.shape),
            group_ids=torch.zeros(rows, dtype=torch.long), rewards=torch.zeros(rows)))
    width = alone.input_ids.shape[1]
    torch.testing.assert_close(logprobs(padded)[0, -width + 1:], logprobs(alone)[0, 1:], atol=1e-5, rtol=0)


def test_sampling_is_reproducible_from_the_seed(tiny_model_dir, registry, tokenizer):
    context = make_context(tiny_model_dir, registry)
    inputs = prompt_batch(tokenizer, ["12345>"] * 16)
    first = HFGeneration(None, context).generate(inputs, SamplingParams(max_new_tokens=5))
    second = HFGeneration(None, context).generate(inputs, SamplingParams(max_new_tokens=5))
    assert torch.equal(first.response_ids, second.response_ids)


def test_training_then_weight_sync_makes_generation_match_the_policy(tiny_model_dir, registry, tokenizer):
    from grpo_sdk.algorithms.loss import ClippedPGLoss

    context = make_context(tiny_model_dir, registry, "policy.optimizer.lr=0.01", kl=0.1)
    gen, policy = HFGeneration(None, context), HFPolicy(None, context)
    inputs = prompt_batch(tokenizer, ["12345>"] * 8)
    batch = train_batch(inputs, gen.generate(inputs, SamplingParams(max_new_tokens=5)))
    batch.advantages = torch.randn(8, 1).expand_as(batch.token_mask).contiguous()
    reference_before = policy.reference_logprobs(batch)
    batch.reference_logprobs = reference_before
    metrics = policy.train(batch, ClippedPGLoss(context.config.loss_fn))
    assert metrics["grad_norm"] > 0 and metrics["lr"] == pytest.approx(0.01)

    changed = policy.logprobs(batch)
    assert not torch.allclose(changed, reference_before)  # the policy moved...
    torch.testing.assert_close(policy.reference_logprobs(batch), reference_before)  # ...the reference did not

    stats = InProcessWeightSync(None, context).sync_weights(policy, gen, version=1)
    assert stats.version == 1 and stats.num_tensors > 0 and stats.num_bytes > 0
    policy_state = policy.model.state_dict()
    assert all(torch.equal(t, policy_state[n]) for n, t in gen.model.state_dict().items())
    out = gen.generate(inputs, SamplingParams(max_new_tokens=5))
    assert out.weight_version == 1
    synced = train_batch(inputs, out)
    mask = synced.token_mask.bool()
    torch.testing.assert_close(policy.logprobs(synced)[mask], synced.generation_logprobs[mask], atol=2e-5, rtol=0)


def test_checkpoint_round_trip(tiny_model_dir, registry, tmp_path):
    context = make_context(tiny_model_dir, registry)
    policy = HFPolicy(None, context)
    with torch.no_grad():
        for p in policy.model.parameters():
            p.add_(0.01)
    policy.save_checkpoint(str(tmp_path / "ckpt"))
    fresh = HFPolicy(None, context)
    fresh.load_checkpoint(str(tmp_path / "ckpt"))
    for (name, a), (_, b) in zip(policy.model.state_dict().items(), fresh.model.state_dict().items()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("schedule, expected", [
    ("constant", [1 / 3, 2 / 3, 1.0, 1.0, 1.0, 1.0, 1.0]),
    ("linear", [1 / 3, 2 / 3, 1.0, 1.0, 0.7, 0.4, 0.1]),
    ("cosine", [1 / 3, 2 / 3, 1.0, 1.0, 0.1 + 0.9 * 0.75, 0.1 + 0.9 * 0.25, 0.1]),
])
def test_lr_schedule(schedule, expected):
    """Warmup reaches the peak on its last step; decay reaches min_lr_ratio at total_steps."""
    got = [lr_lambda(s, warmup_steps=3, total_steps=6, schedule=schedule, min_lr_ratio=0.1) for s in range(7)]
    assert got == pytest.approx(expected, abs=1e-9)


def test_missing_model_directory_is_a_clear_error(tmp_path, registry, tiny_model_dir):
    from grpo_sdk.core.errors import ModelLoadError

    context = make_context(tiny_model_dir, registry)
    bad = RunContext(**{**{f: getattr(context, f) for f in ("config", "run_dir", "device", "seed", "needs_reference")},
                        "model_path": str(tmp_path / "nope"), "tokenizer_path": str(tmp_path / "nope")})
    with pytest.raises(ModelLoadError, match=r"no model directory at .*nope"):
        HFPolicy(None, bad)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match=r"holds no config.json"):
        HFGeneration(None, RunContext(**{**{f: getattr(bad, f) for f in ("config", "run_dir", "device", "seed",
                                                                          "needs_reference", "tokenizer_path")},
                                         "model_path": str(tmp_path / "empty")}))


def test_sample_categorical_draws_from_the_distribution():
    from grpo_sdk.algorithms.sampling import sample_categorical

    probs = torch.tensor([[0.0, 0.5, 0.0, 0.3, 0.2, 0.0]]).repeat(40000, 1)
    draws = sample_categorical(probs, torch.Generator().manual_seed(0))
    freq = torch.bincount(draws, minlength=6).float() / len(draws)
    assert freq[[0, 2, 5]].sum() == 0  # zero-probability tokens are never drawn
    torch.testing.assert_close(freq, probs[0], atol=0.01, rtol=0)


def test_bfloat16_policy_trains(tiny_model_dir, registry, tokenizer):
    from grpo_sdk.algorithms.loss import ClippedPGLoss

    context = make_context(tiny_model_dir, registry, "policy.precision=bfloat16")
    gen, policy = HFGeneration(None, context), HFPolicy(None, context)
    inputs = prompt_batch(tokenizer, ["12345>"] * 4)
    batch = train_batch(inputs, gen.generate(inputs, SamplingParams(max_new_tokens=5)))
    batch.advantages = torch.randn(4, 1).expand_as(batch.token_mask).contiguous()
    metrics = policy.train(batch, ClippedPGLoss(context.config.loss_fn))
    assert next(policy.model.parameters()).dtype == torch.bfloat16 and metrics["grad_norm"] > 0


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.compile internals on torch.jit
def test_compiled_generation_agrees_with_the_policy(tiny_model_dir, registry, tokenizer):
    """`policy.generation.hf.compile: true`: static cache, bucketed prompt width, compiled forward;
    the same contract as eager sampling (takes ~20-40 s: torch.compile on CPU)."""
    from grpo_sdk.backends.hf.config import HFGenerationConfig

    context = make_context(tiny_model_dir, registry, "policy.generation.temperature=0.8")
    gen, policy = HFGeneration(HFGenerationConfig(compile=True), context), HFPolicy(None, context)
    for texts in (["1>", "12345>", "987>", "55555555>"] * 4, ["12>", "3456>"] * 8):  # two prompt widths
        inputs = prompt_batch(tokenizer, texts)
        out = gen.generate(inputs, SamplingParams(max_new_tokens=6, temperature=0.8))
        batch = train_batch(inputs, out)
        mask = batch.token_mask.bool()
        assert mask.sum() > 0
        torch.testing.assert_close(policy.logprobs(batch)[mask], batch.generation_logprobs[mask], atol=2e-5, rtol=0)
