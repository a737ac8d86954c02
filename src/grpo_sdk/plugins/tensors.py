"""Helpers for plugin authors that work on tensors: importing this module imports torch.

Public, like ``grpo_sdk.plugins`` (docs/compatibility.md): the names in ``__all__``. Import it
from a component's implementation module, never from its spec (a spec must stay light).

* Sampling: ``process_logits(logits, temperature, top_k, top_p)`` (the one logits transform that
  generation samples from and the policy scores with, so their logprobs agree and
  ``token_mult_prob_error`` stays near 1), ``token_logprobs(logits, tokens)`` and
  ``sample_token(logits, sampling, generator)`` (one token per row drawn from that transform, with its
  logprob: what a hand-written decoding loop reports). ``sample_rows(logits, sampling, seeds, steps)``
  draws row i from its own counter-based stream (``row_uniforms``: a function of the row's seed and
  the token's index alone), so its tokens do not depend on the batch it decodes in; ``draw_row_seeds``
  gives a backend seeds when its caller gave none, and ``signed_seed`` folds any integer into int64.
* Models: ``DTYPES`` (``policy.precision`` -> torch dtype), ``left_pad(rows, pad_id)`` (token-id
  rows to left-padded ids and mask) and ``position_ids_for(attention_mask)`` (positions that skip
  left padding, so a left-padded prompt sees the positions it would alone).
* Advantages: ``GroupLayout`` (rows grouped by prompt), ``shifted_moments`` (numerically careful
  weighted mean and variance), ``whiten``, ``masked_mean`` and ``calculate_kl`` (k1/k2/k3
  estimators of the KL divergence, as the loss computes it).
* Weights files: ``write_weights(pairs, path)`` (one safetensors file, atomically; tied tensors
  copied) and ``read_weights(path)`` (the pairs back, one tensor in memory at a time), what the
  ``disk`` transport moves.

Example (a generation backend sampling one token and reporting its logprob)::

    from grpo_sdk.plugins.tensors import process_logits

    logprobs = torch.log_softmax(process_logits(logits, sampling.temperature, sampling.top_k,
                                                sampling.top_p).float(), dim=-1)
    token = torch.multinomial(logprobs.exp(), 1)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from grpo_sdk.algorithms.loss import calculate_kl, masked_mean
from grpo_sdk.algorithms.sampling import (draw_row_seeds, process_logits, row_uniforms, sample_rows, sample_token,
                                          signed_seed, token_logprobs)
from grpo_sdk.algorithms.statistics import GroupLayout, shifted_moments, whiten
from grpo_sdk.core.weights import read_weights, write_weights

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def left_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, P]`` ids and attention mask (long) of token-id rows, each row right-aligned.

    One tensor built from all rows at once: per-row tensor assignments cost ~10 us each, which at
    hundreds of rows per step was a visible share of a small model's step.
    """
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)
    width = int(lengths.max()) if len(rows) else 0
    mask = torch.arange(width) >= (width - lengths)[:, None]
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    # Row-major order of the mask's True cells is the rows' tokens concatenated.
    ids[mask] = torch.tensor([t for r in rows for t in r], dtype=torch.long)
    return ids, mask.long()


def position_ids_for(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding, so a left-padded prompt sees the positions it would alone."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


__all__ = [
    "DTYPES",
    "GroupLayout",
    "calculate_kl",
    "draw_row_seeds",
    "left_pad",
    "masked_mean",
    "position_ids_for",
    "process_logits",
    "read_weights",
    "row_uniforms",
    "sample_rows",
    "sample_token",
    "shifted_moments",
    "signed_seed",
    "token_logprobs",
    "whiten",
    "write_weights",
]
