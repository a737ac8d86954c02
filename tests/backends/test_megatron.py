"""The Megatron-Core lane: a Megatron-Core GPTModel built from a Hugging Face model directory through
verl's mbridge gives the Hugging Face model's logprobs, and exports its weights back in HF names.

These need megatron-core and mbridge, which live in their own virtual environment
(`.ci/megatron-venv`, run by `.ci/megatron-lane`); in the main environment they are skipped. On CPU
the model runs with the test-only shims in grpo_sdk.backends.megatron.cpu_shims.
"""

from __future__ import annotations

import os
import socket

import pytest

from helpers import MEGATRON_LANE

pytestmark = MEGATRON_LANE

VOCAB = 128
TOL = 1e-5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def mcore_world():
    """Gloo world of size 1, Megatron model parallel state (TP=1, PP=1) and the CPU shims."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from megatron.core import parallel_state

    from grpo_sdk.backends.megatron import cpu_shims

    undo = cpu_shims.apply() if not torch.cuda.is_available() else (lambda: None)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", world_size=1, rank=0
    )
    parallel_state.initialize_model_parallel(1, 1)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
        undo()


def _tiny_hf_dir(tmp_path, kind: str) -> str:
    import torch
    import transformers

    common = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rms_norm_eps=1e-6, tie_word_embeddings=False, attention_dropout=0.0,
        initializer_range=0.1,  # wider than the default 0.02, so the logprobs spread over several nats
    )
    if kind == "llama":
        config = transformers.LlamaConfig(**common)
        cls = transformers.LlamaForCausalLM
    else:
        config = transformers.Qwen2Config(**common)
        cls = transformers.Qwen2ForCausalLM
    torch.manual_seed(1234)
    model = cls(config).to(torch.float32)
    # Random init leaves norms at 1 and Qwen2's qkv biases at 0: perturb every tensor so a swapped
    # or dropped weight shows in the comparison.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    path = tmp_path / kind
    model.save_pretrained(path)
    return str(path)


def _next_token_logprobs(logits, ids):
    import torch

    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return logp.gather(-1, ids[:, 1:, None]).squeeze(-1)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_mbridge_gptmodel_logprobs_equal_hf(mcore_world, tmp_path, kind):
    import torch
    import transformers
    from mbridge import AutoBridge

    from grpo_sdk.backends.megatron import cpu_shims
    from grpo_sdk.backends.megatron.policy import transformers5_compat

    hf_dir = _tiny_hf_dir(tmp_path, kind)
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()

    bridge = AutoBridge.from_pretrained(hf_dir, dtype=torch.float32)
    transformers5_compat(bridge)
    if not torch.cuda.is_available():
        cpu_shims.use_local_layer_spec(bridge)
    models = bridge.get_model(bf16=False, use_cpu_initialization=True, wrap_with_ddp=False)
    bridge.load_weights(models, hf_dir)
    (model,) = models
    model.eval()

    g = torch.Generator().manual_seed(7)
    batch, seq = 3, 24
    ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
    position_ids = torch.arange(seq).unsqueeze(0).expand(batch, -1)
    with torch.no_grad():
        hf_logits = hf(input_ids=ids).logits
        # attention_mask=None: the local spec's DotProductAttention applies the causal mask itself.
        mc_logits = model(input_ids=ids, position_ids=position_ids, attention_mask=None)
    assert mc_logits.shape == hf_logits.shape, (mc_logits.shape, hf_logits.shape)
    hf_lp = _next_token_logprobs(hf_logits, ids)
    mc_lp = _next_token_logprobs(mc_logits, ids)
    diff = (hf_lp - mc_lp).abs().max().item()
    print(f"{kind}: max |logprob diff| = {diff:.3e}; logprob range {hf_lp.min().item():.3f}..{hf_lp.max().item():.3f}")
    assert diff <= TOL, diff

    # Export back through the bridge in Hugging Face names: the same names and values.
    hf_state = hf.state_dict()
    exported = {name: t.detach().cpu() for name, t in bridge.export_weights(models)}
    assert sorted(exported) == sorted(hf_state), (
        sorted(set(exported) ^ set(hf_state))
    )
    for name, t in hf_state.items():
        assert exported[name].dtype == t.dtype, name
        assert torch.equal(exported[name], t), name


# --- MegatronPolicy against HFPolicy ---------------------------------------------------------------

POLICY_OVERRIDES = ("policy.train_micro_batch_size=2", "policy.logprob_batch_size=3", "policy.optimizer.lr=0.01",
                    "policy.max_grad_norm=0.5", "grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=3",
                    "grpo.max_num_steps=4", "policy.scheduler.warmup_steps=2")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return _tiny_hf_dir(tmp_path_factory.mktemp("policy"), "llama")


def _context(model_dir, registry, *overrides, kl=0.0):
    from grpo_sdk.config.loading import load_config
    from grpo_sdk.config.context import RunContext

    cfg = load_config(None, [f"policy.model_name={model_dir}", f"loss_fn.reference_policy_kl_penalty={kl}",
                             *POLICY_OVERRIDES, *overrides], registry)
    return RunContext(config=cfg, run_dir=model_dir, model_path=str(model_dir), tokenizer_path=str(model_dir),
                      device="cpu", seed=0, needs_reference=kl > 0)


def _batch(seed: int = 3, rows: int = 6, prompt: int = 7, response: int = 6):
    """Left-padded prompts + right-padded responses of random tokens, with random advantages."""
    import torch

    from grpo_sdk.core.records import TrainBatch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (rows, prompt + response), generator=g)
    prompt_lens = torch.randint(2, prompt + 1, (rows,), generator=g)
    response_lens = torch.randint(1, response + 1, (rows,), generator=g)
    pos = torch.arange(prompt + response)
    prompt_mask = (pos[None] >= prompt - prompt_lens[:, None]) & (pos[None] < prompt)
    response_mask = (pos[None] >= prompt) & (pos[None] < prompt + response_lens[:, None])
    attention = (prompt_mask | response_mask).long()
    ids = ids * attention  # padding is token 0
    token_mask = response_mask.float()
    return TrainBatch(input_ids=ids, attention_mask=attention, token_mask=token_mask,
                      sample_mask=torch.ones(rows), generation_logprobs=torch.zeros(ids.shape),
                      group_ids=torch.arange(rows) // 3, rewards=torch.zeros(rows),
                      advantages=torch.randn(rows, 1, generator=g).expand_as(token_mask).contiguous())


@pytest.mark.parametrize("sampling", [(), ("policy.generation.temperature=0.7", "policy.generation.top_k=20")])
def test_policy_logprobs_equal_hf_policy(megatron_world, llama_dir, registry, sampling):
    import torch

    from grpo_sdk.backends.hf.policy import HFPolicy
    from grpo_sdk.backends.megatron.policy import MegatronPolicy

    context = _context(llama_dir, registry, *sampling)
    batch = _batch()
    hf_lp = HFPolicy(None, context).logprobs(batch)
    mc_lp = MegatronPolicy(None, context).logprobs(batch)
    # Every response token whose previous token is a real one: the hf policy computes logprobs at
    # response positions only (0 elsewhere), megatron at every real token.
    keep = torch.zeros_like(batch.attention_mask, dtype=torch.bool)
    keep[:, 1:] = (batch.attention_mask[:, 1:].bool() & batch.attention_mask[:, :-1].bool()
                   & batch.token_mask[:, 1:].bool())
    hf_lp, mc_lp_kept = hf_lp[keep], mc_lp[keep]
    finite = torch.isfinite(hf_lp)  # top-k leaves -inf on filtered tokens: the same ones in both
    assert torch.equal(finite, torch.isfinite(mc_lp_kept)) and torch.equal(hf_lp[~finite], mc_lp_kept[~finite])
    diff = (hf_lp[finite] - mc_lp_kept[finite]).abs().max().item()
    print(f"{sampling}: max |logprob diff| = {diff:.3e}")
    assert diff <= TOL, diff
    real = torch.zeros_like(keep)
    real[:, 1:] = batch.attention_mask[:, 1:].bool() & batch.attention_mask[:, :-1].bool()
    assert torch.all(mc_lp[~real] == 0)


def test_policy_train_step_equals_hf_policy(megatron_world, llama_dir, registry, monkeypatch):
    import torch

    from grpo_sdk.algorithms.loss import ClippedPGLoss
    from grpo_sdk.backends.hf.policy import HFPolicy
    from grpo_sdk.backends.megatron.policy import MegatronPolicy

    # Adam's first step is ~lr * g / (|g| + eps), nearly sign(g): on gradients near 0 the float
    # rounding differences of two implementations (fused QKV / gate-up GEMMs vs separate ones) show
    # at the scale of lr (measured 1.5e-4 with eps=1e-8). A large eps makes the step linear in the
    # gradient, so the weight comparison measures the gradients.
    context = _context(llama_dir, registry, "policy.optimizer.eps=0.1", kl=0.05)
    batch = _batch()
    hf, mc = HFPolicy(None, context), MegatronPolicy(None, context)
    batch.reference_logprobs = hf.reference_logprobs(batch)
    ref_diff = (batch.reference_logprobs - mc.reference_logprobs(batch))[batch.token_mask.bool()].abs().max()
    assert ref_diff <= TOL, ref_diff
    loss = ClippedPGLoss(context.config.loss_fn)
    hf_metrics = hf.train(batch, loss)
    mc_metrics = mc.train(batch, loss)
    print("hf", hf_metrics, "\nmegatron", mc_metrics)
    assert set(hf_metrics) == set(mc_metrics)
    for key in ("loss", "grad_norm", "lr"):
        assert abs(hf_metrics[key] - mc_metrics[key]) <= TOL, (key, hf_metrics[key], mc_metrics[key])

    hf_state = hf.model.state_dict()
    exported = {name: t.detach().cpu() for name, t in mc.named_weights()}
    assert sorted(exported) == sorted(hf_state)
    worst = max((exported[n] - t).abs().max().item() for n, t in hf_state.items())
    print(f"loss diff {abs(hf_metrics['loss'] - mc_metrics['loss']):.3e}; max weight diff after the step {worst:.3e}")
    assert worst <= 1e-6, worst
    # Full activation recompute (policy.megatron.activation_checkpointing) changes nothing numerically;
    # on CPU it runs through cpu_shims W5.
    from megatron.core.tensor_parallel.random import CheckpointFunction

    from grpo_sdk.backends.megatron.config import MegatronPolicyConfig

    recompute = MegatronPolicy(MegatronPolicyConfig(activation_checkpointing=True), context)
    assert recompute.model.config.recompute_granularity == "full"
    calls = {"checkpoint_forward": 0, "checkpoint_backward": 0, "layer_forward": 0}

    def counted(key, fn):
        def wrapper(*args, **kwargs):
            calls[key] += 1
            return fn(*args, **kwargs)
        return staticmethod(wrapper)

    monkeypatch.setattr(CheckpointFunction, "forward", counted("checkpoint_forward", CheckpointFunction.forward))
    monkeypatch.setattr(CheckpointFunction, "backward", counted("checkpoint_backward", CheckpointFunction.backward))
    layers = list(recompute.model.decoder.layers)
    for layer in layers:
        layer.register_forward_hook(lambda *_: calls.__setitem__("layer_forward", calls["layer_forward"] + 1))
    batch_again = _batch()
    batch_again.reference_logprobs = batch.reference_logprobs
    re_metrics = recompute.train(batch_again, loss)
    monkeypatch.undo()
    # One checkpoint per layer (recompute_num_layers=1), each backward re-running its layer's forward.
    assert calls["checkpoint_forward"] > 0 and calls["checkpoint_forward"] % len(layers) == 0, calls
    assert calls["checkpoint_backward"] == calls["checkpoint_forward"], calls
    assert calls["layer_forward"] == 2 * calls["checkpoint_forward"], calls
    re_loss_diff = abs(re_metrics["loss"] - mc_metrics["loss"])
    re_worst = max((t.detach().cpu() - exported[name]).abs().max().item() for name, t in recompute.named_weights())
    print(f"recompute {calls}: loss diff {re_loss_diff:.3e}; max weight diff {re_worst:.3e}")
    assert re_loss_diff <= TOL, re_loss_diff
    assert re_worst <= 1e-6, re_worst
    # The reference did not move with the policy.
    mask = batch.token_mask.bool()
    torch.testing.assert_close(mc.reference_logprobs(batch)[mask], hf.reference_logprobs(batch)[mask], atol=TOL, rtol=0)
    assert not torch.allclose(mc.logprobs(batch)[mask], batch.reference_logprobs[mask])  # the policy moved


def test_policy_checkpoint_round_trip(megatron_world, llama_dir, registry, tmp_path):
    import torch

    from grpo_sdk.algorithms.loss import ClippedPGLoss
    from grpo_sdk.backends.megatron.policy import MegatronPolicy

    from grpo_sdk.backends.megatron.config import MegatronPolicyConfig

    context = _context(llama_dir, registry)
    loss = ClippedPGLoss(context.config.loss_fn)
    policy = MegatronPolicy(MegatronPolicyConfig(), context)
    policy.train(_batch(seed=1), loss)
    policy.save_checkpoint(str(tmp_path / "ckpt"))
    expected = policy.train(_batch(seed=2), loss)
    expected_weights = dict(policy.named_weights())

    fresh = MegatronPolicy(MegatronPolicyConfig(), context)
    fresh.load_checkpoint(str(tmp_path / "ckpt"))
    assert fresh.optimizer_steps == 1
    got = fresh.train(_batch(seed=2), loss)
    assert got == expected
    for name, t in fresh.named_weights():
        assert torch.equal(t, expected_weights[name]), name
