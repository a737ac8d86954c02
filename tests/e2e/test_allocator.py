"""cluster.malloc_mmap_threshold and cluster.release_freed_memory: freed blocks go back to the OS.

Each probe runs in a fresh interpreter, so the allocator state it measures is its own."""

from __future__ import annotations

import subprocess
import sys

import pytest

from helpers import config_problems

PROBE = r"""
import ctypes, sys
from grpo_sdk.runtime.allocator import fix_mmap_threshold, release_freed_memory, while_training

def rss_mib():
    status = open("/proc/self/status").read().split("VmRSS:")[1]
    return int(status.split()[0]) // 1024

libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
MIB = 1 << 20

def block(n):
    p = libc.malloc(n)
    ctypes.memset(p, 1, n)  # resident, not just reserved
    return p

def holes():  # MiB left resident after a training step's pattern: a live small block above each freed big one
    before, live = rss_mib(), []
    for i in range(8):
        big = block((8 + i) * MIB)
        live.append(block(64 * 1024))
        libc.free(big)
    return rss_mib() - before

took = fix_mmap_threshold(MIB) if sys.argv[1] == "fixed" else None
libc.free(block(16 * MIB))  # glibc now raises its threshold to 16 MiB (unless it is fixed)
if sys.argv[1] == "training":  # the trainer's phases: the threshold while training, glibc's ceiling after
    with while_training(MIB):
        kept = holes()
    print(kept, holes())
    sys.exit()
before = rss_mib()
kept = holes()
if sys.argv[1] == "trim":
    took = release_freed_memory()
    kept = rss_mib() - before
print(took, kept)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator: Linux only")
def test_the_threshold_holds_while_training_and_sampling_reuses_its_blocks():
    """``while_training``: no holes kept while the policy trains; afterwards a fixed 32 MiB threshold
    (glibc's own ceiling), under which the sampler's freed blocks stay in the heap to be reused."""
    training_kept, sampling_kept = kept_mib("training")
    assert int(training_kept) <= 2 and sampling_kept >= 16


def kept_mib(mode: str) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=60, check=True)
    took, kept = out.stdout.split()
    return took, int(kept)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator: Linux only")
def test_a_fixed_threshold_gives_freed_blocks_back():
    took, default_kept = kept_mib("default")
    assert default_kept >= 16  # glibc's own threshold: freed 8-15 MiB blocks stay resident (measured 23 MiB)
    took, fixed_kept = kept_mib("fixed")
    assert took == "True" and fixed_kept <= 2


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator: Linux only")
def test_releasing_after_a_step_gives_the_holes_back():
    """What the trainer does after every step (cluster.release_freed_memory): the same holes, handed back."""
    assert kept_mib("default")[1] >= 16
    took, trimmed_kept = kept_mib("trim")
    assert took == "True" and trimmed_kept <= 2


def test_null_leaves_the_allocator_alone():
    from grpo_sdk.runtime.allocator import fix_mmap_threshold

    assert fix_mmap_threshold(None) is False


@pytest.mark.parametrize("value", ["0", "-1", "67108864"])
def test_out_of_range_thresholds_are_config_errors(registry, value):
    assert "cluster.malloc_mmap_threshold" in config_problems(registry, f"cluster.malloc_mmap_threshold={value}")


@pytest.mark.parametrize("enabled, calls", [("true", 2), ("false", 0)])
def test_the_trainer_releases_after_every_step_unless_told_not_to(registry, tmp_path, tiny_model_dir, monkeypatch,
                                                                  enabled, calls):
    from helpers import small_trainer

    import grpo_sdk.trainer.trainer as trainer_module

    released = []
    monkeypatch.setattr(trainer_module, "release_freed_memory", lambda: released.append(1))
    trainer = small_trainer(registry, tmp_path / "run", tiny_model_dir, f"cluster.release_freed_memory={enabled}",
                            "grpo.val_period=0", "grpo.val_at_start=false", "grpo.val_at_end=false")
    try:
        trainer.train()
    finally:
        trainer.shutdown()
    assert len(released) == calls


def test_the_trainer_fixes_the_threshold_around_its_training_phases_only(registry, tmp_path, tiny_model_dir,
                                                                         monkeypatch):
    import contextlib

    from helpers import small_trainer

    import grpo_sdk.trainer.trainer as trainer_module

    phases = []

    @contextlib.contextmanager
    def record(nbytes):
        phases.append([nbytes, False])
        yield
        phases[-1][1] = True  # the phase's body ran to its end inside the context

    monkeypatch.setattr(trainer_module, "while_training", record)
    trainer = small_trainer(registry, tmp_path / "run", tiny_model_dir, "cluster.malloc_mmap_threshold=1048576",
                            "grpo.val_period=0", "grpo.val_at_start=false", "grpo.val_at_end=false")
    try:
        trainer.train()
    finally:
        trainer.shutdown()
    assert phases == [[1048576, True]] * 2  # 2 steps x one span: the logprob passes through the optimizer step
