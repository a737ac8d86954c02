"""SIGKILL anywhere: at every window where a crash could lose or corrupt data (injected exactly
there by tests/faults/fault_inject.py) and at random moments, then resume. Every case must end
bit-exact with the uninterrupted reference run: the same per-step metrics, each step logged once,
and the same final model.safetensors."""

from __future__ import annotations

import random
import signal
import time

import pytest

from faults.campaign import SMALL, assert_no_traceback, assert_same_run, grpoctl, resume_until_done, sample, start

pytestmark = [pytest.mark.faults, pytest.mark.slow]

# (point, n): the n-th time the run gets there. Checkpoints are saved at steps 4, 8 and 12; top-2
# pruning first removes step 4 while step 12 is saved; validation runs at steps 4, 8 and 12.
KILL_POINTS = [
    ("initial_model", 1), ("config.tmp", 1), ("step", 1), ("step", 6), ("metrics.line", 3),
    ("metrics.line", 12), ("validation", 2), ("checkpoint.contents", 1), ("checkpoint.contents", 3),
    ("checkpoint.renamed", 2), ("status.tmp", 1), ("status.tmp", 3), ("prune.renamed", 1),
    ("prune.halfway", 1),
]


@pytest.mark.parametrize("point, nth", sample(KILL_POINTS, ci=6), ids=lambda v: str(v))
def test_sigkill_at_a_critical_moment_then_resume_is_exact(tmp_path, reference, point, nth):
    args = ["run", "--run-dir", "run", "-p", "fault_inject", *SMALL]
    killed = grpoctl(*args, cwd=tmp_path, GRPO_FAULT=f"{point}@{nth}")
    assert killed.returncode == -signal.SIGKILL, f"the fault at {point}@{nth} never fired: {killed.stderr[-2000:]}"
    resume_until_done(tmp_path, ["run", "--run-dir", "run", *SMALL])
    assert_same_run(tmp_path / "run", reference)
    leftovers = [p.name for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.startswith(".")]
    assert leftovers == [], f"orphans after resume: {leftovers}"


def test_resume_of_a_run_killed_before_its_config_says_what_happened(tmp_path):
    args = ["run", "--run-dir", "run", "-p", "fault_inject", *SMALL]
    killed = grpoctl(*args, cwd=tmp_path, GRPO_FAULT="config.tmp")
    assert killed.returncode == -signal.SIGKILL
    result = grpoctl("run", "--resume", "run", cwd=tmp_path)
    assert result.returncode == 2
    assert_no_traceback(result.stderr)
    assert "stopped before it wrote its config" in result.stderr and "--run-dir run" in result.stderr


@pytest.mark.parametrize("seed", sample(list(range(20)), ci=2))
def test_sigkill_at_random_moments_then_resume_is_exact(tmp_path, reference, seed):
    """Three kills at random times (0.5-6 s after each start: start-up, training, saving, pruning)."""
    rng = random.Random(seed)
    args = ["run", "--run-dir", "run", *SMALL]
    for attempt in range(3):
        has_config = (tmp_path / "run" / "config.resolved.yaml").is_file()
        proc = start(*(["run", "--resume", "run"] if has_config else args), cwd=tmp_path)
        time.sleep(rng.uniform(0.5, 6.0))
        proc.kill()
        proc.communicate(timeout=60)
    resume_until_done(tmp_path, args)
    assert_same_run(tmp_path / "run", reference)
