"""Storage faults: what can be known before training is a config error (exit 2) before any model
loads; a disk that fills up mid-run stops the run with exit 1 naming the path, the previous
checkpoint stays the latest and verifies, and the run resumes exactly once there is room.

Disk full is real where this machine lets a test mount a small tmpfs (root, Linux); elsewhere the
same code paths are reached by an injected ENOSPC (tests/faults/fault_inject.py), which proves the
handling but not the kernel's behaviour."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from faults.campaign import SMALL, assert_no_traceback, assert_same_run, grpoctl

from grpo_sdk.trainer.checkpoint import CheckpointManager, verify
from grpo_sdk.config.schema import CheckpointingConfig

pytestmark = [pytest.mark.faults, pytest.mark.slow]


@contextlib.contextmanager
def tmpfs(path: Path, size: str, read_only: bool = False):
    path.mkdir(parents=True, exist_ok=True)
    options = f"size={size}" + (",ro" if read_only else "")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                             capture_output=True).returncode == 0
    if not mounted:
        pytest.skip("cannot mount a tmpfs here (needs root on Linux)")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def test_a_disk_that_fills_up_mid_run_keeps_the_previous_checkpoint(tmp_path, reference):
    disk = tmp_path / "disk"
    with tmpfs(disk, "2600k"):  # room for the model and one checkpoint (~1.3 MB), not two
        result = grpoctl("run", "--run-dir", str(disk / "run"), *SMALL, "checkpointing.keep_top_k=null",
                         cwd=tmp_path)
        assert result.returncode == 1, result.stderr[-3000:]
        assert_no_traceback(result.stderr)
        assert "could not write" in result.stderr and "No space left on device" in result.stderr
        latest = CheckpointManager(CheckpointingConfig(), disk / "run").latest()
        assert latest is not None and latest.name == "step_4" and verify(latest) is None
        assert latest.name in result.stderr  # "the latest checkpoint is still .../step_4"
        assert not list((disk / "run" / "checkpoints").glob(".step_*"))  # the half-written one is gone
        shutil.copytree(disk / "run", tmp_path / "run")  # "once there is room": move it to a bigger disk
    resumed = grpoctl("run", "--resume", "run", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from step 4" in resumed.stdout
    assert_same_run(tmp_path / "run", reference)


@pytest.mark.parametrize("point", ["checkpoint.contents@2", "metrics.line@6"])
def test_an_injected_enospc_mid_run_is_a_clear_error_and_resumes(tmp_path, reference, point):
    result = grpoctl("run", "--run-dir", "run", "-p", "fault_inject", *SMALL, cwd=tmp_path,
                     GRPO_FAULT=point, GRPO_FAULT_ACTION="ENOSPC")
    assert result.returncode == 1, result.stderr[-3000:]
    assert_no_traceback(result.stderr)
    assert "No space left on device" in result.stderr
    assert ("checkpoint of step 8" if point.startswith("checkpoint") else "metrics of step 6") in result.stderr
    resumed = grpoctl("run", "--resume", "run", cwd=tmp_path)
    assert resumed.returncode == 0 and "resumed from step 4" in resumed.stdout
    assert_same_run(tmp_path / "run", reference)


def test_too_little_space_for_one_checkpoint_is_refused_before_training(tmp_path):
    disk = tmp_path / "disk"
    with tmpfs(disk, "900k"):  # the built-in model fits (~0.5 MB), a checkpoint (~1.3 MB) does not
        result = grpoctl("run", "--run-dir", str(disk / "run"), *SMALL, cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    assert_no_traceback(result.stderr)
    assert "less than one checkpoint of this model needs" in result.stderr
    assert "step 1/" not in result.stdout


def test_a_disk_too_small_for_the_model_itself_is_a_clear_error(tmp_path):
    disk = tmp_path / "disk"
    with tmpfs(disk, "100k"):
        result = grpoctl("run", "--run-dir", str(disk / "run"), *SMALL, cwd=tmp_path)
    assert result.returncode == 1, result.stderr[-3000:]
    assert_no_traceback(result.stderr)
    assert "could not write to the run directory" in result.stderr and "No space left" in result.stderr


def test_a_read_only_run_directory_is_refused_before_training(tmp_path):
    disk = tmp_path / "ro"
    with tmpfs(disk, "1m", read_only=True):
        result = grpoctl("run", "--run-dir", str(disk / "run"), *SMALL, cwd=tmp_path)
    assert result.returncode == 2
    assert_no_traceback(result.stderr)
    assert "is not writable" in result.stderr


@pytest.mark.parametrize("what", ["run dir is a file", "run dir parent is a file", "checkpoint dir is a file"])
def test_paths_that_are_files_are_refused_before_training(tmp_path, what):
    (tmp_path / "afile").write_text("x")
    args = {"run dir is a file": ["--run-dir", "afile"],
            "run dir parent is a file": ["--run-dir", "afile/run"],
            "checkpoint dir is a file": ["--run-dir", "run", "checkpointing.checkpoint_dir=afile"]}[what]
    result = grpoctl("run", *args, *SMALL, cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    assert_no_traceback(result.stderr)
    assert "afile" in result.stderr and "not a directory" in result.stderr


def test_missing_parents_of_the_run_directory_are_created(tmp_path, reference):
    result = grpoctl("run", "--run-dir", "a/b/c/run", *SMALL, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_run(tmp_path / "a" / "b" / "c" / "run", reference)
    assert os.access(tmp_path / "a" / "b" / "c" / "run" / "summary.json", os.R_OK)
