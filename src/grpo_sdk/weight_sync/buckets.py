"""The weights' plan for a transport that sends them in buckets (collective, engine broadcast,
CUDA IPC): the names, shapes and dtypes ``named_weights`` yields, packed in that order into flat
byte buckets, every tensor at a 64-byte aligned offset so a byte slice views as any dtype. Pure,
unit-tested without a cluster.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Iterator, Sequence

import attrs

ALIGN = 64  # bytes; a bucket offset that is a multiple of it views as any dtype (and suits vectorised copies)


@attrs.frozen
class Entry:
    """One tensor's place in a bucket."""

    name: str
    shape: tuple[int, ...]
    dtype: Any  # torch.dtype
    offset: int  # bytes from the start of the bucket
    nbytes: int


@attrs.frozen
class Bucket:
    """One broadcast: ``nbytes`` bytes holding ``entries`` in order."""

    nbytes: int
    entries: tuple[Entry, ...]


def describe(weights: Iterable[tuple[str, Any]]) -> list[tuple[str, tuple[int, ...], Any]]:
    """``(name, shape, dtype)`` of each (name, tensor) pair, in order."""
    return [(name, tuple(int(d) for d in tensor.shape), tensor.dtype) for name, tensor in weights]


def align_up(offset: int, align: int = ALIGN) -> int:
    return -(-offset // align) * align


def starts_new_bucket(count: int, end: int, nbytes: int, bucket_bytes: int, align: int = ALIGN) -> bool:
    """Whether a tensor of ``nbytes`` goes to a new bucket, after ``count`` tensors ending at byte ``end``.

    The one bucketing rule of both transports: tensors in order, each at an ``align``-ed offset,
    at most ``bucket_bytes`` a bucket; a larger tensor goes alone; ``bucket_bytes <= 0``: one each.
    """
    return count > 0 and (bucket_bytes <= 0 or align_up(end, align) + nbytes > bucket_bytes)


def plan_buckets(specs: Sequence[tuple[str, tuple[int, ...], Any]], bucket_bytes: int, *,
                 align: int = ALIGN) -> list[Bucket]:
    """Pack ``(name, shape, dtype)`` specs, in order, into buckets (``starts_new_bucket`` says where).

    The order is the sender's iteration order, so rank 0 fills the buckets while it drains
    ``named_weights``.
    """
    buckets: list[Bucket] = []
    entries: list[Entry] = []
    end = 0
    for name, shape, dtype in specs:
        nbytes = math.prod(shape) * dtype.itemsize
        if starts_new_bucket(len(entries), end, nbytes, bucket_bytes, align):
            buckets.append(Bucket(nbytes=end, entries=tuple(entries)))
            entries, end = [], 0
        start = align_up(end, align)
        entries.append(Entry(name=name, shape=tuple(shape), dtype=dtype, offset=start, nbytes=nbytes))
        end = start + nbytes
    if entries:
        buckets.append(Bucket(nbytes=end, entries=tuple(entries)))
    return buckets


def check_entry(entry: Entry, name: str, tensor: Any) -> str | None:
    """Why ``(name, tensor)`` does not fit ``entry`` (None when it does)."""
    if name != entry.name:
        return f"expected {entry.name!r}, got {name!r}"
    if tuple(tensor.shape) != entry.shape or tensor.dtype != entry.dtype:
        return (f"{name!r} is {tuple(tensor.shape)} {tensor.dtype}, the plan has {entry.shape} {entry.dtype}")
    return None


def pack_into(buffer: Any, entry: Entry, tensor: Any) -> None:
    """Copy ``tensor`` into its place in the flat uint8 ``buffer`` (across devices if need be)."""
    if entry.nbytes:
        buffer[entry.offset:entry.offset + entry.nbytes].view(entry.dtype).copy_(tensor.detach().reshape(-1))


def unpack(bucket: Bucket, buffer: Any) -> Iterator[tuple[str, Any]]:
    """``(name, tensor)`` views into a received bucket, in the plan's order (no copies)."""
    for entry in bucket.entries:
        yield entry.name, buffer[entry.offset:entry.offset + entry.nbytes].view(entry.dtype).view(entry.shape)
