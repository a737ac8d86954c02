"""One run per run directory: a second `grpoctl run` on it exits 2 naming the holder's pid, whether
started together or mid-run, and the first run's metrics stay those of an undisturbed run. The
lock is an OS file lock, so a SIGKILLed run leaves none behind."""

from __future__ import annotations

import signal

import pytest

from faults.campaign import (SMALL, assert_no_traceback, assert_same_run, finish, grpoctl, metrics_of, start,
                      wait_for_line)

pytestmark = [pytest.mark.faults, pytest.mark.slow]

ARGS = ["run", "--run-dir", "run", *SMALL]


def test_two_runs_started_together_one_refuses(tmp_path, reference):
    first, second = start(*ARGS, cwd=tmp_path), start(*ARGS, cwd=tmp_path)
    results = [finish(first), finish(second)]
    codes = sorted(code for code, _, _ in results)
    assert codes == [0, 2], [err[-1500:] for _, _, err in results]
    loser = next(err for code, _, err in results if code == 2)
    winner = first if results[0][0] == 0 else second
    assert_no_traceback(loser)
    assert f"is in use by another grpoctl run (pid {winner.pid})" in loser
    assert_same_run(tmp_path / "run", reference)


def test_a_second_run_mid_run_refuses_and_changes_nothing(tmp_path, reference):
    first = start(*ARGS, "grpo.max_num_steps=5000", cwd=tmp_path)  # mid-run for as long as the test needs
    assert wait_for_line(first, "step 1/")
    second = grpoctl(*ARGS, cwd=tmp_path)
    assert second.returncode == 2
    assert_no_traceback(second.stderr)
    assert f"pid {first.pid}" in second.stderr
    resumed = grpoctl("run", "--resume", "run", cwd=tmp_path)  # --resume is refused the same way
    assert resumed.returncode == 2 and f"pid {first.pid}" in resumed.stderr
    first.send_signal(signal.SIGINT)
    code, _, _ = finish(first)
    assert code == 130
    steps = [r["step"] for r in metrics_of(tmp_path / "run")]
    assert steps == sorted(set(steps)), "interleaved or duplicated steps"


def test_a_sigkilled_run_leaves_no_stale_lock(tmp_path, reference):
    first = start(*ARGS, cwd=tmp_path)
    assert wait_for_line(first, "step 5/")
    first.send_signal(signal.SIGKILL)
    finish(first)
    resumed = grpoctl("run", "--resume", "run", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert_same_run(tmp_path / "run", reference)


def test_a_checkpoint_dir_shared_by_two_runs_is_locked_too(tmp_path):
    first = start("run", "--run-dir", "a", *SMALL, "grpo.max_num_steps=5000", "checkpointing.checkpoint_dir=shared",
                  cwd=tmp_path)
    assert wait_for_line(first, "step 1/")
    second = grpoctl("run", "--run-dir", "b", *SMALL, "checkpointing.checkpoint_dir=shared", cwd=tmp_path)
    first.kill()
    finish(first)
    assert second.returncode == 2
    assert_no_traceback(second.stderr)
    assert "shared is in use by another grpoctl run" in second.stderr
