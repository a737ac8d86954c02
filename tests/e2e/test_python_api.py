"""The Python API (``grpo_sdk.train``, ``load_config``, ``Trainer``; grpo_sdk/api.py): the same run as
`grpoctl run`, typed errors instead of exits, nothing printed a notebook did not ask for, the same
resume rules, and a stop signal that ends in a summary rather than a dead kernel."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import grpo_sdk
from helpers import run_grpoctl

STEPS = 12
# Keys that measure the machine, not the run: they differ between any two runs.
MACHINE_KEYS = ("timing/", "perf/")


def _history(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [{k: v for k, v in row.items() if not k.startswith(MACHINE_KEYS) and k != "time"} for row in rows]


def _weights(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    step = max((run_dir / "checkpoints").glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
    return load_file(str(step / "policy" / "model.safetensors"))


def test_import_grpo_sdk_exposes_the_api_without_torch():
    code = ("import sys, grpo_sdk; names = [grpo_sdk.train, grpo_sdk.load_config, grpo_sdk.Trainer, "
            "grpo_sdk.RunSummary, grpo_sdk.ConfigError, grpo_sdk.export_model]; "
            "print(sorted(m for m in ('torch', 'transformers', 'ray') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    assert set(grpo_sdk.__all__) <= set(dir(grpo_sdk))


@pytest.mark.slow
def test_python_api_trains_the_same_run_as_grpoctl_run(tmp_path):
    """Same recipe, same seed: the same metrics at every step and bit-identical final weights."""
    overrides = [f"grpo.max_num_steps={STEPS}", "grpo.val_period=6", "checkpointing.save_period=6"]
    cli = run_grpoctl("run", *overrides, "--run-dir", tmp_path / "cli", cwd=tmp_path)
    assert cli.returncode == 0, cli.stderr
    summary = grpo_sdk.train(overrides=overrides, run_dir=tmp_path / "api")
    assert summary.status == "completed" and summary.steps == STEPS
    assert _history(tmp_path / "api") == _history(tmp_path / "cli")
    cli_weights, api_weights = _weights(tmp_path / "cli"), _weights(tmp_path / "api")
    assert all((cli_weights[k] == api_weights[k]).all() for k in cli_weights)
    # The summary carries the last step's metrics and the validation, as summary.json does.
    last = _history(tmp_path / "api")[-1]
    assert summary.metrics["reward/mean"] == last["reward/mean"]
    assert summary.validation["accuracy"] == last["val/accuracy"]
    assert json.loads((tmp_path / "api" / "summary.json").read_text())["metrics"]["reward/mean"] == last["reward/mean"]
    out = grpo_sdk.export_model(tmp_path / "api", tmp_path / "model")
    assert out == summary.checkpoint / "policy" and (tmp_path / "model" / "config.json").is_file()


def test_the_api_prints_nothing_a_notebook_did_not_ask_for(tmp_path, capfd):
    summary = grpo_sdk.train(overrides=["grpo.max_num_steps=2", "grpo.val_period=0", "grpo.val_at_end=false"],
                             run_dir=tmp_path / "run")
    out, err = capfd.readouterr()
    assert summary.status == "completed"
    assert out == ""
    assert "%|" not in err and "it/s" not in err, err  # no tqdm bar (transformers writes shards with one)


def test_progress_true_prints_one_line_per_step_and_on_step_sees_every_step(tmp_path, capsys):
    seen = []
    grpo_sdk.train(overrides=["grpo.max_num_steps=3", "grpo.val_period=0", "grpo.val_at_end=false"],
                   run_dir=tmp_path / "run", progress=True, on_step=lambda step, m: seen.append(step))
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert seen == [1, 2, 3] and len(lines) == 3 and lines[-1].startswith("step 3/3")


def test_errors_are_raised_as_typed_exceptions_not_exits(tmp_path):
    with pytest.raises(grpo_sdk.ConfigError, match="grpo.num_prompts_per_stepp"):
        grpo_sdk.load_config(overrides=["grpo.num_prompts_per_stepp=3"])
    with pytest.raises(grpo_sdk.ConfigError, match="config file not found"):
        grpo_sdk.load_config(tmp_path / "missing.yaml")
    with pytest.raises(grpo_sdk.DataError, match="no such file or directory"):
        grpo_sdk.train(overrides=["data.train_path=" + str(tmp_path / "none.jsonl"), "grpo.max_num_steps=1"],
                       run_dir=tmp_path / "run")
    with pytest.raises(grpo_sdk.ConfigError, match="give overrides"):
        grpo_sdk.Trainer(grpo_sdk.load_config(), overrides=["grpo.seed=2"])


def test_load_config_is_structured_and_a_trainer_resumes_its_run_dir(tmp_path):
    config = grpo_sdk.load_config(overrides=["grpo.max_num_steps=2", "grpo.val_period=0", "grpo.val_at_end=false",
                                             "checkpointing.save_period=1"])
    assert isinstance(config, grpo_sdk.MasterConfig) and config.grpo.max_num_steps == 2
    first = grpo_sdk.Trainer(config, run_dir=tmp_path / "run").train()
    assert first.steps == 2
    again = grpo_sdk.Trainer(config, run_dir=tmp_path / "run").train()
    assert again.status == "already_finished" and again.steps == 2
    longer = grpo_sdk.load_config(overrides=["grpo.max_num_steps=4", "grpo.val_period=0", "grpo.val_at_end=false",
                                             "checkpointing.save_period=1"])
    resumed = grpo_sdk.Trainer(longer, run_dir=tmp_path / "run").train()
    assert resumed.status == "completed" and resumed.steps == 4
    assert len(_history(tmp_path / "run")) == 4
    other_task = grpo_sdk.load_config(overrides=["grpo.max_num_steps=6", "env.reverse_digits.num_digits=8"])
    with pytest.raises(grpo_sdk.ConfigError, match=r"env.reverse_digits.num_digits: 5 \(saved\) -> 8"):
        grpo_sdk.Trainer(other_task, run_dir=tmp_path / "run")


def test_a_stop_signal_during_api_training_saves_and_returns_an_interrupted_summary(tmp_path):
    def interrupt(step: int, metrics: dict) -> None:
        if step == 2:
            os.kill(os.getpid(), signal.SIGINT)  # what a notebook's interrupt button sends

    before = signal.getsignal(signal.SIGINT)
    summary = grpo_sdk.train(overrides=["grpo.max_num_steps=50", "grpo.val_period=0", "grpo.val_at_end=false",
                                        "checkpointing.save_period=100"], run_dir=tmp_path / "run", on_step=interrupt)
    assert summary.status == "interrupted" and summary.reason == "SIGINT" and summary.steps == 2
    assert summary.checkpoint is not None and summary.checkpoint.name == "step_2"
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "interrupted"
    assert signal.getsignal(signal.SIGINT) is before  # the caller's handler is back


def test_reward_funcs_take_a_local_function_and_a_cli_resume_of_it_says_what_to_do(tmp_path, caplog):
    rows = "".join(json.dumps({"prompt": f"{i:05d}>", "target": f"{i:05d}"[::-1]}) + "\n" for i in range(64))
    (tmp_path / "train.jsonl").write_text(rows)
    calls = []

    def digits_match(prompts, completions, target):  # defined here: importable by no module path
        calls.append(len(completions))
        return [sum(a == b for a, b in zip(c, t)) / len(t) for c, t in zip(completions, target)]

    with caplog.at_level("WARNING", logger="grpo_sdk"):
        summary = grpo_sdk.train(overrides=[f"data.train_path={tmp_path / 'train.jsonl'}", "grpo.max_num_steps=20",
                                            "grpo.val_period=0", "grpo.val_at_end=false"],
                                 run_dir=tmp_path / "run", reward_funcs=[digits_match])
    # 64 prompts, 8 a step: one epoch is 8 steps, and the API warns that it ends the run early
    assert summary.status == "completed" and summary.steps == 8 and calls == [128] * 8
    assert summary.ended_by == "grpo.max_num_epochs"
    assert any("end the run after step 8, not the 20" in r.getMessage() for r in caplog.records)
    assert "reward/digits_match" in summary.metrics
    saved = (tmp_path / "run" / "config.resolved.yaml").read_text()
    assert "name: reward_functions" in saved and "callable:" in saved
    resumed = run_grpoctl("run", "--resume", tmp_path / "run", "--max-steps", "30", cwd=tmp_path)
    assert resumed.returncode != 0 and "Traceback" not in resumed.stderr
    assert "digits_match" in resumed.stderr and "reward_funcs" in resumed.stderr
