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

``MALLOC_MMAP_THRESHOLD_`` in the environment does the same for a whole process tree; this applies it
from the config, in the trainer's process and in every Ray worker, before the model is built.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
MAX_MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc's HEAP_MAX / 2 on 64-bit: mallopt refuses more


def fix_mmap_threshold(nbytes: int | None) -> bool:
    """Serve every ``malloc`` of ``nbytes`` or more with its own mapping from now on (glibc's
    ``mallopt(M_MMAP_THRESHOLD)``, which also stops glibc raising the threshold itself). ``None`` leaves
    the allocator alone. True when glibc took it; False elsewhere (macOS, musl), where it is a no-op."""
    if nbytes is None or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc: no mallopt, or not this one
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, int(nbytes)) == 1
