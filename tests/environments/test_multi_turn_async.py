"""Multi-turn episodes with async GRPO and on Ray (issue 16 item 7, docs/multi-turn.md).

The environment is ``count_turns`` (``helpers.ray_fixtures.COUNT_TURNS``): three turns an episode, its
state in the metadata. An episode is one member of its group: async GRPO at age 0 trains exactly
what the synchronous loop does, A=1 trains one-step-old episodes, a kill -9 mid-run resumes to
the uninterrupted run bit for bit (multi-turn groups in the replay buffer included), and on Ray
(environments as actors, every turn spread over them; the collector as an actor) the results
equal the in-process ones.
"""

from __future__ import annotations

import pytest

from helpers import FakeSite, run_and_kill_after, run_grpoctl
from faults.campaign import assert_same_run, final_weights, metrics_of
from helpers.ray_fixtures import COUNT_TURNS

MULTI = ["env.name=count_turns", "grpo.max_rollout_turns=4", "policy.generation.max_new_tokens=4",
         "grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=8", "grpo.val_period=3",
         "grpo.max_val_samples=8", "checkpointing.save_period=2"]
ASYNC = ["grpo.async_grpo.enabled=true", "loss_fn.use_importance_sampling_correction=true"]
RAY = ["cluster.runtime=ray", "policy.generation.colocated.enabled=false", "cluster.env_workers=2"]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    site = FakeSite(tmp_path_factory.mktemp("site"))
    site.add("grpo-test-count-turns", entry_points={"grpo_sdk.environments": {"count_turns": "grpo_test_count_turns:SPEC"}},
             files={"grpo_test_count_turns.py": COUNT_TURNS})
    return site


def run(site, cwd, *args):
    cwd.mkdir(parents=True, exist_ok=True)
    result = run_grpoctl("run", "--run-dir", "run", *args, cwd=cwd, PYTHONPATH=str(site.root))
    assert result.returncode == 0, result.stderr[-3000:]
    return cwd / "run"


def test_async_age_0_trains_exactly_what_the_synchronous_loop_does(site, tmp_path):
    common = ["grpo.max_num_steps=4", *MULTI, ASYNC[1]]
    sync = run(site, tmp_path / "sync", *common)
    async_ = run(site, tmp_path / "async", *common, ASYNC[0], "grpo.async_grpo.max_trajectory_age_steps=0")
    buffer_keys = {"train/buffer_size", "train/avg_trajectory_age", "train/trajectory_age/0"}
    rows = metrics_of(async_)
    assert [{k: v for k, v in r.items() if k not in buffer_keys} for r in rows] == metrics_of(sync)
    assert final_weights(async_) == final_weights(sync)
    train_rows = [r for r in rows if "reward/mean" in r]
    assert all(r["episode/turns_mean"] == 3 and r["env/turn"] == 2 for r in train_rows)  # 3 turns, then done
    assert any("val/turn" in r for r in rows)  # validation plays whole episodes too


def test_async_one_step_off_trains_old_episodes_and_resumes_exactly_after_kill_9(site, tmp_path):
    args = ["grpo.max_num_steps=7", *MULTI, *ASYNC, "grpo.async_grpo.max_trajectory_age_steps=1"]
    reference = run(site, tmp_path / "reference", *args)
    rows = [r for r in metrics_of(reference) if "reward/mean" in r]
    assert [r["train/avg_trajectory_age"] for r in rows] == [0.0] + [1.0] * 6
    assert all(r["episode/turns_mean"] == 3 for r in rows)
    killed = tmp_path / "killed"
    killed.mkdir()
    env = {"PYTHONPATH": str(site.root)}
    run_and_kill_after(["run", "--run-dir", "run", *args], killed, step=3, **env)
    run_and_kill_after(["run", "--resume", "run"], killed, step=6, **env)  # after the step-4 checkpoint
    resumed = run_grpoctl("run", "--resume", "run", cwd=killed, **env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_run(killed / "run", reference)


needs_ray = pytest.mark.usefixtures("ray_cluster")


@needs_ray
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_on_ray_environment_actors_give_the_in_process_results(ray_cluster, tmp_path, monkeypatch, mode):
    """Two environment actors share every turn's step (the episode's state in its metadata); the
    async run's collector is an actor too. Same seed, same steps as in one process."""
    from grpo_sdk.plugins.registry import Registry
    from helpers import assert_same_results, bare_trainer, train

    monkeypatch.syspath_prepend(str(ray_cluster.site))  # the driver discovers count_turns too
    registry = Registry.discover()
    args = ["grpo.max_num_steps=3", "checkpointing.enabled=false", *MULTI, "grpo.val_period=0",
            *(ASYNC + ["grpo.async_grpo.max_trajectory_age_steps=1"] if mode == "async" else [])]
    local = train(bare_trainer(tmp_path, "local", *args, registry=registry))
    on_ray = train(bare_trainer(tmp_path, "ray", *args, *RAY, registry=registry))
    assert_same_results(local, on_ray)
    for x, y in zip(local, on_ray):
        assert x["episode/turns_mean"] == y["episode/turns_mean"] == 3
        assert x["env/turn"] == y["env/turn"] == 2
