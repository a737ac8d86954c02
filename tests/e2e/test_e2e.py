"""`grpoctl run` end to end, as a newcomer runs it: the built-in recipe learns, and the run
directory holds everything needed to reproduce and reuse the run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from helpers import grpoctl_env, run_grpoctl


@pytest.mark.slow
def test_builtin_recipe_learns_to_reverse_digits(tmp_path):
    """The default `grpoctl run` (500 steps, ~20 s on a quiet 2-core machine) must take the
    reward from the random-init level (~0.03) to at least 0.8."""
    result = run_grpoctl("run", "--run-dir", "run", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "run"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 501))
    first = sum(r["reward/mean"] for r in rows[:10]) / 10
    last = sum(r["reward/mean"] for r in rows[-20:]) / 20
    assert first < 0.15, f"random-init reward should be low, got {first:.3f}"
    assert last >= 0.8, f"the built-in recipe should learn: reward {first:.3f} -> {last:.3f}"
    assert all(0.9 < r["token_mult_prob_error"] < 1.1 for r in rows), "generation and policy logprobs disagree"

    # plain lines without a terminal, and a summary at the end
    assert "step 1/500" in result.stdout and "step 500/500" in result.stdout
    assert "reward " in result.stdout and "run dir: run" in result.stdout

    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 500 and summary["reward_last"] >= 0.8

    # the resolved config reproduces the run's config exactly
    resolved = yaml.safe_load((run / "config.resolved.yaml").read_text())
    again = run_grpoctl("config", "show", "-c", str(run / "config.resolved.yaml"), cwd=tmp_path)
    assert again.returncode == 0 and yaml.safe_load(again.stdout) == resolved

    plugins = json.loads((run / "plugins.json").read_text())
    assert {(c["kind"], c["name"], c["dist"]) for c in plugins["components"]} >= {
        ("generation", "hf", "grpo-sdk"), ("policy", "hf", "grpo-sdk"), ("estimator", "grpo", "grpo-sdk")}

    # the final checkpoint is a Hugging Face model directory
    from transformers import AutoModelForCausalLM, AutoTokenizer

    checkpoint = run / "checkpoints" / "step_500" / "policy"
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    assert model.config.n_layer == 2 and tokenizer("12345>").input_ids[0] == tokenizer.bos_token_id
    assert not list((run / "checkpoints").glob(".*partial"))


def test_short_run_with_progress_bar_and_overrides(tmp_path):
    result = run_grpoctl("run", "--run-dir", "run", "--progress", "grpo.max_num_steps=3",
                         "grpo.num_prompts_per_step=4", "env.reverse_digits.num_digits=3", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "reward" in result.stdout and "tok/s" in result.stdout
    rows = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 3
    assert yaml.safe_load((tmp_path / "run" / "config.resolved.yaml").read_text())["env"]["reverse_digits"] == {
        "num_digits": 3, "format_weight": 0.0}


def test_refuses_to_overwrite_a_run_directory(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("{}\n")
    result = run_grpoctl("run", "--run-dir", "run", cwd=tmp_path)
    assert result.returncode == 2
    assert "already holds a run" in result.stderr


def test_a_hook_module_from_the_current_directory_observes_the_run(tmp_path):
    (tmp_path / "my_observer.py").write_text(
        "from grpo_sdk.plugins import hookimpl\n\n"
        "@hookimpl\n"
        "def grpo_step_end(step, metrics):\n"
        "    print(f'observed step {step} reward {metrics[\"reward/mean\"]:.3f}')\n\n"
        "@hookimpl\n"
        "def grpo_run_end(status):\n"
        "    print(f'observed end: {status}')\n")
    result = run_grpoctl("run", "--run-dir", "run", "-p", "my_observer", "grpo.max_num_steps=2",
                         "grpo.num_prompts_per_step=2", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "observed step 1 reward" in result.stdout and "observed step 2 reward" in result.stdout
    assert "observed end: completed" in result.stdout


def test_ctrl_c_exits_130(tmp_path):
    import signal

    proc = subprocess.Popen([sys.executable, "-m", "grpo_sdk.cli.entry", "run", "--run-dir", "run",
                             "grpo.max_num_steps=100000"], cwd=tmp_path, env=grpoctl_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:
            if line.startswith("step 1/"):
                break
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr[-2000:]
    assert "interrupted" in stderr
    assert (tmp_path / "run" / "metrics.jsonl").read_text().count("\n") >= 1  # what was logged is kept
