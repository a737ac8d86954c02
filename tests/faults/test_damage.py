"""Damaged checkpoints are found by their manifest, reported by path and reason, and skipped:
resume falls back to the newest checkpoint that verifies (and ends bit-exact with the reference),
or stops with exit 1 and no traceback when none does. Each case damages a copy of the reference
run's final checkpoint (step_12; step_8 is the intact older one)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from faults.campaign import assert_no_traceback, assert_same_run, grpoctl, sample

from grpo_sdk.trainer.checkpoint import verify

pytestmark = [pytest.mark.faults, pytest.mark.slow]


def flip_byte(path: Path, offset: int = -100) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def edit_state(path: Path) -> None:  # valid JSON, plausible values, one counter changed
    state = json.loads(path.read_text())
    state["next_group_id"] += 4
    path.write_text(json.dumps(state))


DAMAGE = {
    "flipped byte in the weights": lambda c: flip_byte(c / "policy" / "model.safetensors"),
    "flipped byte in the optimizer": lambda c: flip_byte(c / "policy" / "optimizer.safetensors"),
    "truncated weights": lambda c: truncate(c / "policy" / "model.safetensors"),
    "missing optimizer state": lambda c: (c / "policy" / "optimizer.safetensors").unlink(),
    "missing optimizer metadata": lambda c: (c / "policy" / "optimizer.json").unlink(),
    "missing generation state": lambda c: shutil.rmtree(c / "generation"),
    "missing RNG state": lambda c: (c / "rng.safetensors").unlink(),
    "missing tokenizer": lambda c: (c / "policy" / "tokenizer.json").unlink(),
    "garbage training state": lambda c: (c / "training_state.json").write_bytes(b"\x00\xffnot json"),
    "edited training state": lambda c: edit_state(c / "training_state.json"),
    "empty training state": lambda c: (c / "training_state.json").write_text(""),
    "missing training state": lambda c: (c / "training_state.json").unlink(),
    "missing manifest": lambda c: (c / "manifest.json").unlink(),
    "garbage manifest": lambda c: (c / "manifest.json").write_text("[1, 2"),
    "edited manifest": lambda c: (c / "manifest.json").write_text(json.dumps({"format": 1, "files": {}})),
    "weights replaced by a directory": lambda c: ((c / "policy" / "model.safetensors").unlink(),
                                                  (c / "policy" / "model.safetensors").mkdir()),
}


def damaged_copy(reference: Path, tmp_path: Path, *names: str, steps=("step_12",)) -> Path:
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    for step in steps:
        for name in names:
            DAMAGE[name](run / "checkpoints" / step)
    return run


@pytest.mark.parametrize("damage", sample(sorted(DAMAGE), ci=6))
def test_a_damaged_checkpoint_is_reported_and_resume_falls_back(tmp_path, reference, damage):
    run = damaged_copy(reference, tmp_path, damage)
    assert verify(run / "checkpoints" / "step_12") is not None
    result = grpoctl("run", "--resume", "run", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert_no_traceback(result.stderr)
    assert "step_12 is not usable" in result.stderr and "resuming from" in result.stderr
    assert "resumed from step 8" in result.stdout
    assert_same_run(run, reference)  # steps 9-12 replayed: the same metrics and weights


@pytest.mark.parametrize("damage", sample(sorted(DAMAGE), ci=2, seed=1))
def test_when_no_checkpoint_verifies_resume_stops_with_exit_1_naming_each(tmp_path, reference, damage):
    run = damaged_copy(reference, tmp_path, damage, steps=("step_8", "step_12"))
    before = (run / "metrics.jsonl").read_bytes()
    result = grpoctl("run", "--resume", "run", cwd=tmp_path)
    assert result.returncode == 1
    assert_no_traceback(result.stderr)
    assert "no checkpoint of this run verifies" in result.stderr
    assert "step_12" in result.stderr and "step_8" in result.stderr
    assert (run / "metrics.jsonl").read_bytes() == before  # nothing was rewritten


def test_resuming_a_finished_run_is_a_no_op(tmp_path, reference):
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    before = {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file()}
    result = grpoctl("run", "--resume", "run", cwd=tmp_path)
    assert result.returncode == 0 and "already finished" in result.stdout
    assert_no_traceback(result.stderr)
    after = {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file() and p.name != ".lock"}
    assert after == {p: t for p, t in before.items() if p.name != ".lock"}  # no metrics line, no re-save
