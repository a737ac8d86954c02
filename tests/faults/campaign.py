"""The fault campaign's shared pieces: a small real run, the reference it must reproduce (the
``reference`` fixture, exported by tests/faults/conftest.py), and the campaign size.

Every case runs the real `grpoctl` in a subprocess (the faults are process deaths, signals and
OS errors, which only a real process shows). CI runs a fixed, bounded sample of each family;
``GRPO_SDK_FAULTS=full pytest tests/faults`` runs the whole campaign (see docs/reliability.md).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from grpo_sdk.trainer.checkpoint import CheckpointManager
from grpo_sdk.config.schema import CheckpointingConfig
from helpers import grpoctl_env, run_grpoctl

HERE = Path(__file__).parent
FULL = os.environ.get("GRPO_SDK_FAULTS") == "full"

# 12 steps of the built-in recipe, 4 prompts x 8 generations: a checkpoint every 4 steps with
# top-2 pruning ranked by step (so step_8 and step_12 stay whatever the sampled validation accuracy:
# the tests damage them by name), validation every 4 steps. About 4 s a run on one thread.
SMALL = ["grpo.max_num_steps=12", "grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=8",
         "grpo.val_period=4", "grpo.max_val_samples=8", "grpo.val_num_generations_per_prompt=2",
         "checkpointing.save_period=4", "checkpointing.keep_top_k=2", "checkpointing.metric_name=null"]
VOLATILE = ("timing/", "perf/")  # wall-clock metrics differ between runs by nature


def sample(cases: list, ci: int, seed: int = 0) -> list:
    """All cases under GRPO_SDK_FAULTS=full, else a fixed sample of ``ci`` of them."""
    return cases if FULL or len(cases) <= ci else random.Random(seed).sample(cases, ci)


def env(**extra: str) -> dict[str, str]:
    """grpoctl's environment in the campaign: tests/faults on the path, for ``-p fault_inject``."""
    # No empty entry: an empty PYTHONPATH component means "the current directory".
    path = os.pathsep.join(p for p in [str(HERE), os.environ.get("PYTHONPATH", "")] if p)
    return grpoctl_env(**{"PYTHONPATH": path, **extra})


def grpoctl(*args: str, cwd: Path, timeout: float = 300, **extra: str) -> subprocess.CompletedProcess:
    return run_grpoctl(*args, cwd=cwd, timeout=timeout, env=env(**extra))


def start(*args: str, cwd: Path, **extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "grpo_sdk.cli.entry", *args], cwd=cwd, env=env(**extra),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_line(proc: subprocess.Popen, prefix: str, timeout: float = 120) -> bool:
    """Read stdout until a line starts with ``prefix`` (True) or the process ends (False)."""
    deadline = time.monotonic() + timeout
    for line in proc.stdout:
        if line.startswith(prefix):
            return True
        if time.monotonic() > deadline:
            break
    return False


def finish(proc: subprocess.Popen, timeout: float = 120) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"grpoctl did not end within {timeout} s: {err[-2000:]}")
    return proc.returncode, out, err


def metrics_of(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]


def final_weights(run: Path) -> bytes:
    latest = CheckpointManager(CheckpointingConfig(), run).latest()
    return (latest / "policy" / "model.safetensors").read_bytes()


def assert_no_traceback(result_stderr: str) -> None:
    assert "Traceback" not in result_stderr, result_stderr[-3000:]


def assert_same_run(run: Path, reference: Path) -> None:
    """Resumed bit-exact: every step logged once, in order, with the reference's metrics and weights."""
    got, want = metrics_of(run), metrics_of(reference)
    assert [r["step"] for r in got] == [r["step"] for r in want], "a step was lost or logged twice"
    assert got == want
    assert final_weights(run) == final_weights(reference)


@pytest.fixture(scope="session")
def reference(tmp_path_factory) -> Path:
    """The uninterrupted run every faulted run must reproduce."""
    cwd = tmp_path_factory.mktemp("reference")
    result = grpoctl("run", "--run-dir", "run", *SMALL, cwd=cwd)
    assert result.returncode == 0, result.stderr[-3000:]
    return cwd / "run"


def resume_until_done(cwd: Path, args: list[str], attempts: int = 4) -> subprocess.CompletedProcess:
    """Resume (or, before a config exists, restart) until the run completes."""
    for _ in range(attempts):
        has_config = (cwd / "run" / "config.resolved.yaml").is_file()
        result = grpoctl("run", "--resume", "run", cwd=cwd) if has_config else grpoctl(*args, cwd=cwd)
        assert_no_traceback(result.stderr)
        if result.returncode == 0:
            return result
        assert result.returncode == -signal.SIGKILL, result.stderr[-3000:]
    pytest.fail("the run did not complete")
