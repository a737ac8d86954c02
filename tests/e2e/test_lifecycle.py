"""The life of a run: validation, atomic checkpoints and top-k, exact resume after SIGKILL,
Ctrl-C, the save-by deadline, early stop, export and training-data dumps."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

from grpo_sdk.trainer.checkpoint import STATUS_FILE, CheckpointManager
from grpo_sdk.config.schema import CheckpointingConfig
from helpers import grpoctl_env, run_and_kill_after, run_grpoctl
from faults.campaign import final_weights, metrics_of

# A small run: 4 prompts x 8 generations, validation every 8 steps, a checkpoint every 4.
SMALL = ["grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=8", "grpo.val_period=8",
         "grpo.max_val_samples=8", "grpo.val_num_generations_per_prompt=2", "checkpointing.save_period=4",
         "checkpointing.keep_top_k=2"]


@pytest.mark.slow
def test_resume_after_sigkill_is_exact(tmp_path):
    """Killed at three arbitrary points (mid-run, right after a checkpoint step, right before the
    end) and resumed each time: the same per-step metrics and bit-identical final weights."""
    args = ["run", "--run-dir", "run", "grpo.max_num_steps=22", *SMALL]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    reference = run_grpoctl(*args, cwd=tmp_path / "a")
    assert reference.returncode == 0, reference.stderr[-3000:]

    run_and_kill_after(args, tmp_path / "b", step=6)
    for kill_at in (8, 21):
        run_and_kill_after(["run", "--resume", "run"], tmp_path / "b", step=kill_at)
    resumed = run_grpoctl("run", "--resume", "run", cwd=tmp_path / "b")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from step" in resumed.stdout

    a, b = tmp_path / "a" / "run", tmp_path / "b" / "run"
    assert metrics_of(b) == metrics_of(a)
    assert [r["step"] for r in metrics_of(a)] == list(range(1, 23))
    assert final_weights(b) == final_weights(a)
    assert "val/accuracy" in metrics_of(a)[7] and "val/pass_k" in metrics_of(a)[7]  # validated at step 8


def killed_after_a_checkpoint_and_resumed(tmp_path, *overrides: str):
    """An uninterrupted run and the same run SIGKILLed at step 6 (after the step-4 checkpoint) then
    resumed: their run directories, both finished."""
    args = ["run", "--run-dir", "run", *overrides, *SMALL]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    reference = run_grpoctl(*args, cwd=tmp_path / "a")
    assert reference.returncode == 0, reference.stderr[-3000:]
    run_and_kill_after(args, tmp_path / "b", step=6)
    resumed = run_grpoctl("run", "--resume", "run", cwd=tmp_path / "b")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from step 4" in resumed.stdout
    return tmp_path / "a" / "run", tmp_path / "b" / "run"


@pytest.mark.slow
def test_bfloat16_moments_resume_after_sigkill_is_exact(tmp_path):
    """policy.optimizer.moments_dtype=bfloat16: the moments are saved in bfloat16 and the rounding
    noise comes from (seed, step), so a run killed after a checkpoint resumes into the same run."""
    from safetensors import safe_open

    a, b = killed_after_a_checkpoint_and_resumed(tmp_path, "grpo.max_num_steps=8",
                                                 "policy.optimizer.moments_dtype=bfloat16")
    assert metrics_of(b) == metrics_of(a)
    assert final_weights(b) == final_weights(a)
    saved = CheckpointManager(CheckpointingConfig(), a).latest() / "policy" / "optimizer.safetensors"
    with safe_open(str(saved), "pt") as f:
        dtypes = {f.get_slice(key).get_dtype() for key in f.keys() if "exp_avg" in key}
    assert dtypes == {"BF16"}


@pytest.mark.slow
def test_lora_resume_after_sigkill_is_exact(tmp_path):
    """policy.lora: the checkpoint holds the adapters and their optimizer state only (the base is the
    model's own files); killed after a checkpoint and resumed, the run is the uninterrupted one."""
    pytest.importorskip("peft")
    a, b = killed_after_a_checkpoint_and_resumed(tmp_path, "grpo.max_num_steps=10", "policy.lora.enabled=true",
                                                 "loss_fn.reference_policy_kl_penalty=0.01")
    assert metrics_of(b) == metrics_of(a)
    adapters = [CheckpointManager(CheckpointingConfig(), run).latest() / "policy" / "adapter_model.safetensors"
                for run in (a, b)]
    assert adapters[0].read_bytes() == adapters[1].read_bytes()
    assert metrics_of(a)[-1]["kl_penalty"] > 0  # the adapters trained


def test_ctrl_c_saves_a_checkpoint_exits_130_and_resumes(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "grpo_sdk.cli.entry", "run", "--run-dir", "run",
                             "grpo.max_num_steps=1000", *SMALL], cwd=tmp_path, env=grpoctl_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:
            if line.startswith("step 1/"):
                proc.send_signal(signal.SIGINT)
                break
        _, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr[-2000:]
    run = tmp_path / "run"
    latest = CheckpointManager(CheckpointingConfig(), run).latest()
    assert latest is not None and int(latest.name.split("_")[1]) >= 1
    status = json.loads((run / "checkpoints" / STATUS_FILE).read_text())
    assert status["last_checkpoint_step"] == int(latest.name.split("_")[1])
    resumed = run_grpoctl("run", "--resume", "run", "grpo.max_num_steps=5", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert [r["step"] for r in metrics_of(run)] == [1, 2, 3, 4, 5]


def test_deadline_saves_and_exits_cleanly(tmp_path):
    result = run_grpoctl("run", "--run-dir", "run", "grpo.max_num_steps=100000", "checkpointing.checkpoint_must_save_by=00:00:04",
                         *SMALL, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "checkpoint_must_save_by" in result.stdout
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "deadline" and 0 < summary["steps"] < 100000
    assert CheckpointManager(CheckpointingConfig(), tmp_path / "run").latest().name == f"step_{summary['steps']}"


def test_early_stop_on_a_validation_metric(tmp_path):
    result = run_grpoctl("run", "--run-dir", "run", "grpo.max_num_steps=50", "grpo.stop_at_validation_metric=accuracy",
                         "grpo.stop_at_validation_threshold=0.0", *SMALL, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "early_stop" and summary["steps"] == 8  # the first validation
    assert "early stop" in result.stdout


def test_validation_does_not_perturb_training(tmp_path):
    runs = {}
    for val_period in (0, 2):
        cwd = tmp_path / f"v{val_period}"
        cwd.mkdir()
        result = run_grpoctl("run", "--run-dir", "run", "grpo.max_num_steps=4", *SMALL, f"grpo.val_period={val_period}",
                             "checkpointing.enabled=false", cwd=cwd)
        assert result.returncode == 0, result.stderr[-2000:]
        runs[val_period] = [{k: v for k, v in r.items() if not k.startswith("val/")} for r in metrics_of(cwd / "run")]
    assert runs[0] == runs[2]


def test_export_and_train_data_dumps(tmp_path):
    result = run_grpoctl("run", "--run-dir", "run", "grpo.max_num_steps=4", "logger.dump_train_data=true", *SMALL, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    dump = [json.loads(line) for line in (tmp_path / "run" / "train_data" / "step_3.jsonl").read_text().splitlines()]
    assert len(dump) == 32
    row = dump[0]
    assert {"content", "rewards", "token_ids", "token_loss_mask", "sample_loss_mask", "advantages",
            "generation_logprobs", "prev_logprobs", "input_lengths"} <= set(row)
    assert len(row["token_ids"]) == len(row["token_loss_mask"]) == len(row["advantages"]) == row["input_lengths"]

    exported = run_grpoctl("export", "run", "model", cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "model")
    assert model.config.model_type == "gpt2" and tokenizer.eos_token == "<eos>"
    assert not list((tmp_path / "model").glob("optimizer*"))
    again = run_grpoctl("export", "run", "model", cwd=tmp_path)
    assert again.returncode == 2 and "already exists" in again.stderr


def test_checkpoint_manager_keeps_top_k_and_the_latest(tmp_path):
    manager = CheckpointManager(CheckpointingConfig(keep_top_k=2, metric_name="val:accuracy"), tmp_path)
    for step, accuracy in [(1, 0.5), (2, 0.9), (3, 0.1), (4, 0.7), (5, None)]:
        manager.save(step, lambda d: (d / "weights").write_text("w"), {"step": step, "ranking_metric": accuracy})
    assert [p.name for p in manager.checkpoints()] == ["step_2", "step_4", "step_5"]  # best two + latest
    assert manager.best().name == "step_2"
    assert json.loads((tmp_path / "checkpoints" / STATUS_FILE).read_text())["last_checkpoint_step"] == 5


def test_partial_checkpoints_are_never_listed_and_are_cleaned(tmp_path):
    manager = CheckpointManager(CheckpointingConfig(), tmp_path)
    manager.save(1, lambda d: None, {"step": 1})
    half = tmp_path / "checkpoints" / ".step_2.partial"
    half.mkdir()
    (half / "policy").mkdir()
    assert [p.name for p in manager.checkpoints()] == ["step_1"]
    manager.remove_partial()
    assert not half.exists()
