"""The policy's optimizer and LR schedule (``policy.optimizer``, ``policy.scheduler``), as every policy
backend builds them: ``make_optimizer`` (public as ``grpo_sdk.plugins.training.make_optimizer``).

AdamW with its two moments kept in bfloat16: ``policy.optimizer.moments_dtype=bfloat16``.

AdamW's moments are twice the weights in float32: 1.0 of the 2.0 GiB that SmolLM2-135M's training state
takes, and after gradient checkpointing the largest thing left in the process. Stored in bfloat16 they
take half. The arithmetic stays float32: each moment is widened a chunk at a time, updated as
torch.optim.AdamW updates it, and rounded back to bfloat16 *stochastically* (up with a probability
equal to the distance, so the rounding is unbiased). Round-to-nearest would stall the second moment:
with beta2 = 0.999, ``0.999 * v`` rounds back to ``v`` in bfloat16's 8-bit mantissa, so ``v`` could
never decay and small gradients would never register. The noise comes from a generator seeded by
(seed, optimizer step), so a resumed run draws what an uninterrupted one does; the weights stay in
``policy.precision`` (float32 master weights).

Plain tensors only: data-parallel (FSDP2) policies keep torch's AdamW (the config check says so).
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import torch

CHUNK = 1 << 22  # elements widened at a time: 16 MiB of float32 per temporary, whatever the weight's size


def round_stochastically_(target: torch.Tensor, value: torch.Tensor, noise: torch.Tensor) -> None:
    """``target`` (bfloat16) := ``value`` (float32, overwritten) rounded to one of its two bfloat16
    neighbours, the upper with probability equal to how far ``value`` is towards it, given ``noise``:
    uniform int32 in [0, 2**16). bfloat16 is float32's upper 16 bits: adding 16 random low bits to the
    magnitude and clearing them rounds it so; the result is exact in bfloat16, so the cast adds no
    rounding of its own."""
    target.copy_(value.view(torch.int32).add_(noise).bitwise_and_(-65536).view(torch.float32))


class AdamWBFloat16Moments(torch.optim.Optimizer):
    """torch.optim.AdamW's update (decoupled weight decay, bias correction, no amsgrad) with both moments
    stored in bfloat16 and rounded stochastically."""

    def __init__(self, params: Iterable[torch.nn.Parameter], *, lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float, seed: int):
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})
        self.seed = seed

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # noqa: ARG002 -- torch's signature; no closure is used
        work: dict[torch.device, tuple[torch.Tensor, ...]] = {}  # per device: noise and 3 float32 buffers
        for group in self.param_groups:
            lr, (beta1, beta2), eps = group["lr"], group["betas"], group["eps"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(param, dtype=torch.bfloat16)
                    state["exp_avg_sq"] = torch.zeros_like(param, dtype=torch.bfloat16)
                state["step"] = state["step"] + 1  # not in place: a loaded state may share torch's step tensor
                step = int(state["step"])
                if param.device not in work:
                    work[param.device] = self._work(step, param.device)
                noise, avg, avg_sq, denom = work[param.device]
                param.mul_(1.0 - lr * group["weight_decay"])
                step_size = lr / (1.0 - beta1 ** step)
                root_bias2 = (1.0 - beta2 ** step) ** 0.5
                flat = (param.view(-1), param.grad.view(-1), state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1))
                for start in range(0, param.numel(), CHUNK):
                    weight, grad, exp_avg, exp_avg_sq = (t[start:start + CHUNK] for t in flat)
                    n = weight.numel()
                    a = avg[:n].copy_(exp_avg).lerp_(grad, 1.0 - beta1)
                    a_sq = avg_sq[:n].copy_(exp_avg_sq).mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
                    weight.addcdiv_(a, torch.sqrt(a_sq, out=denom[:n]).div_(root_bias2).add_(eps), value=-step_size)
                    round_stochastically_(exp_avg, a, noise[:n])
                    round_stochastically_(exp_avg_sq, a_sq, noise[:n])

    def _work(self, step: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        """This step's rounding noise and the float32 buffers a chunk is updated in, allocated once per
        step rather than per chunk. One draw of noise serves every chunk of the step (a draw costs 4x an
        update); it comes from (seed, step), so a resumed run rounds as the uninterrupted one did."""
        size = min(CHUNK, max(p.numel() for group in self.param_groups for p in group["params"]))
        generator = torch.Generator(device=device).manual_seed(hash((self.seed, step)) & (2**63 - 1))
        noise = torch.randint(0, 1 << 16, (size,), dtype=torch.int32, generator=generator, device=device)
        return (noise, *(torch.empty(size, dtype=torch.float32, device=device) for _ in range(3)))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # torch casts a loaded state to its parameter's dtype (float32); the moments are bfloat16 here,
        # and a bfloat16 -> float32 -> bfloat16 round trip is exact.
        super().load_state_dict(state_dict)
        for state in self.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:
                    state[key] = state[key].to(torch.bfloat16)


def lr_lambda(step: int, *, warmup_steps: int, total_steps: int, schedule: str, min_lr_ratio: float) -> float:
    """Multiplier of the peak lr at optimizer step ``step`` (0-based)."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if schedule == "linear":
        return 1.0 - (1.0 - min_lr_ratio) * progress
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def make_optimizer(params: list[torch.nn.Parameter], cfg: Any) -> tuple[torch.optim.Optimizer, Any]:
    """AdamW over ``params`` and its LR schedule, from ``policy.optimizer`` and ``policy.scheduler``
    (the schedule counts optimizer steps: several per GRPO step with train_global_batch_size)."""
    opt, sched = cfg.policy.optimizer, cfg.policy.scheduler
    if opt.moments_dtype == "bfloat16":
        optimizer = AdamWBFloat16Moments(params, lr=opt.lr, betas=tuple(opt.betas), eps=opt.eps,
                                         weight_decay=opt.weight_decay, seed=cfg.grpo.seed)
    else:  # the fused kernel (CPU and CUDA) is ~2.5x faster than the per-tensor loop on small models
        optimizer = torch.optim.AdamW(params, lr=opt.lr, betas=tuple(opt.betas), eps=opt.eps,
                                      weight_decay=opt.weight_decay, fused=True)
    rows = cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt
    total_steps = cfg.grpo.max_num_steps * (rows // (cfg.policy.train_global_batch_size or rows))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_lambda(
        s, warmup_steps=sched.warmup_steps, total_steps=total_steps, schedule=sched.name,
        min_lr_ratio=sched.min_lr_ratio))
    return optimizer, scheduler
