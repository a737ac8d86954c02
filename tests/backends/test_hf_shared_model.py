"""One model copy in one process (policy.generation.hf.share_policy_model) and the hf policy's precision
and memory switches (policy.hf.autocast, policy.hf.gradient_checkpointing), on a tiny local GPT-2."""

from __future__ import annotations

import pytest
import torch

from grpo_sdk.backends.hf.config import HFGenerationConfig, shares_policy_model
from grpo_sdk.backends.hf.generation import HFGeneration
from grpo_sdk.backends.hf.policy import HFPolicy
from grpo_sdk.config.schema import plugin_config
from grpo_sdk.config.loading import load_config
from grpo_sdk.config.context import RunContext
from grpo_sdk.core.records import SamplingParams
from grpo_sdk.algorithms.loss import ClippedPGLoss
from grpo_sdk.weight_sync.inprocess import InProcessWeightSync
from helpers import config_problems, prompt_batch, small_trainer, train_batch

KEY = "policy.generation.hf.share_policy_model"


def make_context(model_dir, run_dir, registry, *overrides):
    cfg = load_config(None, [f"policy.model_name={model_dir}", *overrides], registry)
    return RunContext(config=cfg, run_dir=run_dir, model_path=str(model_dir), tokenizer_path=str(model_dir),
                      device="cpu", seed=0, needs_reference=False)


# --- when the module is shared ------------------------------------------------------------------

@pytest.mark.parametrize("overrides, shared", [
    ([], True),
    ([f"{KEY}=false"], False),
    (["policy.generation.hf.compile=true"], False),
    (["policy.generation.colocated.enabled=false"], False),
    (["weight_sync.backend=disk"], False),
    (["policy.hf.attn_implementation=eager"], False),  # the generation's kernel is transformers' choice
])
def test_auto_shares_only_where_it_can_work(registry, tiny_model_dir, overrides, shared):
    cfg = load_config(None, [f"policy.model_name={tiny_model_dir}", *overrides], registry)
    assert shares_policy_model(cfg, plugin_config(cfg.policy.generation)) is shared


@pytest.mark.parametrize("overrides, reason", [
    (["policy.generation.hf.compile=true"], "compile=true"),
    (["weight_sync.backend=disk"], "weight_sync.backend=disk"),
    (["policy.generation.colocated.enabled=false"], "colocated.enabled=false"),
    (["policy.hf.attn_implementation=eager"], "attn_implementation"),
    (["grpo.async_grpo.enabled=true", "loss_fn.use_importance_sampling_correction=true"], "async GRPO"),
])
def test_true_where_sharing_cannot_work_is_a_config_error_naming_the_key(registry, tiny_model_dir, overrides,
                                                                         reason):
    problems = config_problems(registry, f"policy.model_name={tiny_model_dir}", f"{KEY}=true", *overrides)
    assert reason in problems[KEY] and "auto" in problems[KEY], problems


def test_cli_exits_2_on_an_impossible_share(cli, tiny_model_dir):
    code, out, err = cli("config", "validate", f"policy.model_name={tiny_model_dir}", f"{KEY}=true",
                         "policy.generation.hf.compile=true")
    assert code == 2 and KEY in out + err and "Traceback" not in out + err


def test_true_without_a_policy_in_the_process_fails_clearly(registry, tiny_model_dir, tmp_path):
    context = make_context(tiny_model_dir, tmp_path, registry, f"{KEY}=true")
    with pytest.raises(RuntimeError, match="no hf policy of this run"):
        HFGeneration(plugin_config(context.config.policy.generation), context)
    # auto: a generation built on its own has a copy of its own
    assert not HFGeneration(None, make_context(tiny_model_dir, tmp_path, registry)).shares_policy_model


# --- the shared module --------------------------------------------------------------------------

def test_shared_generation_uses_the_policy_module_and_the_sync_copies_nothing(registry, tiny_model_dir, tmp_path,
                                                                              tokenizer):
    context = make_context(tiny_model_dir, tmp_path, registry)
    policy = HFPolicy(None, context)
    gen = HFGeneration(None, context)
    assert gen.shares_policy_model and gen.model is policy.model and policy.shared_with_generation
    assert all(p.requires_grad for p in policy.model.parameters())  # sampling did not freeze the trained module

    def never():
        raise AssertionError("the shared generation read the weights")
        yield  # pragma: no cover

    policy.named_weights = never
    stats = InProcessWeightSync(None, context).sync_weights(policy, gen, version=3)
    assert (stats.version, stats.num_tensors, stats.num_bytes, gen.weight_version) == (3, 0, 0, 3)

    # A train step, then sampling: no gradient, no optimizer state and no weight changes.
    inputs = prompt_batch(tokenizer, ["12>", "345>", "6>"])
    sampling = SamplingParams(max_new_tokens=5)
    batch = train_batch(inputs, gen.generate(inputs, sampling))
    batch.advantages = torch.tensor([[1.0], [-1.0], [0.5]]).expand_as(batch.token_mask).contiguous()
    policy.train(batch, ClippedPGLoss(context.config.loss_fn))
    grads = [p.grad.clone() for p in policy.params]
    state = {k: v.clone() for s in policy.optimizer.state.values() for k, v in s.items() if torch.is_tensor(v)}
    weights = {k: v.clone() for k, v in policy.model.state_dict().items()}
    policy.offload()  # colocated: the shared module stays where the generation samples with it
    gen.prepare_for_generation()
    gen.generate(inputs, sampling)
    gen.finish_generation()
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, policy.params))
    after = {k: v for s in policy.optimizer.state.values() for k, v in s.items() if torch.is_tensor(v)}
    assert all(torch.equal(state[k], after[k]) for k in state)
    assert all(torch.equal(v, policy.model.state_dict()[k]) for k, v in weights.items())
    gen.shutdown()
    assert not policy.shared_with_generation


def test_a_shared_module_off_the_generation_device_is_onloaded_before_sampling(registry, tiny_model_dir, tmp_path):
    context = make_context(tiny_model_dir, tmp_path, registry)
    policy = HFPolicy(None, context)
    gen = HFGeneration(None, context)
    calls = []
    policy.onload = lambda: calls.append("onload")
    gen.prepare_for_generation()
    assert calls == []  # on its device: nothing to move
    gen.device = torch.device("meta")  # stands for the accelerator an offload moved the module off
    gen.prepare_for_generation()
    assert calls == ["onload"]


def _run(registry, run_dir, model_dir, share):
    trainer = small_trainer(registry, run_dir, model_dir, f"{KEY}={share}", "grpo.max_num_steps=3",
                            "grpo.val_period=0")
    parts = trainer.components
    assert parts.generation.shares_policy_model is (share == "true")
    sampled = []
    generate, poll = parts.generation.generate, parts.generation.poll

    def record(out):
        sampled.append((out.response_ids.clone(), out.logprobs.clone(), out.weight_version))
        return out

    def polled(timeout_s):  # rollouts stream their requests into the sampler (submit / poll)
        done = poll(timeout_s)
        for _, out in sorted(done, key=lambda pair: pair[0]):
            record(out)
        return done

    parts.generation.generate = lambda prompts, sampling: record(generate(prompts, sampling))
    parts.generation.poll = polled
    trainer.train()
    weights = {k: v.clone() for k, v in parts.policy.model.state_dict().items()}
    return sampled, weights


def test_shared_and_copy_runs_sample_the_same_tokens_and_logprobs(registry, tiny_model_dir, tmp_path):
    shared, shared_weights = _run(registry, tmp_path / "shared", tiny_model_dir, "true")
    copy, copy_weights = _run(registry, tmp_path / "copy", tiny_model_dir, "false")
    assert len(shared) == len(copy) >= 3  # three steps (and the validation of the end)
    for (ids_a, lp_a, v_a), (ids_b, lp_b, v_b) in zip(shared, copy):
        assert torch.equal(ids_a, ids_b) and torch.equal(lp_a, lp_b) and v_a == v_b
    assert [v for *_, v in shared][:3] == [0, 1, 2]  # the no-op sync still moved the version every step
    assert all(torch.equal(shared_weights[k], copy_weights[k]) for k in copy_weights)


# --- autocast ---------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, message", [
    (["policy.precision=bfloat16"], "needs policy.precision=float32"),
    (["policy.precision=float16"], "needs policy.precision=float32"),
])
def test_autocast_needs_float32_master_weights(registry, tiny_model_dir, overrides, message):
    problems = config_problems(registry, f"policy.model_name={tiny_model_dir}", "policy.hf.autocast=bfloat16",
                               *overrides)
    assert message in problems["policy.hf.autocast"]
    assert "expected one of 'bfloat16'" in config_problems(registry, "policy.hf.autocast=float16")["policy.hf.autocast"]


def _policy(model_dir, run_dir, registry, *overrides):
    context = make_context(model_dir, run_dir, registry, *overrides)
    return HFPolicy(plugin_config(context.config.policy), context), context


def _batch(tokenizer, context):
    torch.manual_seed(0)
    gen = HFGeneration(HFGenerationConfig(share_policy_model=False), context)
    inputs = prompt_batch(tokenizer, ["12>", "345>", "6789>", "0>"])
    batch = train_batch(inputs, gen.generate(inputs, SamplingParams(max_new_tokens=6)))
    batch.advantages = torch.tensor([[1.0], [-1.0], [0.5], [-0.5]]).expand_as(batch.token_mask).contiguous()
    return batch


def _moved_fraction(policy, batch, context):
    before = [p.detach().clone() for p in policy.params]
    policy.train(batch, ClippedPGLoss(context.config.loss_fn))
    moved = sum(int((b != p.detach()).sum()) for b, p in zip(before, policy.params))
    return moved / sum(p.numel() for p in policy.params)


def test_autocast_keeps_float32_master_weights_that_a_small_lr_moves(registry, tiny_model_dir, tmp_path, tokenizer):
    lr = ["policy.optimizer.lr=1e-6", "policy.optimizer.weight_decay=0.0"]
    mixed, context = _policy(tiny_model_dir, tmp_path, registry, "policy.hf.autocast=bfloat16", *lr)
    assert all(p.dtype == torch.float32 for p in mixed.params)
    batch = _batch(tokenizer, context)
    moved_mixed = _moved_fraction(mixed, batch, context)
    assert all(v.dtype == torch.float32 for s in mixed.optimizer.state.values() for v in s.values()
               if torch.is_tensor(v) and v.dim())
    pure, pure_context = _policy(tiny_model_dir, tmp_path / "bf16", registry, "policy.precision=bfloat16", *lr)
    moved_pure = _moved_fraction(pure, batch, pure_context)
    # AdamW moves every weight with a gradient by ~lr; bf16 rounds a 1e-6 step of a weight ~0.02 away.
    assert moved_mixed > 0.9, moved_mixed
    assert moved_pure < 0.1, moved_pure


def test_autocast_logprobs_are_close_to_float32_and_sampling_agrees(registry, tiny_model_dir, tmp_path, tokenizer):
    full, context = _policy(tiny_model_dir, tmp_path, registry)
    mixed, mixed_context = _policy(tiny_model_dir, tmp_path / "mixed", registry, "policy.hf.autocast=bfloat16")
    batch = _batch(tokenizer, context)
    reference, autocast = full.logprobs(batch), mixed.logprobs(batch)
    assert autocast.dtype == torch.float32
    mask = batch.token_mask.bool()
    assert (reference[mask] - autocast[mask]).abs().max() < 0.01  # measured 0.0015
    assert not torch.equal(reference[mask], autocast[mask])  # autocast did run in bfloat16

    # The shared generation samples under the policy's autocast: its logprobs are the policy's.
    gen = HFGeneration(None, mixed_context)
    assert gen.model is mixed.model
    inputs = prompt_batch(tokenizer, ["12>", "345>", "6789>", "0>"])
    out = gen.generate(inputs, SamplingParams(max_new_tokens=6))
    sampled = train_batch(inputs, out)
    sampled_mask = sampled.token_mask.bool()
    trained = mixed.logprobs(sampled)[sampled_mask]
    assert (trained - sampled.generation_logprobs[sampled_mask]).abs().max() < 0.01
    # ... and a copy of its own samples the same tokens with the same logprobs under the same autocast
    copy = HFGeneration(HFGenerationConfig(share_policy_model=False), mixed_context)
    again = copy.generate(inputs, SamplingParams(max_new_tokens=6, seed=0))
    assert torch.equal(again.response_ids, gen.generate(inputs, SamplingParams(max_new_tokens=6, seed=0)).response_ids)


def test_gradient_checkpointing_recomputes_layers_and_keeps_the_gradients(registry, tiny_model_dir, tmp_path,
                                                                          tokenizer):
    results = {}
    for checkpointing in (False, True):
        policy, context = _policy(tiny_model_dir, tmp_path / str(checkpointing), registry,
                                  f"policy.hf.gradient_checkpointing={str(checkpointing).lower()}",
                                  "policy.optimizer.lr=1e-9")
        batch = _batch(tokenizer, context)
        policy.logprobs(batch)  # the chunked head's one-time probe of the model runs here, not counted
        calls = []
        for block in policy.model.transformer.h:
            block.ln_1.register_forward_hook(lambda *_: calls.append(torch.is_grad_enabled()))
        policy.train(batch, ClippedPGLoss(context.config.loss_fn))
        layers = len(policy.model.transformer.h)
        results[checkpointing] = (len(calls) // layers, [p.grad.clone() for p in policy.params])
        policy.logprobs(batch)  # without gradients no layer is recomputed
        assert len(calls) // layers == results[checkpointing][0] + 1
    assert results[False][0] == 1 and results[True][0] == 2  # forward, and again in backward
    for a, b in zip(results[False][1], results[True][1]):
        torch.testing.assert_close(a, b)


def test_a_run_with_every_switch_on_trains_on_one_module(registry, tiny_model_dir, tmp_path):
    trainer = small_trainer(registry, tmp_path / "run", tiny_model_dir, "policy.hf.autocast=bfloat16",
                            "policy.hf.gradient_checkpointing=true", "grpo.val_period=0")
    parts = trainer.components
    assert parts.generation.model is parts.policy.model
    before = {k: v.clone() for k, v in parts.policy.model.state_dict().items()}
    summary = trainer.train()
    assert summary.steps == 2 and all(p.dtype == torch.float32 for p in parts.policy.params)
    assert any(not torch.equal(v, parts.policy.model.state_dict()[k]) for k, v in before.items())


@pytest.mark.parametrize("share", [True, False])
def test_sampling_casts_the_linear_weights_once_and_samples_exactly_what_autocast_would(registry, tmp_path,
                                                                                        tokenizer, share):
    from grpo_sdk.recipes.tiny_model import build_tiny_llama

    llama = build_tiny_llama(tmp_path / "llama", seed=0)  # nn.Linear layers throughout (GPT-2 has Conv1D)
    policy, context = _policy(llama, tmp_path, registry, "policy.hf.autocast=bfloat16")
    gen = HFGeneration(HFGenerationConfig(share_policy_model=share), context)
    assert gen.shares_policy_model is share and gen.autocast_dtype == torch.bfloat16
    casts = []
    real = gen._forward

    def counting(**kwargs):
        before = gen._low_precision
        out = real(**kwargs)
        casts.append(gen._low_precision is not before)
        return out

    gen._forward = counting
    inputs = prompt_batch(tokenizer, ["12>", "345>", "6789>", "0>"])
    sampling = SamplingParams(max_new_tokens=8, seed=0, stop_token_ids=(999,))
    cast_once = gen.generate(inputs, sampling)
    assert casts[0] and not any(casts[1:]) and len(casts) > 2  # one cast for the prefill and every decode step
    assert gen._low_precision is None  # not kept between calls
    gen.autocast_dtype = None  # autocast's own cast at every step
    per_step = gen.generate(inputs, sampling)
    assert torch.equal(cast_once.response_ids, per_step.response_ids)
    assert torch.equal(cast_once.logprobs, per_step.logprobs)


def test_a_shared_lora_policy_samples_with_its_adapters_folded_into_the_casts(registry, tmp_path):
    """bf16 autocast + LoRA: the sampler runs the base Linears in place of peft's layers, each with one
    cast of W + s * B @ A (not base + A + B per layer), and its logprobs are the trained policy's, not
    the base's; peft's layers are back for training afterwards, also when sampling fails. (A Llama:
    GPT-2's Conv1D layers are not folded.)"""
    pytest.importorskip("peft")
    from grpo_sdk.backends.hf.lora import lora_layers
    from grpo_sdk.core.models import load_tokenizer
    from test_fsdp import build_tiny_llama

    model_dir = build_tiny_llama(tmp_path / "llama")
    context = make_context(model_dir, tmp_path, registry, "policy.lora.enabled=true", "policy.lora.rank=8",
                           "policy.hf.autocast=bfloat16", "policy.optimizer.lr=0.02")
    policy = HFPolicy(plugin_config(context.config.policy), context)
    gen = HFGeneration(None, context)
    assert gen.shares_policy_model
    inputs = prompt_batch(load_tokenizer(str(model_dir)), ["12>", "345>", "6789>", "0>"] * 4)
    sampling = SamplingParams(max_new_tokens=6)
    batch = train_batch(inputs, gen.generate(inputs, sampling))
    batch.advantages = torch.linspace(-1, 1, 16)[:, None].expand_as(batch.token_mask).contiguous()
    for _ in range(4):  # B moves off zero: the adapters now change the logprobs
        policy.train(batch, ClippedPGLoss(context.config.loss_fn))

    calls, tree = [], {name: type(m) for name, m in policy.model.named_modules()}
    hooks = [layer.lora_A["default"].register_forward_hook(lambda *_: calls.append(1))
             for layer in lora_layers(policy.model).values()]
    sampled = train_batch(inputs, gen.generate(inputs, sampling))
    assert calls == []  # no adapter pass while sampling: folded
    assert {name: type(m) for name, m in policy.model.named_modules()} == tree  # peft's layers are back
    trained = policy.logprobs(sampled)
    assert calls  # the policy's own forward runs the adapters again
    for hook in hooks:
        hook.remove()
    base = policy.reference_logprobs(sampled)
    mask, sampler = sampled.token_mask > 0, sampled.generation_logprobs  # [B, T], aligned with the tokens
    assert trained.shape == sampler.shape
    to_trained, to_base = (sampler - trained)[mask].abs().max(), (sampler - base)[mask].abs().max()
    assert to_trained < 0.02 and to_base > 5 * to_trained, (float(to_trained), float(to_base))

    def fails(*_, **__):
        assert type(policy.model.get_submodule(next(iter(lora_layers_before)))) is torch.nn.Linear  # swapped
        raise RuntimeError("sampling failed")

    lora_layers_before = lora_layers(policy.model)
    gen._forward = fails  # inside the sampling modes, whichever loop samples
    with pytest.raises(RuntimeError, match="sampling failed"):
        gen.generate(inputs, sampling)
    assert {name: type(m) for name, m in policy.model.named_modules()} == tree  # restored after a failure too
