"""benchmarks/real_model.py: grpo-sdk (grpoctl run) next to TRL on the recipe's model, data and reward.

TRL is not installed in the test venv: the end-to-end --quick run (a tiny local model) runs only where
it is (the bench venv, docs/benchmarks.md); here the settings TRL gets from the recipe, the evaluator
and the option errors are checked."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
RECIPE = ROOT / "recipes" / "smollm2-arithmetic.yaml"
HAVE_TRL = importlib.util.find_spec("trl") is not None


def bench(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, str(BENCH / "real_model.py"), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)


@pytest.fixture(scope="module")
def real_model():
    """benchmarks/real_model.py and _common.py as modules, without leaving their process settings behind."""
    import torch

    environ, threads, path = dict(os.environ), torch.get_num_threads(), list(sys.path)
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module("real_model")
    finally:
        os.environ.clear()
        os.environ.update(environ)
        torch.set_num_threads(threads)
        sys.path[:] = path
        sys.modules.pop("real_model", None)
        sys.modules.pop("_common", None)


@pytest.fixture(scope="module")
def tiny_model(real_model, tmp_path_factory):
    return real_model.build_quick_model(tmp_path_factory.mktemp("tiny-chat-model"))


def resolved(real_model, model: Path, *overrides: str):
    import argparse

    args = argparse.Namespace(model=model, recipe=RECIPE, quick=False, grpo_override=list(overrides))
    return real_model.resolve(args, 7, 12)


def test_trl_settings_follow_the_recipe(real_model, tiny_model):
    """TRL's GRPOConfig comes from the resolved recipe: change the recipe, TRL's settings change with it."""
    cfg = resolved(real_model, tiny_model)
    settings, differences = real_model.trl_settings(cfg)
    rows = cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt
    assert settings["num_generations"] == cfg.grpo.num_generations_per_prompt
    assert settings["per_device_train_batch_size"] * settings["gradient_accumulation_steps"] == rows
    assert settings["steps_per_generation"] == settings["gradient_accumulation_steps"]  # one optimizer step
    assert settings["num_iterations"] == 1 and settings["max_steps"] == 12 and settings["seed"] == 7
    assert settings["max_completion_length"] == cfg.policy.generation.max_new_tokens
    assert settings["learning_rate"] == cfg.policy.optimizer.lr
    assert (settings["adam_beta1"], settings["adam_beta2"]) == tuple(cfg.policy.optimizer.betas)
    assert settings["weight_decay"] == cfg.policy.optimizer.weight_decay
    assert settings["max_grad_norm"] == cfg.policy.max_grad_norm
    assert settings["beta"] == cfg.loss_fn.reference_policy_kl_penalty == 0.0
    assert (settings["epsilon"], settings["epsilon_high"]) == (cfg.loss_fn.ratio_clip_min, cfg.loss_fn.ratio_clip_max)
    assert settings["loss_type"] == "dapo" and settings["scale_rewards"] == "group"
    assert settings["bf16"] is True  # the recipe's policy.hf.autocast: bfloat16
    assert any("leave-one-out" in d for d in differences)

    changed = resolved(real_model, tiny_model, "policy.optimizer.lr=3e-6", "loss_fn.ratio_clip_max=0.28",
                       "loss_fn.token_level_loss=false", "~policy.hf.autocast", "policy.generation.top_k=20",
                       "grpo.adv_estimator.grpo.use_leave_one_out_baseline=false", "grpo.num_generations_per_prompt=4")
    settings, differences = real_model.trl_settings(changed)
    assert settings["learning_rate"] == 3e-6 and settings["epsilon_high"] == 0.28 and settings["top_k"] == 20
    assert settings["loss_type"] == "grpo" and settings["bf16"] is False and settings["num_generations"] == 4
    assert not any("leave-one-out" in d for d in differences)


def test_several_optimizer_steps_per_step_map_to_trls_generation_batch(real_model, tiny_model):
    """policy.train_global_batch_size: an optimizer step per that many rows; TRL generates once for them all."""
    cfg = resolved(real_model, tiny_model, "grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=8",
                   "policy.train_micro_batch_size=8", "policy.train_global_batch_size=16")
    settings, _ = real_model.trl_settings(cfg)
    assert (settings["per_device_train_batch_size"], settings["gradient_accumulation_steps"],
            settings["steps_per_generation"]) == (8, 2, 4)


def test_trl_settings_refuse_what_trl_cannot_follow(real_model, tiny_model):
    cfg = resolved(real_model, tiny_model, "policy.train_micro_batch_size=3")
    with pytest.raises(SystemExit, match="micro batch"):
        real_model.trl_settings(cfg)


def test_the_evaluator_scores_the_validation_rows(real_model, tiny_model):
    """The one evaluator: greedy (a sampler would not repeat itself on a random-init model's flat softmax)."""
    cfg = resolved(real_model, tiny_model)
    first = real_model.evaluate(tiny_model, cfg, samples=3, batch_size=2, max_new_tokens=6)
    assert first["samples"] == 3 and 0 <= first["correct"] <= 3 and first["accuracy"] == first["correct"] / 3
    assert 1 <= first["mean_length"] <= 6 and 0 <= first["truncated_fraction"] <= 1
    second = real_model.evaluate(tiny_model, cfg, samples=3, batch_size=2, max_new_tokens=6)
    assert {k: v for k, v in first.items() if k != "seconds"} == {k: v for k, v in second.items() if k != "seconds"}


def test_the_prompts_are_the_recipes(real_model, tiny_model):
    """Both sides see the recipe's template filled from the row, as a user message."""
    cfg = resolved(real_model, tiny_model)
    row = real_model.read_rows(cfg.data.train_path)[0]
    [text] = real_model.prompt_texts(cfg, [row])
    assert text.startswith(row["prompt"]) and "\\boxed{}" in text
    assert real_model.conversation(cfg, text)[-1] == {"role": "user", "content": text}


@pytest.mark.parametrize("args, message", [
    (["--steps", "0", "--quick"], "--steps >= 1"),
    (["--model", "/nonexistent"], "no config.json there"),
    (["--quick", "--grpo-override", "policy.lr"], "--grpo-override takes KEY=VALUE"),
    ([], "--model DIR is required"),
])
def test_bad_options_exit_2_with_the_reason(args, message):
    proc = bench(*args)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


@pytest.mark.skipif(HAVE_TRL, reason="TRL is installed here: the --quick run runs (test below)")
def test_without_trl_says_where_to_run_it():
    proc = bench("--quick")
    assert proc.returncode == 2 and "TRL is not installed" in proc.stderr and "bench venv" in proc.stderr


@pytest.mark.skipif(not HAVE_TRL, reason="TRL is not installed in this venv (the bench venv has it: docs/benchmarks.md)")
def test_quick_runs_both_and_evaluates_what_they_saved():
    proc = bench("--quick", "--json", timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    [round_] = summary["rounds"]
    for name in ("grpo-sdk", "trl"):
        run = round_["contenders"][name]
        assert len(run["step_times"]) >= 2 and all(t > 0 for t in run["step_times"]), name
        assert 100 < run["rss_ready_mb"] <= run["peak_rss_mb"] < 8000, name
        assert run["saved"]["equal_steps"]["step"] == 2, name
        assert run["saved"]["equal_steps"]["eval"]["samples"] == 4, name
        assert 1 <= run["mean_response_length"] <= 8, name
    assert set(round_["contenders"]["grpo-sdk"]["phases_s"]) >= {"rollout", "train", "step"}
    assert set(round_["contenders"]["trl"]["phases_s"]) >= {"generate", "train", "step"}
    fast = round_["contenders"][next(n for n in ("grpo-sdk", "trl") if n != round_["slower"])]
    assert fast["saved"]["equal_wall"]["train_s"] >= round_["contenders"][round_["slower"]]["saved"][
        "equal_steps"]["train_s"] or fast["saved"]["equal_wall"]["step"] == 4  # reached it, or the cap
    assert summary["grpo_over_trl_step"] == pytest.approx(summary["step_s"]["grpo-sdk"]["median"] /
                                                          summary["step_s"]["trl"]["median"])
    assert summary["trl_settings"]["loss_type"] == "dapo" and summary["base_eval"]["samples"] == 4


def heldout(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, str(BENCH / "heldout.py"), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)


def test_heldout_scores_every_model_alike_and_reports_the_mean_gain(tiny_model, tmp_path):
    """benchmarks/heldout.py: the same model as base and as two "runs" scores the same, so the gain is 0 +- 0;
    a run directory with nothing to export is an error naming it."""
    twin = tmp_path / "twin"
    twin.symlink_to(tiny_model)
    proc = heldout("--json", "--samples", "8", "--base", str(tiny_model), str(tiny_model), str(twin))
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    [score] = {json.dumps({k: v for k, v in r.items() if k != "seconds"}, sort_keys=True)
               for r in [summary["base"], *summary["runs"].values()]}
    assert json.loads(score)["samples"] == 8 and len(summary["runs"]) == 2
    assert summary["gain_mean"] == 0 and summary["gain_stderr"] == 0
    empty = tmp_path / "empty-run"
    empty.mkdir()
    proc = heldout("--base", str(tiny_model), str(empty))
    assert proc.returncode == 1 and f"grpoctl export {empty} failed" in proc.stderr, proc.stderr
    proc = heldout("--base", str(tmp_path / "missing"), str(empty))
    assert proc.returncode == 2 and "is not a directory" in proc.stderr
