"""How much freed memory the C allocator keeps (glibc only): ``cluster.malloc_mmap_threshold``.

Torch's CPU tensors come from ``malloc``. glibc serves a large block with its own mapping, returned to
the OS when freed, but only until the first such block is freed: then it raises its "mmap threshold"
to that block's size, and later blocks up to it come from the heap, where a freed block below a live
one stays resident. A training step frees hundreds of activation and logit blocks of a few MiB to a few
hundred MiB in an order that pins them, so the process's resident memory grows step after step past
what is live (docs/benchmarks.md, "Memory plan": SmolLM2-135M-Instruct's recipe measured at 1.7x the
dry-run plan). Fixing the threshold turns the adjustment off: every block of at least that size is
mapped on its own and given back when freed, at the price of a fresh mapping (and its page faults)
per block.

Mapping every block costs most where blocks are many and short-lived: the sampler allocates a few MiB
per layer per token (a growing KV cache, logits) and at a fixed 1 MiB threshold took 1.33x as long
(SmolLM2's recipe, 4 steps), while training, whose holes are what grows the peak, took 1.15x. So the
threshold holds only while the policy trains (``while_training``): the trainer's process samples with a
fixed threshold of ``SAMPLING_THRESHOLD``, glibc's own ceiling, where its freed blocks are reused
token after token, and before training hands the sampler's freed pages back. A Ray policy worker only
trains and keeps the threshold throughout; generation and environment workers keep glibc's default.
``MALLOC_MMAP_THRESHOLD_`` in the environment fixes one threshold for a whole process tree instead.

Cheaper, weaker, and on by default: ``release_freed_memory`` after every step
(``cluster.release_freed_memory``) hands back what the step freed (``malloc_trim``), so the holes do
not pile up over a run (SmolLM2's recipe, 40 steps: peak 6,335 against 7,072 MiB); a step's own holes, made
while it trains, still count in its peak.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import sys
from typing import Iterator

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
SAMPLING_THRESHOLD = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: where its own threshold ends up


def fix_mmap_threshold(nbytes: int | None) -> bool:
    """Serve every ``malloc`` of ``nbytes`` or more with its own mapping from now on (glibc's
    ``mallopt(M_MMAP_THRESHOLD)``, which also stops glibc raising the threshold itself). ``None`` leaves
    the allocator alone. True when glibc took it; False elsewhere (macOS, musl), where it is a no-op."""
    libc = _glibc() if nbytes is not None else None
    if libc is None:
        return False
    return libc.mallopt(M_MMAP_THRESHOLD, int(nbytes)) == 1


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """The C library when it is glibc (it has mallopt and malloc_trim), else None (macOS, musl)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
        libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    except (OSError, AttributeError):  # AttributeError: a C library without them
        return None
    return libc


def release_freed_memory() -> bool:
    """Give the pages of every free heap block back to the OS (glibc's ``malloc_trim(0)``, which since
    glibc 2.8 releases free blocks inside the heap too, not only at its top). True when glibc did."""
    libc = _glibc()
    if libc is None:
        return False
    return libc.malloc_trim(0) == 1


@contextlib.contextmanager
def while_training(nbytes: int | None) -> Iterator[None]:
    """``cluster.malloc_mmap_threshold`` for the duration of a training phase of a process that also
    samples: the sampler's freed pages handed back, the threshold fixed at ``nbytes``, then
    ``SAMPLING_THRESHOLD`` again. ``None`` leaves the allocator alone."""
    if nbytes is None or _glibc() is None:
        yield
        return
    release_freed_memory()
    fix_mmap_threshold(nbytes)
    try:
        yield
    finally:
        fix_mmap_threshold(SAMPLING_THRESHOLD)
