"""`grpoctl run` never surprises (issue 14 item 5): an epoch limit is said at the start and in the
summary; a run directory with checkpoints resumes with its saved config and refuses a changed one,
showing the difference; --max-steps; --dry-run builds and writes nothing. Real CLI, real runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import run_grpoctl

QUICK = ["grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4", "grpo.val_period=0",
         "grpo.val_at_end=false", "checkpointing.save_period=2"]


def _prompts(path: Path, rows: int) -> Path:
    path.write_text("".join(json.dumps({"prompt": f"{i:05d}>", "target": f"{i:05d}"[::-1]}) + "\n"
                            for i in range(rows)))
    return path


def _reward_module(tmp_path: Path) -> None:
    (tmp_path / "digit_rewards.py").write_text(
        "def match(prompts, completions, target, **kw):\n"
        "    return [sum(a == b for a, b in zip(c, t)) / len(t) for c, t in zip(completions, target)]\n")


def test_an_epoch_limit_is_said_at_the_start_and_in_the_summary(tmp_path):
    _reward_module(tmp_path)
    data = _prompts(tmp_path / "train.jsonl", 10)
    result = run_grpoctl("run", *QUICK, f"data.train_path={data}", "env.name=reward_functions",
                         "env.reward_functions.functions=[digit_rewards:match]", "grpo.max_num_steps=30",
                         "--run-dir", "run", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    # 10 prompts, 4 a step: the pass completes during step 3
    assert ("note: the dataset has 10 prompts: 1 epoch(s) at 4 prompts per step end the run after step 3, "
            "not the 30 of grpo.max_num_steps; grpo.max_num_epochs=12 trains them all") in result.stdout
    assert "in 3 steps" in result.stdout and "grpo.max_num_epochs=1: the dataset's epochs ran out" in result.stdout
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["ended_by"] == "grpo.max_num_epochs"


@pytest.mark.slow
def test_a_run_dir_with_checkpoints_resumes_its_saved_config_and_refuses_changes(tmp_path):
    first = run_grpoctl("run", *QUICK, "grpo.max_num_steps=2", "env.reverse_digits.num_digits=4",
                        "--run-dir", "run", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    # The task of the saved run (4 digits) is kept, though the built-in recipe says 5: no override, no change.
    same = run_grpoctl("run", "--run-dir", "run", "--max-steps", "4", cwd=tmp_path)
    assert same.returncode == 0, same.stderr[-2000:]
    assert "resumed from step 2" in same.stdout and "in 4 steps" in same.stdout
    assert "num_digits: 4" in (tmp_path / "run" / "config.resolved.yaml").read_text()
    for how in (["--run-dir", "run"], ["--resume", "run"]):
        changed = run_grpoctl("run", *how, "env.reverse_digits.num_digits=8", "policy.optimizer.lr=0.01",
                              "--max-steps", "6", cwd=tmp_path)
        assert changed.returncode == 2, changed.stdout
        assert "env.reverse_digits.num_digits: 4 (saved) -> 8" in changed.stderr
        assert "policy.optimizer.lr: 0.001 (saved) -> 0.01" in changed.stderr
        assert "grpo.max_num_steps" not in changed.stderr.split("would change it:")[1].split("A resume")[0]
        assert "Traceback" not in changed.stderr
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 4  # nothing ran


def test_dry_run_prints_the_plan_and_writes_nothing(tmp_path):
    result = run_grpoctl("run", "--dry-run", "--max-steps", "7", "--run-dir", "run", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "dry run: nothing is built or written" in result.stdout
    assert "7 steps requested" in result.stdout and "parameters" in result.stdout and "memory" in result.stdout
    assert not (tmp_path / "run").exists() and not (tmp_path / "runs").exists()
    bad = run_grpoctl("run", "--dry-run", "data.train_path=missing.jsonl", cwd=tmp_path)
    assert bad.returncode == 2 and "missing.jsonl" in bad.stderr and "Traceback" not in bad.stderr


def test_max_steps_must_be_positive(tmp_path):
    result = run_grpoctl("run", "--max-steps", "0", cwd=tmp_path)
    assert result.returncode == 2 and "--max-steps" in result.stderr
