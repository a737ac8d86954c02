"""The policy's forward pass: logprobs of the response tokens only, in chunks over positions.

The model body (embeddings, blocks, final norm) runs once over ``[B, S]``; the LM head and the
log-softmax then run only at the positions whose *target* is a response token
(``token_mask[:, 1:]``), never at the last position (it predicts nothing in the batch), and in
chunks of ``chunk_size`` positions, so the float32 logits of the whole batch never exist at once.
The result is the same input-aligned ``[B, S]`` tensor as a full forward pass (column 0 and every
position not computed are 0), so the loss and every caller are unchanged.

How the hidden states are reached, for any transformers causal LM: the model's own forward is
called with its output-embedding module (``get_output_embeddings()``, the ``lm_head``) replaced for
that call by a function that receives the final hidden states, computes the chunks and returns an
empty ``[B, S, 0]`` tensor. Going through the root module's forward (rather than calling the base
model directly) keeps FSDP2's root hooks, which gather the embeddings and the head, in place, and
needs no per-architecture knowledge of where the base model lives. What some architectures do to
the logits after the head is applied here from the config (Gemma's ``final_logit_softcapping``,
Granite's ``logits_scaling``, Cohere's ``logit_scale``); a probe checks once per model, on a few
tokens, that this gives the model's own logits, and a model it does not (another transform, no
output embeddings) runs the full forward instead, with the chunked log-softmax after it (a warning
says so).

In training each chunk is recomputed in backward (``torch.utils.checkpoint``) when there is more
than one: otherwise autograd would keep every chunk's logits until backward and chunking would
save nothing. One chunk (small vocabularies) is never recomputed.
"""

from __future__ import annotations

import logging
import weakref
from typing import Callable

import torch
from torch.utils.checkpoint import checkpoint

from grpo_sdk.plugins.tensors import position_ids_for, process_logits, token_logprobs

log = logging.getLogger(__name__)

LOGITS_CHUNK_BYTES = 64 * 2**20
"""The float32 logits of one chunk with ``policy.logprob_chunk_size`` null: 110 positions at a
151,936-token vocabulary, 512 at 32,768. The log-softmax needs about two more tensors of that
size at once (``logsumexp``'s temporaries), top-p filtering a few more."""

_HEAD_EXACT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> the probe's verdict


def default_chunk_size(vocab_size: int) -> int:
    return max(1, LOGITS_CHUNK_BYTES // (4 * vocab_size))


def sequence_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, *, temperature: float,
                      top_k: int | None, top_p: float, with_unfiltered: bool = False,
                      token_mask: torch.Tensor | None = None, chunk_size: int | None = None,
                      position_ids: torch.Tensor | None = None):
    """Input-aligned ``[B, S]`` float32 logprobs of ``input_ids`` at the positions ``token_mask``
    marks (all of columns 1.. when None); 0 elsewhere, and in column 0.

    With ``with_unfiltered``, also the logprobs without the top-k/top-p filter (temperature
    still applied), which the KL penalty uses: a filtered-out token has logprob -inf.
    ``attention_mask`` None with ``position_ids`` given: packed rows (positions restart at each
    sequence; transformers keeps attention within each).
    """
    B, S = input_ids.shape
    if position_ids is None:
        position_ids = position_ids_for(attention_mask)
    select = (token_mask[:, 1:] > 0 if token_mask is not None
              else torch.ones(B, S - 1, dtype=torch.bool, device=input_ids.device))
    targets = input_ids[:, 1:][select]
    kwargs = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
              "use_cache": False}
    head = model.get_output_embeddings()
    exact = head is not None and _head_is_exact(model, head, input_ids, attention_mask)
    if chunk_size is None:
        chunk_size = default_chunk_size(_vocab_size(model, head))
    sampling = (temperature, top_k, top_p, with_unfiltered)
    anchor = torch.is_grad_enabled() and not targets.numel()

    def score(features: torch.Tensor, project: Callable) -> tuple:
        rows = features[:, :-1][select]
        if anchor:  # no position to score: one, times 0, so every parameter still gets a gradient
            rows, picked = features[:1, 0], input_ids[:1, 0]
            return tuple(0 * lp for lp in _chunks(rows, picked, project, chunk_size, sampling))
        return _chunks(rows, targets, project, chunk_size, sampling)

    if exact:
        logits_fn = _logits_fn(model, head)
        results = _through_head(model, head, kwargs, lambda hidden: score(hidden, logits_fn))
    else:
        results = score(model(**kwargs).logits, lambda x: x)
    out = []
    for lp in results:
        if anchor:
            full = torch.zeros(B, S, device=lp.device) + lp.sum()
        else:
            full = torch.nn.functional.pad(
                torch.zeros(B, S - 1, device=lp.device, dtype=lp.dtype).masked_scatter(select, lp), (1, 0))
        out.append(full)
    return (out[0], out[1]) if with_unfiltered else out[0]


def _chunks(rows: torch.Tensor, targets: torch.Tensor, project: Callable, chunk_size: int | None,
            sampling: tuple) -> tuple[torch.Tensor, ...]:
    """Logprobs of ``targets`` from the features ``rows`` ([N, H]), ``chunk_size`` rows at a time."""
    temperature, top_k, top_p, with_unfiltered = sampling

    def piece(h: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        scaled = project(h).float()
        if temperature != 1.0:  # x / 1 is x: no copy of the chunk for it
            scaled = scaled / temperature
        filtered = token_logprobs(process_logits(scaled, 1.0, top_k, top_p), t)
        return (filtered, token_logprobs(scaled, t)) if with_unfiltered else (filtered,)

    n = rows.shape[0]
    size = chunk_size
    if n <= size:
        return piece(rows, targets)
    parts = []
    for start in range(0, n, size):
        h, t = rows[start:start + size], targets[start:start + size]
        parts.append(checkpoint(piece, h, t, use_reentrant=False) if torch.is_grad_enabled() else piece(h, t))
    return tuple(torch.cat(column) for column in zip(*parts))


def _vocab_size(model, head) -> int:
    weight = getattr(head, "weight", None)  # under FSDP2 a DTensor: its shape is the whole tensor's
    if weight is not None:
        return int(weight.shape[0])
    config = model.config
    return int((config.get_text_config() if hasattr(config, "get_text_config") else config).vocab_size)


def _logits_fn(model, head) -> Callable:
    """The head's logits as the model's forward would return them (its own forward, then the
    config's softcap/scaling: the transforms transformers models apply after ``lm_head``)."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    softcap = getattr(text, "final_logit_softcapping", None)
    divide = getattr(text, "logits_scaling", None)
    multiply = getattr(model, "logit_scale", None)
    forward = head.forward  # bound now, before _through_head replaces it for one call

    def logits(hidden: torch.Tensor) -> torch.Tensor:
        out = forward(hidden)
        if multiply is not None:
            out = out * multiply
        if divide is not None:
            out = out / divide
        if softcap is not None:
            out = torch.tanh(out / softcap) * softcap
        return out

    return logits


def _through_head(model, head, kwargs: dict, fn: Callable):
    """``fn(final hidden states)``, computed inside the model's own forward in place of its head."""
    captured = []

    def replaced(hidden: torch.Tensor) -> torch.Tensor:
        captured.append(fn(hidden))
        return hidden.new_zeros(*hidden.shape[:-1], 0)

    own = head.__dict__.get("forward")  # an instance-level forward (a wrapper's) is put back after
    head.forward = replaced
    try:
        model(**kwargs)
    finally:
        if own is None:
            del head.forward
        else:
            head.forward = own
    if len(captured) != 1:
        raise RuntimeError(f"{type(model).__name__} called its output embeddings {len(captured)} times in one "
                           "forward pass; the hf policy's chunked logprobs expect one call")
    return captured[0]


@torch.no_grad()
def _head_is_exact(model, head, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> bool:
    """Whether the head path gives the model's own logits: probed once per model, on at most 16
    tokens of the first row (every rank of a data-parallel group probes in the same call)."""
    known = _HEAD_EXACT.get(model)
    if known is not None:
        return known
    ids = input_ids[0] if attention_mask is None else input_ids[0][attention_mask[0].bool()]
    ids = (ids if ids.numel() else input_ids[0])[:16][None]
    kwargs = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
              "position_ids": torch.arange(ids.shape[1], device=ids.device)[None], "use_cache": False}
    expected = model(**kwargs).logits
    tolerance = 1e-3 if expected.dtype == torch.float32 else 3e-2
    try:
        actual = _through_head(model, head, kwargs, _logits_fn(model, head))
        exact = actual.shape == expected.shape and bool(torch.allclose(actual.float(), expected.float(),
                                                                       rtol=tolerance, atol=tolerance))
    except Exception as exc:  # an architecture whose head is not a plain module call
        log.debug("head probe failed: %s", exc)
        exact = False
    if not exact:
        log.warning("%s: the logits after its output embeddings are not the model's own logits (a transform this "
                    "backend does not know); its logprobs use the full forward pass, all positions' logits at once",
                    type(model).__name__)
    _HEAD_EXACT[model] = exact
    return exact
