"""User code that misbehaves: an environment that hangs (in Python, or inside C holding the GIL),
returns a reward that is text or a metric that is not a number, or fails on most samples; a `-p`
module that is missing, broken, or would shadow an installed package. Each stops the run with a
clear error and its documented exit code (or, for a masked failure, trains on), never a hang."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from faults.campaign import assert_no_traceback, env, grpoctl

pytestmark = [pytest.mark.faults, pytest.mark.slow]

SHORT = ["grpo.max_num_steps=3", "grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4",
         "cluster.call_timeout_s=2", "grpo.val_period=0", "grpo.val_at_end=false"]


def run_env(tmp_path, env: str, *extra: str, timeout: float = 120):
    started = time.monotonic()
    result = grpoctl("run", "--run-dir", "run", "-p", "fault_envs", f"env.name={env}", *SHORT, *extra, cwd=tmp_path,
                     timeout=timeout)
    return result, time.monotonic() - started


def test_an_environment_stuck_in_python_stops_the_run_naming_the_sample(tmp_path):
    result, seconds = run_env(tmp_path, "stuck")
    assert result.returncode == 1
    assert_no_traceback(result.stderr)
    assert "did not return a reward for sample 0" in result.stderr and "prompt '" in result.stderr
    assert "cluster.call_timeout_s" in result.stderr
    assert seconds < 60  # two deadlines (the batch, then the sample alone) plus start-up


def test_an_environment_stuck_in_c_holding_the_gil_is_stopped_by_the_backstop(tmp_path):
    """No Python code can run while the regex engine holds the GIL: faulthandler's C watchdog exits
    with code 1 at twice the deadline (+5 s), printing where every thread is."""
    result, seconds = run_env(tmp_path, "regex_hang")
    assert result.returncode == 1
    assert "Timeout (" in result.stderr and "fault_envs.py" in result.stderr and " in step" in result.stderr
    assert seconds < 60


@pytest.mark.parametrize("env, message", [
    ("text_reward", "reward 'correct_digits' is 'high', not a finite number"),
    ("text_metric", "returned metric 'quality' = 'high', which is not a number"),
    ("always_fails", "failed on sample 0"),
])
def test_bad_environment_output_is_a_clear_error(tmp_path, env, message):
    result, _ = run_env(tmp_path, env)
    assert result.returncode == 1, result.stderr[-2000:]
    assert_no_traceback(result.stderr)
    assert message in result.stderr


def test_a_masked_bad_reward_trains_on(tmp_path):
    result, _ = run_env(tmp_path, "text_reward", "env.on_reward_error=mask")
    assert result.returncode == 0, result.stderr[-2000:]


def test_a_reward_of_none_is_no_reward_not_a_failure(tmp_path):
    """None means "no reward" (EnvironmentReturn): the sample is masked and counted, even with on_reward_error=raise."""
    result, _ = run_env(tmp_path, "none_reward")
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["reward/num_no_reward"], r["reward/num_failed"]) for r in rows] == [(1.0, 0.0)] * 3


@pytest.mark.parametrize("env, message", [
    ("always_fails", "every one of the 16 samples of step 1 failed"),
    ("mostly_fails", "more than env.max_failed_fraction=0.5"),
])
def test_a_run_whose_rewards_keep_failing_stops(tmp_path, env, message):
    result, _ = run_env(tmp_path, env, "env.on_reward_error=mask")
    assert result.returncode == 1
    assert_no_traceback(result.stderr)
    assert message in result.stderr
    assert "step 3/" not in result.stdout


def test_the_failure_fraction_is_configurable(tmp_path):
    result, _ = run_env(tmp_path, "mostly_fails", "env.on_reward_error=mask", "env.max_failed_fraction=0.9")
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.parametrize("module, source", [("nosuchmodule", None), ("broken_hooks", "def oops(:\n"),
                                            ("raising_hooks", "raise RuntimeError('boom at import')\n")])
def test_a_plugin_module_that_cannot_be_imported_is_exit_3(tmp_path, module, source):
    if source is not None:
        (tmp_path / f"{module}.py").write_text(source)
    result = grpoctl("run", "--run-dir", "run", "-p", module, *SHORT, cwd=tmp_path)
    assert result.returncode == 3
    assert_no_traceback(result.stderr)
    assert f"-p {module}: the hook plugin module could not be imported" in result.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_plugin_module_in_the_current_directory_does_not_shadow_installed_packages(tmp_path):
    (tmp_path / "tokenizers.py").write_text("raise SystemExit('the local tokenizers.py ran')\n")
    (tmp_path / "my_hooks.py").write_text(
        "from grpo_sdk.plugins import hookimpl\n\n@hookimpl\ndef grpo_run_end(status):\n    print('my_hooks saw', status)\n")
    # The installed `grpoctl` script, as users run it (`python -m` would put the cwd first by itself).
    script = str(Path(sys.executable).parent / "grpoctl")
    result = subprocess.run([script, "run", "--run-dir", "run", "-p", "my_hooks", *SHORT], cwd=tmp_path, env=env(),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "the local tokenizers.py ran" not in result.stderr + result.stdout
    assert "my_hooks saw completed" in result.stdout
