"""Data parallelism any policy backend shares: equal row shares, and the few collectives that keep the
ranks' results whole and identical (public as ``grpo_sdk.plugins.training``; imports torch).

The contract a data-parallel policy keeps with the runtime (docs/distributed.md): every rank gets the
SAME full batch in every call and calls every method; each rank computes its contiguous, equal share
of the rows; results come back whole and identical on every rank. ``group`` arguments default to the
runtime's group; a policy with model parallelism passes its data-parallel group.
"""

from __future__ import annotations

import json
import zlib

import torch
import torch.distributed as dist


def row_share(rows: int, what: str, *, world: int | None = None, rank: int | None = None,
              ranks: str = "ranks") -> tuple[int, int]:
    """``(start, stop)`` of this rank's contiguous, equal share of ``rows`` rows (of the default group's,
    or of ``world`` ranks as rank ``rank``: e.g. one data-parallel group among model-parallel ones).

    Equal shares are what keeps the ranks in step: every rank then runs the same number of
    forward/backward calls, and an FSDP collective waiting for a missing call would hang.
    """
    world = dist.get_world_size() if world is None else world
    rank = dist.get_rank() if rank is None else rank
    if rows % world:
        raise ValueError(f"{what}: {rows} rows do not split evenly over {world} data-parallel policy {ranks}; make "
                         "grpo.num_prompts_per_step * grpo.num_generations_per_prompt and "
                         f"policy.train_global_batch_size multiples of {world}")
    share = rows // world
    return rank * share, (rank + 1) * share


def all_gather_rows(share: torch.Tensor, group=None) -> torch.Tensor:
    """Every rank's equal ``[rows, ...]`` share, concatenated in rank order, on every rank (of ``group``:
    the default one, or e.g. a data-parallel group among model-parallel ones)."""
    parts = [torch.empty_like(share) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, share.contiguous(), group=group)
    return torch.cat(parts)


def all_reduce_metrics(metrics: dict[str, float], failed: bool, device: torch.device, group=None,
                       who: str = "policy") -> tuple[dict[str, float], bool]:
    """One optimizer step's metrics over every rank's share (of ``group``: the default one, or e.g. the
    data-parallel group when the ranks of a tensor-parallel group hold the same metrics and must not be
    added up), and whether any rank failed.

    Sums add up (each rank's loss metrics are already divided by the global counts);
    ``_min``/``_max`` keys take the min/max (``grpo_sdk.core.metrics``). Two all-reduces; a
    checksum of the key names travels with the maxima, so ranks whose metrics differ in keys
    stop with an error instead of adding unrelated numbers.
    """
    keys = sorted(metrics)
    sums = [k for k in keys if not k.endswith(("_min", "_max"))]
    extremes = [k for k in keys if k.endswith(("_min", "_max"))]
    checksum = float(zlib.crc32("\n".join(keys).encode()))
    summed = torch.tensor([metrics[k] for k in sums] + [float(failed)], dtype=torch.float64, device=device)
    dist.all_reduce(summed, group=group)
    # min(x) = -max(-x), so one MAX reduction serves both kinds; max(c) == -max(-c) iff all c agree.
    maxed = torch.tensor([metrics[k] if k.endswith("_max") else -metrics[k] for k in extremes] + [checksum, -checksum],
                         dtype=torch.float64, device=device)
    dist.all_reduce(maxed, op=dist.ReduceOp.MAX, group=group)
    summed, maxed = summed.tolist(), maxed.tolist()
    if maxed[-2] != -maxed[-1]:
        raise RuntimeError(f"{who}: the loss returned different metric names on different ranks")
    out = dict(zip(sums, summed))
    out.update({k: v if k.endswith("_max") else -v for k, v in zip(extremes, maxed)})
    return out, summed[-1] > 0


def any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank when ``flag`` is true on any rank (a collective, so also a barrier)."""
    value = torch.tensor([float(flag)], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def max_over_ranks(value: int, device: torch.device) -> int:
    """The largest ``value`` of any rank, on every rank: e.g. the micro-batch count every rank must run
    when token budgets give the ranks different counts."""
    tensor = torch.tensor([value], dtype=torch.long, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor.item())


def broadcast_json(value, device: torch.device):
    """Rank 0's JSON-able ``value`` on every rank (other ranks pass anything); no pickle."""
    data = json.dumps(value).encode() if dist.get_rank() == 0 else b""
    size = torch.tensor([len(data)], dtype=torch.long, device=device)
    dist.broadcast(size, src=0)
    buffer = (torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device) if dist.get_rank() == 0
              else torch.empty(int(size.item()), dtype=torch.uint8, device=device))
    dist.broadcast(buffer, src=0)
    return json.loads(bytes(buffer.cpu().numpy()))
