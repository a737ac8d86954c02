"""Tensor- and data-parallel pieces of the megatron policy: vocab-parallel logprobs, row shares,
gradient reduction and the gradient norm over tensor-parallel shards.

Groups come from Megatron-Core's ``parallel_state`` (built by ``initialize_model_parallel`` over the
runtime's process group). Under TP every rank of a tensor-parallel group holds a vocab shard
``logits[..., V/TP]`` and the same rows; under DP every data-parallel rank holds a whole replica
(of its TP shard) and a share of the rows.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist

from grpo_sdk.plugins.tensors import process_logits, token_logprobs
from grpo_sdk.plugins.training import row_share

NEG_INF = float("-inf")
# Candidates per vocab shard for the first top-p try without top-k; raised x8 until enough.
TOP_P_CANDIDATES = 64


def _tp():
    from megatron.core import parallel_state

    return (parallel_state.get_tensor_model_parallel_group(), parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_tensor_model_parallel_world_size())


def _gather_last(tensor: torch.Tensor, group, size: int) -> torch.Tensor:
    """Every TP rank's ``tensor`` concatenated along the last dimension (no autograd)."""
    parts = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def _logsumexp(values: torch.Tensor, group) -> torch.Tensor:
    """``logsumexp`` over the whole vocabulary from this rank's shard (no autograd)."""
    top = values.max(dim=-1, keepdim=True).values
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    total = (values - top).exp().sum(dim=-1, keepdim=True)
    dist.all_reduce(total, group=group)
    return top + total.log()


def _top_k_drop(values: torch.Tensor, top_k: int, group, size: int) -> torch.Tensor:
    """Where this shard's tokens fall outside the global top-k: below the k-th largest value of the
    whole vocabulary, which lies in the union of the shards' local top-k (ties all stay, as in
    ``process_logits``)."""
    local = values.topk(min(top_k, values.shape[-1]), dim=-1).values
    kth = _gather_last(local, group, size).topk(top_k, dim=-1).values[..., -1:]
    return values < kth


def _top_p_drop(values: torch.Tensor, top_p: float, first_try: int, group, size: int) -> torch.Tensor:
    """Where this shard's tokens fall outside the global top-p nucleus, from gathered candidates only.

    The kept tokens are a prefix of the globally sorted vocabulary. The first ``m`` of the sorted union
    of every shard's local top-``m`` are exactly the global top-``m``, so the prefix is exact when it
    ends before ``m``; otherwise ``m`` grows (x8, up to the whole shard). Every TP rank sees the same
    gathered candidates, so they agree on when to stop. A token whose value ties the last kept one
    stays (``process_logits`` keeps whichever the sort puts first).
    """
    lse = _logsumexp(values, group)
    shard = values.shape[-1]
    m = min(shard, first_try)
    while True:
        candidates = _gather_last(values.topk(m, dim=-1).values, group, size).sort(dim=-1, descending=True).values
        probs = (candidates - lse).exp()
        keep = ((probs.cumsum(-1) - probs) < top_p) & torch.isfinite(candidates)
        keep[..., 0] = True  # the top token always stays
        kept = keep.sum(-1, keepdim=True)
        if m == shard or bool((kept < m).all()):
            break
        m = min(shard, m * 8)
    threshold = candidates.gather(-1, kept - 1)
    return values < threshold


def vocab_parallel_token_logprobs(logits: torch.Tensor, targets: torch.Tensor, *, temperature: float,
                                  top_k: int | None = None, top_p: float = 1.0,
                                  vocab_size: int | None = None) -> torch.Tensor:
    """Logprobs ``[..]`` of ``targets`` from ``logits[.., V/TP]``, this rank's vocab shard.

    TP = 1: exactly the hf policy's computation (``process_logits`` + ``token_logprobs``). TP > 1:
    temperature on a float copy of the shard; Megatron's padded vocab columns (from ``vocab_size``,
    the tokenizer's, on) set to -inf on the shard that holds them; top-k and top-p masks from small
    gathers of per-shard candidates (never the whole vocabulary, except as top-p's last resort); then
    Megatron-Core's differentiable ``vocab_parallel_cross_entropy``, which all-reduces a max, a sum
    and the target logit over the TP group.
    """
    group, rank, size = _tp()
    scaled = logits.float() / temperature
    if size == 1:
        if vocab_size is not None and scaled.shape[-1] > vocab_size:
            scaled = scaled[..., :vocab_size]
        return token_logprobs(process_logits(scaled, 1.0, top_k, top_p), targets)
    shard = scaled.shape[-1]
    vocab = vocab_size if vocab_size is not None else shard * size
    with torch.no_grad():
        columns = torch.arange(rank * shard, (rank + 1) * shard, device=scaled.device)
        drop = (columns >= vocab).expand_as(scaled)
        if top_k is not None and 0 < top_k < vocab:
            drop = drop | _top_k_drop(scaled.masked_fill(drop, NEG_INF), top_k, group, size)
        if top_p < 1.0:
            first_try = top_k + 1 if top_k else TOP_P_CANDIDATES
            drop = drop | _top_p_drop(scaled.masked_fill(drop, NEG_INF), top_p, first_try, group, size)
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    # masked_fill makes the copy that vocab_parallel_cross_entropy's in-place max subtraction may take.
    return -vocab_parallel_cross_entropy(scaled.masked_fill(drop, NEG_INF), targets)


# --- data parallelism ------------------------------------------------------------------------------

def dp_group():
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_group()


def dp_row_share(rows: int, what: str) -> tuple[int, int]:
    """``(start, stop)`` of this data-parallel rank's contiguous, equal share of ``rows`` rows.

    Equal shares keep the ranks in step (the same number of forward/backward calls, each with its TP
    collectives); the ranks of one TP group take the same share.
    """
    from megatron.core import parallel_state

    return row_share(rows, what, world=parallel_state.get_data_parallel_world_size(),
                     rank=parallel_state.get_data_parallel_rank(), ranks="replicas")


def all_reduce_gradients(params: list[torch.nn.Parameter], group) -> None:
    """SUM every gradient over the data-parallel group, in one flat buffer.

    Each rank's loss is already divided by the counts of the WHOLE global batch (as the hf policy's
    FSDP path), so the single-process gradient is the sum of the replicas' gradients.
    """
    for param in params:
        if param.grad is None:  # a parameter unused on this rank still takes part in the reduction
            param.grad = torch.zeros_like(param)
    grads = [param.grad for param in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
        offset += grad.numel()


# --- gradient norm under TP ------------------------------------------------------------------------

def clip_grad_norm(params: Iterable[torch.nn.Parameter], max_norm: float | None) -> torch.Tensor:
    """The 2-norm of the whole model's gradient, from TP shards, and clipping as ``clip_grad_norm_``.

    A TP-split parameter (Megatron marks it ``tensor_model_parallel``) holds a different slice on each
    TP rank; a replicated one (norms, row-parallel biases) holds the same complete gradient on every TP
    rank (without sequence parallelism), so it is counted on TP rank 0 only. The squares are summed
    over the TP group; DP replicas hold identical (already reduced) gradients and are not added.
    """
    group, rank, _ = _tp()
    params = [p for p in params if p.grad is not None]
    squares = torch.zeros((), dtype=torch.float32, device=params[0].grad.device if params else "cpu")
    for p in params:
        if getattr(p, "tensor_model_parallel", False) or rank == 0:
            squares = squares + p.grad.detach().float().pow(2).sum()
    dist.all_reduce(squares, group=group)
    norm = squares.sqrt()
    if max_norm is not None and torch.isfinite(norm):
        # torch.nn.utils.clip_grad_norm_'s coefficient, so TP = 1 and TP > 1 clip alike.
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for p in params:
            p.grad.detach().mul_(coef.to(p.grad.dtype))
    return norm
