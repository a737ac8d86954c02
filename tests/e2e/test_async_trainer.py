"""Async GRPO through the trainer (issue 15, docs/async.md): `grpo.async_grpo.enabled=true` with the
deterministic schedule. A=0 is the synchronous loop exactly; A=1 and A=2 learn the built-in recipe;
each step trains the groups its schedule says (versions in the age window); kill -9 and resume give
the uninterrupted run bit for bit; a resume that cannot restore the buffer regenerates from the
data cut (nothing skipped, no hang: the case NeMo-RL's `_startup_pipeline_ready` barrier guards);
startup failures leave no collector thread; epochs, validation and early stop work as in sync.
Real components throughout: the built-in task and model, `grpoctl run` in a subprocess."""

from __future__ import annotations

import json
import random
import shutil
import threading

import pytest
import yaml

from helpers import run_and_kill_after, run_grpoctl
from faults.campaign import final_weights, metrics_of
from grpo_sdk.trainer.checkpoint import write_manifest

ASYNC = ["grpo.async_grpo.enabled=true", "loss_fn.use_importance_sampling_correction=true"]
SMALL = ["grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=8", "grpo.val_period=4",
         "grpo.max_val_samples=8", "checkpointing.save_period=2"]


def age(a: int) -> str:
    return f"grpo.async_grpo.max_trajectory_age_steps={a}"


def run_ok(cwd, *args):
    result = run_grpoctl("run", *args, cwd=cwd)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.mark.parametrize("extra", [[], ["grpo.use_dynamic_sampling=true", "grpo.batch_multiplier=2"]])
def test_age_0_is_the_synchronous_loop_exactly(tmp_path, extra):
    """Same metrics (all but the wall-clock ones) and bit-identical weights, with and without dynamic
    sampling; async adds its buffer metrics and names its generation timing for what it is."""
    (tmp_path / "sync").mkdir()
    (tmp_path / "async").mkdir()
    common = ["--run-dir", "run", "grpo.max_num_steps=5", *SMALL, ASYNC[1], *extra]
    run_ok(tmp_path / "sync", *common)
    run_ok(tmp_path / "async", *common, ASYNC[0], age(0))
    sync, async_ = tmp_path / "sync" / "run", tmp_path / "async" / "run"
    rows = metrics_of(async_)
    buffer_keys = {"train/buffer_size", "train/avg_trajectory_age", "train/trajectory_age/0"}
    assert [{k: v for k, v in r.items() if k not in buffer_keys} for r in rows] == metrics_of(sync)
    assert final_weights(async_) == final_weights(sync)
    train_rows = [r for r in rows if "train/buffer_size" in r]
    assert len(train_rows) == 5
    assert all(r["train/avg_trajectory_age"] == 0 and r["train/trajectory_age/0"] == 1 and r["train/buffer_size"] == 0
               for r in train_rows)
    if extra:
        assert all("dynamic_sampling_num_gen_batches" in r for r in train_rows)  # the path ran


def raw_rows(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("a", [1, 2])
def test_each_step_trains_the_groups_its_schedule_says_and_the_recipe_learns(tmp_path, a):
    """The built-in recipe (500 steps) learns as in test_e2e; step t (1-based) trains groups of
    version max(t - 1 - A, 0), so its age is min(t - 1, A) and the buffer holds the A steps ahead."""
    run_ok(tmp_path, "--run-dir", "run", *ASYNC, age(a))
    rows = [r for r in raw_rows(tmp_path / "run") if "reward/mean" in r]
    assert [r["step"] for r in rows] == list(range(1, 501))
    prompts = yaml.safe_load((tmp_path / "run" / "config.resolved.yaml").read_text())["grpo"]["num_prompts_per_step"]
    for r in rows:
        expected = min(r["step"] - 1, a)
        assert r["train/avg_trajectory_age"] == expected, r["step"]
        assert r[f"train/trajectory_age/{expected}"] == 1.0
        assert sum(r[f"train/trajectory_age/{k}"] for k in range(a + 1)) == 1.0
        assert r["generation/weight_version"] == r["step"] - 1 - expected
        assert r["train/buffer_size"] == min(a, 500 - r["step"]) * prompts  # after the drain: the steps ahead
    first = sum(r["reward/mean"] for r in rows[:10]) / 10
    last = sum(r["reward/mean"] for r in rows[-20:]) / 20
    assert first < 0.15 and last >= 0.8, f"A={a}: reward {first:.3f} -> {last:.3f}"
    # The collector's idle time, by cause: A steps ahead it waits for the next grant (the age
    # window), never for the trainer's engine in this schedule (nothing pauses it but validation).
    idle = [r["timing/collector/generation_limit_pause"] for r in rows]
    assert all(x >= 0 for x in idle) and sum(x > 0 for x in idle) > len(rows) / 2
    assert all(r["timing/collector/paused_for_trainer"] >= 0 for r in rows)


@pytest.mark.slow
@pytest.mark.parametrize("a", [1, 2])
def test_kill_9_at_random_points_and_resume_is_exact(tmp_path, a):
    """Killed three times at random steps (seeded, printed) and resumed: the same metrics logged
    once per step and bit-identical final weights, from the restored buffer each time."""
    args = ["--run-dir", "run", "grpo.max_num_steps=14", *SMALL, *ASYNC, age(a)]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    run_ok(tmp_path / "a", *args)
    points = sorted(random.Random(f"async-kill-{a}").sample(range(3, 14), 3))
    print("kill points", points)
    run_and_kill_after(["run", *args], tmp_path / "b", step=points[0])
    for point in points[1:]:
        run_and_kill_after(["run", "--resume", "run"], tmp_path / "b", step=point)
    resumed = run_ok(tmp_path / "b", "--resume", "run")
    assert "resumed from step" in resumed.stdout and "regenerating" not in resumed.stderr
    a_run, b_run = tmp_path / "a" / "run", tmp_path / "b" / "run"
    assert metrics_of(b_run) == metrics_of(a_run)
    assert final_weights(b_run) == final_weights(a_run)


def test_a_damaged_pipeline_regenerates_from_the_cut_and_trains_every_prompt(tmp_path):
    """NeMo-RL's resume deadlock: a restored buffer holds step s+1 complete and nothing of step s+2.
    Here the resume sees the pipeline is not the saved one, rewinds the data to the cut and
    regenerates: the run finishes (no hang) and trains the same prompts, in the same order, as the
    uninterrupted run. The same holds with checkpointing.load_replay_buffer=false."""
    args = ["--run-dir", "run", *SMALL, *ASYNC, age(2), "logger.dump_train_data=true", "grpo.val_period=0"]
    for name in ("ref", "damaged", "unloaded"):
        (tmp_path / name).mkdir()
    run_ok(tmp_path / "ref", *args, "grpo.max_num_steps=6")
    for name in ("damaged", "unloaded"):
        run_ok(tmp_path / name, *args, "grpo.max_num_steps=4")
        # Keep step_2 only, then extend the run to 6 steps (a resumable key).
        shutil.rmtree(tmp_path / name / "run" / "checkpoints" / "step_4")
    checkpoint = tmp_path / "damaged" / "run" / "checkpoints" / "step_2"
    document = json.loads((checkpoint / "async" / "buffer.json").read_text())
    assert sorted({g["target_step"] for g in document["groups"]}) == [2, 3]  # 0-based targets s, s+1
    document["groups"] = [g for g in document["groups"] if g["target_step"] == 2]
    (checkpoint / "async" / "buffer.json").write_text(json.dumps(document))
    write_manifest(checkpoint)  # a consistent checkpoint whose pipeline is short, as after NeMo-RL's race

    damaged = run_ok(tmp_path / "damaged", "--resume", "run", "grpo.max_num_steps=6")
    assert "regenerating them from the data frontier of step 3" in damaged.stderr
    unloaded = run_ok(tmp_path / "unloaded", "--resume", "run", "grpo.max_num_steps=6",
                      "checkpointing.load_replay_buffer=false")
    assert "load_replay_buffer" in unloaded.stdout + unloaded.stderr  # the not-bit-identical warning

    def prompts(run, step):
        rows = [json.loads(line) for line in (run / "train_data" / f"step_{step}.jsonl").read_text().splitlines()]
        return [r["content"][0]["content"] for r in rows]

    for name in ("damaged", "unloaded"):
        run = tmp_path / name / "run"
        assert [r["step"] for r in metrics_of(run)] == list(range(1, 7))
        for step in range(1, 7):
            assert prompts(run, step) == prompts(tmp_path / "ref" / "run", step), (name, step)


def test_epochs_validation_and_early_stop_work_as_in_sync(tmp_path):
    """A run ended by its data's epochs trains the steps the sync run trains and says so; validation
    and an early stop happen at the steps the sync run has them."""
    data = ["data.train_path=data.jsonl", "data.validation_path=data.jsonl", "env.name=reward_functions",
            "env.reward_functions.functions=[my_rewards:reversed_digits]", "grpo.max_num_epochs=2",
            "grpo.max_num_steps=100"]
    for mode, extra in (("sync", []), ("async", ASYNC)):
        (tmp_path / mode).mkdir()
        (tmp_path / mode / "data.jsonl").write_text("".join(
            json.dumps({"prompt": f"{n}>", "target": str(n)[::-1]}) + "\n" for n in range(1000, 1010)))
        (tmp_path / mode / "my_rewards.py").write_text(
            "def reversed_digits(prompts, completions, target, **kwargs):\n"
            "    return [sum(a == b for a, b in zip(c, t)) / len(t) for c, t in zip(completions, target)]\n")
        run_ok(tmp_path / mode, "--run-dir", "run", *SMALL, *data, *extra)
        run_ok(tmp_path / mode, "--run-dir", "stop", *SMALL, "grpo.max_num_steps=50", *extra,
               "grpo.stop_at_validation_metric=accuracy", "grpo.stop_at_validation_threshold=0.0")
    for name in ("run", "stop"):
        sync = json.loads((tmp_path / "sync" / name / "summary.json").read_text())
        async_ = json.loads((tmp_path / "async" / name / "summary.json").read_text())
        assert (async_["status"], async_["steps"], async_["ended_by"]) == (sync["status"], sync["steps"],
                                                                           sync["ended_by"])
    assert sync["status"] == "early_stop" and sync["steps"] == 4
    ended = json.loads((tmp_path / "async" / "run" / "summary.json").read_text())
    assert ended["ended_by"] == "grpo.max_num_epochs" and ended["steps"] == 5  # 10 prompts x 2 epochs / 4 per step
    assert "val/accuracy" in raw_rows(tmp_path / "async" / "run")[3]


def test_a_failing_first_generation_stops_the_run_and_leaves_no_collector_thread(tmp_path):
    """Through the Python API, in this process: the environment raises at the first scoring call,
    which the collector thread makes; the error reaches the caller with its text and the thread is gone."""
    import grpo_sdk

    def broken(prompts, completions, **_):
        raise RuntimeError("the judge is down")

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{n}>"}) + "\n" for n in range(100, 120)))
    with pytest.raises(Exception, match="the judge is down"):  # noqa: PT011 - its type is the user's
        grpo_sdk.train(None, ["grpo.max_num_steps=3", *SMALL, *ASYNC, "env.on_reward_error=raise",
                              f"data.train_path={data}", "grpo.val_period=0", "grpo.val_at_end=false"],
                       run_dir=tmp_path / "run", reward_funcs=[broken])
    assert not [t for t in threading.enumerate() if t.name == "grpo-collector"]
