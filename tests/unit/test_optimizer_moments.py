"""policy.optimizer.moments_dtype=bfloat16: AdamW's update with its moments stored in half the bytes."""

from __future__ import annotations

import torch

from grpo_sdk.algorithms.optimizer import CHUNK, AdamWBFloat16Moments, round_stochastically_
from helpers import config_problems

SETTINGS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}


def _pair(shapes, seed=0):
    torch.manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(shape)) for shape in shapes]
    return params, [torch.nn.Parameter(p.detach().clone()) for p in params]


def _step(optimizers_and_params, step):
    generator = torch.Generator().manual_seed(step)
    for optimizer, params in optimizers_and_params:
        generator.manual_seed(step)
        for p in params:  # the same gradient for both, of alternating scale as GRPO's are
            p.grad = torch.randn(p.shape, generator=generator) * (0.05 if step % 2 else 1.0)
        optimizer.step()


def test_it_follows_torch_adamw_with_half_the_state():
    # one parameter over two chunks, so the chunked update and the shared noise are exercised
    reference, ours = _pair([(64, 32), (300,), (CHUNK + 1000,)])
    adamw = torch.optim.AdamW(reference, **SETTINGS)
    low = AdamWBFloat16Moments(ours, seed=1, **SETTINGS)
    start = [p.detach().clone() for p in reference]
    for step in range(60):
        _step([(adamw, reference), (low, ours)], step)
    for p, q, p0 in zip(reference, ours, start):
        moved, apart = (p - p0).abs().max(), (p - q).abs().max()
        assert moved > 0.02 and apart < 0.01 * moved  # within 1% of how far the weights moved
        for key in ("exp_avg", "exp_avg_sq"):
            ours_state, theirs = low.state[q][key], adamw.state[p][key]
            assert ours_state.dtype == torch.bfloat16 and ours_state.element_size() * 2 == theirs.element_size()
            torch.testing.assert_close(ours_state.float(), theirs, rtol=0.05, atol=0.01 * float(theirs.abs().max()))


def test_stochastic_rounding_is_unbiased_where_nearest_rounding_stalls():
    """Why not round to nearest: 0.999 * v rounds back to v in bfloat16, so the second moment would
    never decay. Stochastically rounded, it decays as in float32."""
    nearest = torch.ones(20_000, dtype=torch.bfloat16)
    stochastic = torch.ones(20_000, dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    for _ in range(500):
        nearest = (nearest.float() * 0.999).to(torch.bfloat16)
        noise = torch.randint(0, 1 << 16, stochastic.shape, dtype=torch.int32, generator=generator)
        round_stochastically_(stochastic, stochastic.float() * 0.999, noise)
    assert torch.all(nearest == 1.0)
    assert abs(float(stochastic.float().mean()) - 0.999 ** 500) < 0.01  # 0.606


def test_a_loaded_state_continues_exactly_and_stays_bfloat16():
    _, first = _pair([(40, 30), (30,)], seed=3)
    _, second = _pair([(40, 30), (30,)], seed=3)
    one = AdamWBFloat16Moments(first, seed=7, **SETTINGS)
    for step in range(5):
        _step([(one, first)], step)
    # a resumed run: fresh weights and optimizer from the saved ones, then the same steps as the first
    with torch.no_grad():
        for p, q in zip(first, second):
            q.copy_(p)
    two = AdamWBFloat16Moments(second, seed=7, **SETTINGS)
    two.load_state_dict(one.state_dict())
    assert all(s[k].dtype == torch.bfloat16 for s in two.state.values() for k in ("exp_avg", "exp_avg_sq"))
    for step in range(5, 10):
        _step([(one, first), (two, second)], step)
    assert all(torch.equal(p, q) for p, q in zip(first, second))


def test_where_it_does_not_apply_the_config_says_so(registry):
    import attrs

    from grpo_sdk.config.checks.policy import check_optimizer
    from grpo_sdk.config.loading import load_config

    problems = config_problems(registry, "policy.optimizer.moments_dtype=bfloat16", "cluster.runtime=ray",
                               "cluster.policy_workers=2")
    assert "one policy rank" in problems["policy.optimizer.moments_dtype"]
    # megatron is not installed here, so its config cannot load: the check itself, on an hf config moved over
    cfg = load_config(None, ["policy.optimizer.moments_dtype=bfloat16"], registry)
    ((key, message),) = check_optimizer(attrs.evolve(cfg, policy=attrs.evolve(cfg.policy, backend="megatron")))
    assert key == "policy.optimizer.moments_dtype" and "policy.backend=hf only" in message
