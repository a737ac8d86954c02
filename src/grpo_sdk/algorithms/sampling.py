"""Temperature, top-k and top-p as one logits transform, shared by sampling and training.

Generation samples from ``log_softmax(filter(logits / T))`` and reports those logprobs; the
policy scores tokens with the same transform, so a generation backend and the policy agree on
what "the logprob of a sampled token" means (``token_mult_prob_error`` near 1). ``sample_token``
draws from that distribution and reports the logprob; ``sample_rows`` does the same with one
counter-based random stream per row (``row_uniforms``), which the hf and megatron generation backends
share, so with the same seeds they sample the same tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs
import torch

if TYPE_CHECKING:
    from grpo_sdk.core.records import SamplingParams


def process_logits(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                   top_p: float = 1.0) -> torch.Tensor:
    """``logits[..., V]`` scaled by 1/temperature, with tokens outside top-k / top-p set to -inf."""
    if temperature != 1.0:
        logits = logits / temperature
    vocab = logits.shape[-1]
    if top_k == 1 and vocab > 1:
        # Greedy keeps one token, the first of a tie as argmax does: masking below the k-th value would
        # keep every tied token and draw among them, and bfloat16 logits tie often enough that "greedy"
        # validation then moved with the sampling seed (SmolLM2 held-out accuracy 0.13-0.17 from one model).
        best = logits.argmax(-1, keepdim=True)
        logits = torch.full_like(logits, float("-inf")).scatter(-1, best, logits.gather(-1, best))
    elif top_k is not None and 0 < top_k < vocab:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the mass before it already reaches top_p; the top token always stays.
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits)`` at ``tokens`` without materialising the full log-softmax."""
    picked = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def sample_categorical(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One draw per row of ``probs [B, V]`` by inverting the CDF.

    About 10x cheaper than ``torch.multinomial`` on CPU. Zero-probability tokens (outside top-k or
    top-p) have zero-width CDF steps and are never drawn.
    """
    cdf = probs.cumsum(-1)
    u = torch.rand((probs.shape[0], 1), generator=generator, device=probs.device) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).clamp_(max=probs.shape[-1] - 1).squeeze(-1)


def sample_token(logits: torch.Tensor, sampling: SamplingParams,
                 generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of ``logits [B, V]`` and its logprob under the processed distribution
    (temperature, top-k, top-p): what the policy's logprobs reproduce."""
    step_logprobs = torch.log_softmax(
        process_logits(logits.float(), sampling.temperature, sampling.top_k, sampling.top_p), dim=-1)
    token = sample_categorical(step_logprobs.exp(), generator)
    return token, step_logprobs.gather(-1, token[:, None]).squeeze(-1)


# --- per-row counter-based sampling: a row's tokens depend on its seed alone ---------------------------

_MASK64 = (1 << 64) - 1


def signed_seed(seed: int) -> int:
    """Any integer seed as the int64 that holds its low 64 bits (torch tensors are signed)."""
    value = int(seed) & _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN, _MIX1, _MIX2 = (signed_seed(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def _shift(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def row_uniforms(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """One uniform in [0, 1) per row: SplitMix64 of (the row's seed, the index of the token it samples).
    Counter-based, so a row's draws depend on nothing but its seed (not on the batch, nor on how many
    draws came before), cost the same few vectorised ops for any number of rows, and carry no state
    to checkpoint. int64 products wrap as the uint64 arithmetic of SplitMix64 does."""
    z = seeds + (steps + 1) * _GOLDEN
    z = (z ^ _shift(z, 30)) * _MIX1
    z = (z ^ _shift(z, 27)) * _MIX2
    z = z ^ _shift(z, 31)
    return _shift(z, 11).double() * (1.0 / (1 << 53))


def sample_rows(logits: torch.Tensor, sampling: SamplingParams, seeds: torch.Tensor,
                steps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of ``logits [B, V]`` and its processed logprob, as ``sample_token``, but row i
    draws with ``row_uniforms(seeds[i], steps[i])`` (``steps``: the index of the token being sampled):
    two backends that share this function and the seeds sample the same tokens from the same logits,
    whatever their batching.

    One full-vocabulary buffer, worked in place: the logprob is ``x - max - log(sum(exp(x - max)))``,
    what ``log_softmax`` computes, read at the token only. Materialising ``log_softmax``, its ``exp``
    and an out-of-place ``cumsum`` cost 19 ms a step at 32 rows x 49k vocabulary (SmolLM2; fresh
    6 MB allocations fault their pages in every step), this ~5 ms."""
    x = process_logits(logits.float(), sampling.temperature, sampling.top_k, sampling.top_p)
    top = x.amax(-1, keepdim=True)
    cdf = torch.sub(x, top).exp_()
    log_total = cdf.sum(-1, keepdim=True).log_()  # a vectorised sum: the cumsum's last element rounds worse
    cdf.cumsum_(-1)
    u = row_uniforms(seeds.cpu(), steps.cpu()).to(device=cdf.device, dtype=cdf.dtype)
    u = u.clamp_(max=1 - 2**-24)  # float32 rounding must not reach 1
    token = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp_(max=cdf.shape[-1] - 1)
    return token.squeeze(-1), (x.gather(-1, token) - top - log_total).squeeze(-1)


def draw_row_seeds(generator: torch.Generator, rows: int, seed: int | None = None) -> torch.Tensor:
    """``rows`` sampling seeds for a backend whose caller gave none (``GenerationInput.seeds``): one draw
    from the backend's own ``generator`` per call (so a checkpointed generator resumes exactly), or from
    ``seed`` (``SamplingParams.seed``, e.g. validation) leaving that generator untouched."""
    if seed is not None:
        generator = torch.Generator().manual_seed(seed)
    elif generator.device.type != "cpu":  # an accelerator generator seeds a CPU one: seeds live on the CPU
        generator = torch.Generator().manual_seed(
            int(torch.randint(2**62, (1,), generator=generator, device=generator.device)))
    return torch.randint(2**62, (rows,), generator=generator)


def validation_sampling(train: SamplingParams, generation: Any, *, seed: int) -> SamplingParams:
    """The sampling of validation: ``policy.generation.val_temperature`` / ``val_top_p`` / ``val_top_k``
    where set, else the training values. Temperature 0 is greedy, sampled as temperature 1 with top-k 1
    (backends divide logits by the temperature)."""
    temperature = train.temperature if generation.val_temperature is None else generation.val_temperature
    top_p = train.top_p if generation.val_top_p is None else generation.val_top_p
    top_k = train.top_k if generation.val_top_k is None else generation.val_top_k
    if temperature == 0:
        temperature, top_k = 1.0, 1
    return attrs.evolve(train, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
