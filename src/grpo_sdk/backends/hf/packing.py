"""Padding-free micro-batches for the hf policy: dynamic batching and sequence packing.

Both work on each row's real tokens (``attention_mask`` 1: the left-padded prompt and the
right-padded response, one contiguous span) and give the policy back input-aligned ``[rows, S]``
logprobs, so the loss sees the padded layout it always did.

* Dynamic batching (``policy.dynamic_batching``): rows sorted by length, longest first, grouped
  while ``rows x width <= budget`` (width: the group's longest row rounded up to
  ``sequence_length_round``); each row is laid out from column 0 and right-padded to the width.
  A row alone in a group may be as long as the budget itself (its rounded width is not counted).
* Sequence packing (``policy.sequence_packing``): rows put into bins of at most ``budget`` tokens
  by first-fit decreasing; each bin is one row, its sequences one after another, positions
  restarting at 0 for each, padded at the end to a multiple of ``sequence_length_round``. The
  model gets no attention mask but these position ids, from which transformers (5.x:
  ``masking_utils.find_packed_sequence_indices``) builds a block-diagonal causal mask for eager and
  SDPA attention, and the varlen path for flash attention: no token attends across a boundary.
  The first token of each sequence is never scored (it would be predicted by the previous one).

Each row has the positions it has in the padded batch (0 at its first real token), so logprobs
and gradients equal the padded path's up to float rounding. A row longer than the budget is an
error naming the key (the config check already refuses a budget below
``policy.max_total_sequence_length``).
"""

from __future__ import annotations

import weakref

import torch

from grpo_sdk.backends.hf.forward import sequence_logprobs

ALGORITHMS = ("first_fit_decreasing",)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def spans(attention_mask: torch.Tensor, key: str) -> tuple[list[int], list[int]]:
    """``(starts, lengths)`` of each row's real tokens; a row whose tokens are not one span is an error."""
    mask = attention_mask.bool().cpu()
    lengths = mask.sum(1)
    starts = mask.int().argmax(1)
    lasts = mask.shape[1] - 1 - mask.flip(1).int().argmax(1)
    broken = ((lasts - starts + 1 != lengths) & (lengths > 0)).nonzero().flatten().tolist()
    if broken:
        raise ValueError(f"{key}: row {broken[0]}'s attention mask has holes (its tokens are not one span after "
                         "left padding); padding-free batching needs prompt + response contiguous")
    return starts.tolist(), lengths.tolist()


def plan(lengths: list[int], budget: int, round_to: int, *, pack: bool, key: str) -> list[list[int]]:
    """Micro-batches (row indices, ascending in each) of rows with ``lengths`` under ``budget`` tokens."""
    for row, n in enumerate(lengths):
        if n > budget:
            raise ValueError(f"{key}: row {row} has {n} tokens, more than the budget of {budget}; raise {key} to at "
                             "least policy.max_total_sequence_length")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    if pack:  # first-fit decreasing
        room: list[int] = []
        for i in order:
            n = max(1, lengths[i])
            target = next((b for b, free in enumerate(room) if n <= free), None)
            if target is None:
                bins.append([i])
                room.append(budget - n)
            else:
                bins[target].append(i)
                room[target] -= n
    else:
        width = 0
        for i in order:
            if bins and (len(bins[-1]) + 1) * width <= budget:
                bins[-1].append(i)
            else:  # sorted longest first: the first row of a group sets its width
                bins.append([i])
                width = round_up(max(1, lengths[i]), round_to)
    return [sorted(b) for b in bins]


def padding_free_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_mask: torch.Tensor, *,
                          pack: bool, round_to: int, key: str, **forward):
    """``sequence_logprobs`` of these rows without their padding (all of them in one micro-batch:
    one packed row, or right-padded to the longest), as the input-aligned ``[rows, S]`` tensor(s)."""
    rows, width = input_ids.shape
    if pack:
        check_isolation(model, input_ids, key)
    starts, lengths = spans(attention_mask, key)
    src_r, src_c, dst_r, dst_c, first = [], [], [], [], []
    offset = 0
    for r, (start, n) in enumerate(zip(starts, lengths)):
        src_r += [r] * n
        src_c += range(start, start + n)
        dst_r += [0 if pack else r] * n
        dst_c += range(offset, offset + n)
        first += [1] + [0] * (n - 1) if n else []
        offset = offset + n if pack else 0
    device = input_ids.device
    src_r, src_c, dst_r, dst_c = (torch.tensor(x, dtype=torch.long, device=device)
                                  for x in (src_r, src_c, dst_r, dst_c))
    new_rows = 1 if pack else rows
    new_width = max(1, round_up(offset if pack else max(lengths, default=1), round_to))
    ids = torch.zeros(new_rows, new_width, dtype=input_ids.dtype, device=device)
    ids[dst_r, dst_c] = input_ids[src_r, src_c]
    scored = torch.zeros(new_rows, new_width, dtype=token_mask.dtype, device=device)
    scored[dst_r, dst_c] = token_mask[src_r, src_c] * (1 - torch.tensor(first, dtype=token_mask.dtype, device=device))
    if pack:  # positions restart per sequence; the padding after the last one is a sequence of its own
        positions = torch.arange(new_width, device=device)
        positions[:offset] = dst_c - torch.repeat_interleave(
            torch.tensor(_offsets(lengths), dtype=torch.long, device=device),
            torch.tensor([n for n in lengths if n], dtype=torch.long, device=device))
        positions[offset:] -= offset
        mask, positions = None, positions[None]
    else:
        mask = torch.zeros(new_rows, new_width, dtype=attention_mask.dtype, device=device)
        mask[dst_r, dst_c] = 1
        positions = None
    results = sequence_logprobs(model, ids, mask, token_mask=scored, position_ids=positions, **forward)
    out = tuple(torch.zeros(rows, width, device=lp.device, dtype=lp.dtype).index_put((src_r, src_c), lp[dst_r, dst_c])
                for lp in (results if isinstance(results, tuple) else (results,)))
    return out if isinstance(results, tuple) else out[0]


_ISOLATED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> the probe passed


@torch.no_grad()
def check_isolation(model, input_ids: torch.Tensor, key: str) -> None:
    """Once per model: the logits of a sequence packed after another equal its logits alone. Packing
    relies on transformers turning restarting position ids into a block-diagonal mask; a model (or a
    transformers release) that does not would attend across sequences silently."""
    if _ISOLATED.get(model):
        return
    tokens = input_ids.flatten()[:12]
    first, second = tokens[:tokens.numel() // 2], tokens[tokens.numel() // 2:].flip(0)
    packed = torch.cat([first, second])[None]
    positions = torch.cat([torch.arange(first.numel()), torch.arange(second.numel())]).to(packed.device)[None]
    together = model(input_ids=packed, position_ids=positions, use_cache=False).logits[0, first.numel():]
    alone = model(input_ids=second[None], attention_mask=torch.ones_like(second)[None], use_cache=False,
                  position_ids=positions[:, first.numel():]).logits[0]
    tolerance = 1e-4 if alone.dtype == torch.float32 else 2e-2
    if not torch.allclose(together.float(), alone.float(), rtol=tolerance, atol=tolerance):
        raise ValueError(f"{key}: {type(model).__name__} attends across packed sequences here (its attention does not "
                         "build a block-diagonal mask from restarting position ids: transformers 5.x does for eager "
                         "and SDPA attention); use policy.dynamic_batching instead")
    _ISOLATED[model] = True


def _offsets(lengths: list[int]) -> list[int]:
    """Where each non-empty sequence starts in a packed row."""
    out, at = [], 0
    for n in lengths:
        if n:
            out.append(at)
            at += n
    return out
