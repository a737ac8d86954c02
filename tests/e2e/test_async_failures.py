"""Async GRPO's failure paths (issue 15 item 4, docs/async.md): generation failures retried up to
`grpo.async_grpo.max_generation_failures` from the same data frontier (same prompts, same group ids),
then a stop naming the step and its prompt groups; a starving trainer stops within
`grpo.async_grpo.starvation_timeout_s` saying what the collector is doing, never sleeping forever.
Real runs of `grpoctl run` on a small dataset; the failures come from a user reward function that
counts its calls in a file (so the failing call is placed exactly)."""

from __future__ import annotations

import json
import time

from helpers import run_grpoctl

ASYNC = ["grpo.async_grpo.enabled=true", "loss_fn.use_importance_sampling_correction=true"]
RUN = ["grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4", "grpo.max_num_steps=4",
       "data.train_path=data.jsonl", "env.name=reward_functions", "env.reward_functions.functions=[task:reward]",
       "grpo.val_period=0", "grpo.val_at_end=false", "checkpointing.save_period=2"]

# The reward function's batched calls (one scores one step's batch) are counted in calls.txt; `FAIL`
# lists the (1-based) calls that raise and `SLEEP` those that sleep 5 s first. After a failed batch
# the rollout layer scores each sample alone to name the failing one: those calls pass uncounted.
TASK = '''
from pathlib import Path

FAIL, SLEEP = {fail}, {sleep}

def reward(prompts, completions, target, **kwargs):
    if len(completions) == 1:
        return [0.0]
    counter = Path("calls.txt")
    n = int(counter.read_text()) + 1 if counter.exists() else 1
    counter.write_text(str(n))
    if n in SLEEP:
        import time
        time.sleep(5)
    if n in FAIL:
        raise RuntimeError(f"the judge is down (call {{n}})")
    return [sum(a == b for a, b in zip(c, t)) / len(t) for c, t in zip(completions, target)]
'''


def task_dir(path, fail=(), sleep=()):
    path.mkdir()
    (path / "data.jsonl").write_text("".join(json.dumps({"prompt": f"{n}>", "target": str(n)[::-1]}) + "\n"
                                             for n in range(1000, 1040)))
    (path / "task.py").write_text(TASK.format(fail=set(fail) or "set()", sleep=set(sleep) or "set()"))
    return path


def trained_prompts(run, step):
    rows = [json.loads(line) for line in (run / "train_data" / f"step_{step}.jsonl").read_text().splitlines()]
    return [r["content"][0]["content"] for r in rows]


def test_a_failed_generation_is_retried_with_the_same_prompts(tmp_path):
    ref = task_dir(tmp_path / "ref")
    flaky = task_dir(tmp_path / "flaky", fail={3, 4})  # step 3's first two attempts
    args = ["run", "--run-dir", "run", *RUN, *ASYNC, "logger.dump_train_data=true",
            "grpo.async_grpo.max_generation_failures=2"]
    assert run_grpoctl(*args, cwd=ref).returncode == 0
    result = run_grpoctl(*args, cwd=flaky)
    assert result.returncode == 0, result.stderr[-3000:]
    first, second = [line for line in result.stderr.splitlines() if "retrying" in line]
    assert first.startswith("grpo-sdk: generating step 3's rollouts (prompt groups 8..11) failed (")
    assert "the judge is down (call 3)" in first and first.endswith("retrying, failure 1 of 2 allowed in a row")
    assert "(call 4)" in second and second.endswith("failure 2 of 2 allowed in a row")
    assert "Traceback" not in result.stderr
    rows = [json.loads(line) for line in (flaky / "run" / "metrics.jsonl").read_text().splitlines()]
    wasted = {r["step"]: r["timing/collector/failed_generation"] for r in rows}
    assert wasted[3] > 0 and wasted[1] == wasted[2] == wasted[4] == 0
    for step in range(1, 5):  # the retry drew the same prompts: nothing skipped, nothing twice
        assert trained_prompts(flaky / "run", step) == trained_prompts(ref / "run", step)


def test_failures_past_the_limit_stop_the_run_naming_the_step_and_its_groups(tmp_path):
    cwd = task_dir(tmp_path / "run", fail=set(range(3, 100)))
    result = run_grpoctl("run", "--run-dir", "run", *RUN, *ASYNC, "grpo.async_grpo.max_generation_failures=2",
                         "checkpointing.save_period=10", cwd=cwd)
    assert result.returncode == 1, result.stderr[-3000:]
    assert ("generating step 3's rollouts (prompt groups 8..11) failed 3 times in a row "
            "(grpo.async_grpo.max_generation_failures=2)") in result.stderr
    assert "the judge is down (call 5)" in result.stderr and "Traceback" not in result.stderr
    # Step 2 trained while step 3 failed: it is saved (off the save period), and a resume goes on from it.
    assert (cwd / "run" / "checkpoints" / "step_2").is_dir()
    (cwd / "task.py").write_text(TASK.format(fail="set()", sleep="set()"))
    resumed = run_grpoctl("run", "--resume", "run", cwd=cwd)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from step 2" in resumed.stdout
    # The checkpoint saved the pipeline as it was (step 3 missing) and where to draw step 3 again.
    assert "regenerating" not in resumed.stderr
    assert [json.loads(line)["step"] for line in (cwd / "run" / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]


def test_the_first_failure_stops_the_run_by_default_with_the_error_itself(tmp_path):
    cwd = task_dir(tmp_path / "run", fail={2})
    result = run_grpoctl("run", "--run-dir", "run", *RUN, *ASYNC, cwd=cwd)
    assert result.returncode != 0
    assert "the judge is down (call 2)" in result.stderr and "retrying" not in result.stderr
    assert "Traceback" not in result.stderr


def test_a_starving_trainer_stops_within_its_deadline_saying_why(tmp_path):
    """The third scoring call sleeps 5 s; with a 1 s deadline the run stops after about 1 s of no
    progress, naming the step it waits for and what the collector is doing (not after the sleep)."""
    cwd = task_dir(tmp_path / "run", sleep={3})
    start = time.monotonic()
    result = run_grpoctl("run", "--run-dir", "run", *RUN, *ASYNC, "grpo.async_grpo.starvation_timeout_s=1", cwd=cwd)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "starved" in result.stderr and "grpo.async_grpo.starvation_timeout_s" in result.stderr
    assert "generating step 3 for" in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert time.monotonic() - start < 60
