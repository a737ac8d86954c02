"""Means, spreads and whitening that stay exact where the math is exact.

GRPO's most common group is "one success among identical failures", and the textbook shortcut
``var = E[x^2] - E[x]^2`` (NeMo-RL's form) turns the exact zero spread of the identical rows into
rounding noise: float32 rewards ``[0.1, 0.1, 0.1, 0.9]`` give the lone success a leave-one-out std
of ~1e-9 instead of 0, and dividing by ``1e-9 + 1e-6`` inflates its advantage a million-fold.

Everything here works in float64 on *deviations* in a shifted frame instead:

1. a reference value ``ref`` is taken from the very rows being averaged (the first of them);
2. ``d = x - ref`` (exact in float64 for float32/bfloat16 inputs, and exact by Sterbenz's lemma
   for float64 inputs within a factor of two of each other, ties in particular);
3. ``offset = mean(d)``, so ``mean = ref + offset``; the deviations are ``d - offset`` and the
   (unbiased or biased) variance is their mean square.

When the averaged rows are all equal, every ``d`` is exactly 0, so the mean is exactly the common
value and the variance exactly 0, whatever the dtype. Otherwise the relative error is that of a
float64 two-pass algorithm (~1e-16 times the group's spread-to-magnitude ratio). Leave-one-out
statistics are computed from each row's *others* directly (an ``[B, N]`` layout, ``N`` the
largest group), not by subtracting the row from a group total.
"""

from __future__ import annotations

import torch


class GroupLayout:
    """Rows of a batch laid out by group: ``group[i]`` and ``slot[i]`` place row ``i`` in a
    ``[num_groups, max_size]`` grid, so per-row statistics over (other) rows of the same group are
    plain reductions over the last dimension."""

    def __init__(self, group_ids: torch.Tensor, batch_size: int):
        # Groups are rows of equal ids; a 2-D id ([B, s], NeMo-RL's prompt token rows) compares whole rows.
        _, group = torch.unique(group_ids.reshape(batch_size, -1), dim=0, return_inverse=True)
        self.group = group.reshape(batch_size)
        self.num_groups = int(self.group.max()) + 1
        sizes = torch.bincount(self.group, minlength=self.num_groups)
        order = torch.argsort(self.group, stable=True)
        starts = sizes.cumsum(0) - sizes
        self.slot = torch.empty_like(self.group)
        self.slot[order] = torch.arange(batch_size, device=group.device) - starts[self.group[order]]
        self.max_size = int(sizes.max())
        self.rows = torch.arange(batch_size, device=group.device)

    def grid(self, values: torch.Tensor) -> torch.Tensor:
        """``[B]`` values as the ``[num_groups, max_size]`` grid (0 where a group is shorter)."""
        out = values.new_zeros(self.num_groups, self.max_size)
        out[self.group, self.slot] = values
        return out

    def peers(self, weights: torch.Tensor, leave_one_out: bool) -> torch.Tensor:
        """``[B, N]``: row ``i``'s weight on each slot of its group (its own slot 0 if ``leave_one_out``)."""
        peers = self.grid(weights)[self.group]
        if leave_one_out:
            peers[self.rows, self.slot] = 0
        return peers


def shifted_moments(values: torch.Tensor, weights: torch.Tensor, dim: int = -1
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ref, offset, sum_sq, count)`` of ``values`` weighted by ``weights`` along ``dim``.

    ``mean = ref + offset`` and ``sum_sq = sum(w * (x - mean)^2)``, both computed on deviations from
    ``ref``, the value at the first position of positive weight (0 where there is none). Positions
    of zero weight never contribute, even when they hold NaN or inf. All four are float64.
    """
    x = values.double()
    w = weights.double()
    take = w > 0
    first = take.to(torch.int8).argmax(dim, keepdim=True)  # first position with weight (0 if none)
    ref = torch.where(take.any(dim, keepdim=True), x.gather(dim, first), torch.zeros_like(first, dtype=x.dtype))
    d = torch.where(take, x - ref, torch.zeros_like(x))
    count = w.sum(dim, keepdim=True)
    offset = torch.where(count > 0, (w * d).sum(dim, keepdim=True) / count.clamp(min=1e-300), torch.zeros_like(count))
    sum_sq = (w * (d - offset).square()).sum(dim, keepdim=True)
    return ref.squeeze(dim), offset.squeeze(dim), sum_sq.squeeze(dim), count.squeeze(dim)


def whiten(values: torch.Tensor, mask: torch.Tensor | None = None, *, unbiased: bool, floor: float = 0.0,
           ) -> torch.Tensor:
    """``(x - mean) / std`` over the positions where ``mask > 0`` (all when None), in float64.

    ``floor`` > 0 divides by ``sqrt(max(var, floor))``; with ``floor`` 0 a zero (or undefined)
    variance only centres. Every position is transformed, masked ones included (the loss masks them);
    masked positions never enter the statistics. A constant input gives exactly 0.
    """
    x = values.double().reshape(-1)
    w = torch.ones_like(x) if mask is None else mask.double().expand_as(values).reshape(-1)
    ref, offset, sum_sq, count = shifted_moments(x, w, dim=0)
    centred = (x - ref) - offset
    var = sum_sq / (count - 1) if unbiased else sum_sq / count
    if floor > 0:
        out = centred * var.clamp(min=floor).rsqrt()
    else:
        out = centred / var.sqrt() if bool(var > 0) else centred  # NaN (count <= 1) is not > 0: centre only
    return out.reshape(values.shape)
