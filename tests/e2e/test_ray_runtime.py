"""The Ray runtime: the same config runs in-process and on Ray with the same results; workers that
die or stall stop the run with an error naming them; the disk weight-sync transport.

Every Ray test shares one local cluster (``helpers.ray_fixtures.ray_cluster``, started once per test run).
The pure helpers (splitting, merging, config checks, the disk transport in-process) need no Ray.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from grpo_sdk.trainer.checkpoint import CheckpointManager
from grpo_sdk.config.loading import load_config
from grpo_sdk.core.errors import GrpoSdkError, PluginError
from grpo_sdk.core.records import EnvironmentReturn, GenerationOutput
from grpo_sdk.plugins.registry import Registry
from helpers import assert_same_results, bare_trainer, config_problems, train
from grpo_sdk.runtime.deadlines import WorkerError
from grpo_sdk.runtime.groups import merge_environment_returns, merge_generation_outputs, split_rows

# The built-in recipe (8 prompts x 16 generations, 5 new tokens), short and without validation.
SHORT = ["grpo.max_num_steps=3", "grpo.val_period=0", "grpo.val_at_end=false", "checkpointing.enabled=false"]
RAY = ["cluster.runtime=ray"]

needs_ray = pytest.mark.usefixtures("ray_cluster")


# --- pure helpers -------------------------------------------------------------------------------------


def test_split_rows_gives_contiguous_near_equal_chunks():
    assert split_rows(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert split_rows(2, 4) == [(0, 1), (1, 2)]  # never an empty chunk
    assert split_rows(128, 1) == [(0, 128)]
    assert split_rows(0, 2) == []


def test_generation_outputs_are_merged_in_row_order_with_one_width():
    a = GenerationOutput(response_ids=torch.tensor([[5, 6, 7]]), response_lengths=torch.tensor([3]),
                         logprobs=torch.tensor([[-1.0, -2.0, -3.0]]), truncated=torch.tensor([True]), weight_version=4)
    b = GenerationOutput(response_ids=torch.tensor([[8], [9]]), response_lengths=torch.tensor([1, 1]),
                         logprobs=torch.tensor([[-0.5], [-0.25]]), truncated=torch.tensor([False, False]),
                         weight_version=4)
    out = merge_generation_outputs([a, b], pad_token_id=0)
    assert out.response_ids.tolist() == [[5, 6, 7], [8, 0, 0], [9, 0, 0]]
    assert out.logprobs.tolist() == [[-1.0, -2.0, -3.0], [-0.5, 0.0, 0.0], [-0.25, 0.0, 0.0]]
    assert out.response_lengths.tolist() == [3, 1, 1] and out.truncated.tolist() == [True, False, False]
    assert out.weight_version == 4


def test_environment_returns_are_merged_in_order_with_size_weighted_metrics():
    a = EnvironmentReturn(rewards={"r": [1.0, 0.0, 1.0]}, metrics={"exact": 2 / 3})
    b = EnvironmentReturn(rewards={"r": [0.0]}, metrics={"exact": 0.0}, done=[False],
                          metadata=[{"turn": 2}])
    out = merge_environment_returns([a, b], [3, 1], [[{"i": 0}, {"i": 1}, {"i": 2}], [{"i": 3}]])
    assert out.rewards == {"r": [1.0, 0.0, 1.0, 0.0]}
    assert out.metrics["exact"] == pytest.approx(0.5)  # 2 of 4, as one in-process call reports it
    assert out.done == [True, True, True, False]
    assert out.observations is None
    assert out.metadata == [{"i": 0}, {"i": 1}, {"i": 2}, {"turn": 2}]
    with pytest.raises(ValueError, match="different reward components"):
        merge_environment_returns([a, EnvironmentReturn(rewards={"other": [0.0]})], [3, 1], [[{}] * 3, [{}]])


def test_config_checks_of_the_runtime(monkeypatch):
    local = config_problems(Registry.discover(), "cluster.policy_workers=2", "cluster.env_workers=3", "cluster.address=auto")
    assert "need cluster.runtime=ray" in local["cluster.policy_workers"]
    assert "cluster.env_workers" in local and "cluster.address" in local

    ray = config_problems(Registry.discover(), *RAY, "cluster.policy_workers=3", "policy.train_global_batch_size=64",
                      "cluster.generation_workers=200", "cluster.num_nodes=2")
    assert "must divide the rollout batch" in ray["cluster.policy_workers"]
    assert "divisible by cluster.policy_workers (3)" in ray["policy.train_global_batch_size"]
    assert "at most as many replicas as rows" in ray["cluster.generation_workers"]
    assert "cluster.address" in ray["cluster.num_nodes"]

    gpus = config_problems(Registry.discover(), *RAY, "cluster.gpus_per_node=2", "cluster.policy_workers=2", "cluster.generation_workers=2",
                       "policy.generation.colocated.enabled=false")
    assert "needs 4" in gpus["cluster.gpus_per_node"]
    load_config(None, [*RAY, "cluster.gpus_per_node=2", "cluster.policy_workers=2", "cluster.generation_workers=2"],
                Registry.discover())  # colocated: the same 2 GPUs

    import importlib.metadata as md

    real = md.version
    monkeypatch.setattr(md, "version", lambda name: (_ for _ in ()).throw(md.PackageNotFoundError(name))
                        if name == "ray" else real(name))
    assert "pip install 'grpo-sdk[ray]'" in config_problems(Registry.discover(), *RAY)["cluster.runtime"]


def test_importing_the_runtime_and_validating_a_ray_config_do_not_import_ray():
    body = ("import sys, grpo_sdk.runtime, grpo_sdk.runtime.deadlines\n"
            "from grpo_sdk.plugins.registry import Registry\n"
            "from grpo_sdk.config.loading import load_config\n"
            "cfg = load_config(None, ['cluster.runtime=ray', 'cluster.policy_workers=2', 'weight_sync.backend=disk'],"
            " Registry.discover())\n"
            "print('ray' in sys.modules)\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", body], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_disk_transport_in_process_leaves_generation_with_the_policy_weights(tmp_path):
    trainer = bare_trainer(tmp_path, "disk", *SHORT, "grpo.max_num_steps=2", "weight_sync.backend=disk")
    trainer.setup()
    try:
        trainer.train()
        policy = dict(trainer.components.policy.named_weights())
        generation = trainer.components.generation.model.state_dict()
        assert set(generation) == set(policy)
        assert all(torch.equal(generation[k], policy[k]) for k in policy)
        assert trainer.components.generation.weight_version == 2
        assert list((tmp_path / "disk" / "weight_sync").iterdir()) == []  # each file removed once loaded
    finally:
        trainer.shutdown()


# --- on a Ray cluster ------------------------------------------------------------------------------------


@needs_ray
def test_a_short_run_with_replicas_and_an_environment_pool_and_the_disk_transport(tmp_path):
    """(a) + (e): 1 policy rank, 2 generation replicas, 2 environment actors, weights through files."""
    from grpo_sdk.runtime.workers import attribute_op

    trainer = bare_trainer(tmp_path, "ray", *SHORT, *RAY, "cluster.generation_workers=2", "cluster.env_workers=2",
                          "weight_sync.backend=disk", "checkpointing.enabled=true", "checkpointing.save_period=3")
    trainer.setup()
    try:
        steps = []
        trainer.train(on_step=lambda step, metrics: steps.append(metrics))
        assert [m["generation/weight_version"] for m in steps] == [0.0, 1.0, 2.0]
        assert all(0 < m["generated_tokens"] <= 128 * 5 for m in steps)
        assert all(0.0 <= m["reward/mean"] <= 1.0 and "env/exact_match" in m for m in steps)

        policy = dict(trainer.components.policy.named_weights())
        replicas = [{k: v.cpu() for k, v in model.state_dict().items()}  # the models as the replicas hold them
                    for model in trainer.components.generation.run(attribute_op, "model")]
        assert len(replicas) == 2
        for weights in replicas:
            assert set(weights) == set(policy)
            assert all(torch.equal(weights[k], policy[k]) for k in policy)
        assert trainer.components.generation.weight_versions() == [3, 3]
        assert list((tmp_path / "ray" / "weight_sync").iterdir()) == []

        # Replica 0's sampler state where the in-process runtime keeps it, replica 1's next to it.
        generation = tmp_path / "ray" / "checkpoints" / "step_3" / "generation"
        replica_0 = (generation / "rng.safetensors").read_bytes()
        assert replica_0 != (generation / "replica_1" / "rng.safetensors").read_bytes()
    finally:
        trainer.shutdown()


@needs_ray
@pytest.mark.parametrize("layout", [
    pytest.param(["cluster.policy_workers=1", "policy.generation.colocated.enabled=false"], id="1-rank-noncolocated"),
    pytest.param(["cluster.policy_workers=2"], id="2-rank-fsdp2-colocated"),
])
def test_ray_gives_the_in_process_results(tmp_path, layout):
    """(b): the same seed gives the same per-step losses and rewards in-process and on Ray (one
    generation replica samples exactly as in-process; the policy's ranks split the batch)."""
    local = train(bare_trainer(tmp_path, "local", *SHORT))
    on_ray = train(bare_trainer(tmp_path, "ray", *SHORT, *RAY, *layout))
    assert_same_results(local, on_ray)


@needs_ray
def test_lora_on_two_fsdp2_ranks_gives_the_in_process_results(tmp_path):
    """policy.lora on Ray: two FSDP2 policy ranks train the adapters and sync merged weights to the
    generation worker as the in-process run does; the adapters move the policy off the base."""
    pytest.importorskip("peft")
    lora = ["policy.lora.enabled=true", "loss_fn.reference_policy_kl_penalty=0.01"]
    local = train(bare_trainer(tmp_path, "local", *SHORT, *lora))
    on_ray = train(bare_trainer(tmp_path, "ray", *SHORT, *RAY, "cluster.policy_workers=2", *lora))
    assert_same_results(local, on_ray)
    assert on_ray[-1]["kl_penalty"] > 0 and all(abs(m["token_mult_prob_error"] - 1) < 1e-4 for m in on_ray)


@needs_ray
@pytest.mark.parametrize("role, index, method, layout", [
    ("generation", 0, "generate", []),
    ("policy", 1, "train", ["cluster.policy_workers=2"]),
])
def test_a_killed_worker_stops_the_run_naming_it_and_the_last_checkpoint_resumes(tmp_path, role, index, method,
                                                                                 layout):
    """(c): a worker is SIGKILLed as step 4 calls it; the run stops with a WorkerError that names the
    worker, the call and the time; checkpoint step_2 is intact, and the in-process runtime resumes it
    and reproduces step 3."""
    args = ["grpo.max_num_steps=6", "grpo.val_period=0", "grpo.val_at_end=false", "checkpointing.save_period=2"]
    trainer = bare_trainer(tmp_path, "run", *args, *RAY, *layout)
    seen = {}

    def kill_during_step_4(step, metrics):
        seen[step] = metrics
        if step == 3:
            group = getattr(trainer.components, role)
            call = getattr(group, method)

            def killed(*args, **kwargs):
                os.kill(group.workers[index].pid, signal.SIGKILL)
                return call(*args, **kwargs)

            setattr(group, method, killed)

    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        train(trainer, kill_during_step_4)
    worker = getattr(trainer.components, role).workers[index]
    assert info.value.worker == f"{role} worker {index} (pid {worker.pid})"
    assert info.value.call == f"{method}()"
    assert str(info.value).startswith(f"{info.value.worker} died during {method}() after ")
    assert " s: " in str(info.value)
    assert time.monotonic() - start < 120

    manager = CheckpointManager(trainer.config.checkpointing, tmp_path / "run")
    assert [p.name for p in manager.checkpoints()] == ["step_2"]
    assert not list(manager.directory.glob(".step_*"))
    assert json.loads((manager.directory / "step_2" / "training_state.json").read_text())["step"] == 2

    resumed = train(bare_trainer(tmp_path, "run", *args, "grpo.max_num_steps=3", resume=True))
    assert len(resumed) == 1
    assert_same_results([seen[3]], resumed)


@needs_ray
def test_a_stalled_environment_worker_stops_the_run_within_the_deadline(tmp_path, ray_cluster, monkeypatch):
    """(d): an environment actor that hangs in its second step() stops the run after
    cluster.call_timeout_s, naming the worker and the call; it does not hang."""
    monkeypatch.syspath_prepend(str(ray_cluster.site))
    registry = Registry.discover()
    try:
        trainer = bare_trainer(tmp_path, "stall", *SHORT, *RAY, "env.name=stall_digits", "cluster.call_timeout_s=3",
                              "cluster.env_max_concurrency=1", registry=registry)
        start = time.monotonic()
        with pytest.raises(WorkerError) as info:  # not masked or retried as a reward failure
            train(trainer)
        elapsed = time.monotonic() - start
    finally:
        sys.modules.pop("grpo_test_stall_env", None)
    worker_error = info.value
    assert worker_error.worker.startswith("environment worker 0 (pid ")
    assert worker_error.call == "step()"
    assert "did not answer step() within 3.0 s" in str(info.value)
    assert elapsed < 60  # the worker sleeps for 60 s: the deadline, not the worker, ended the run


@needs_ray
def test_a_cluster_too_small_for_the_run_fails_at_once(tmp_path):
    trainer = bare_trainer(tmp_path, "big", *SHORT, *RAY, "cluster.policy_workers=16")
    start = time.monotonic()
    with pytest.raises(GrpoSdkError, match="too small for this run"):
        train(trainer)
    assert time.monotonic() - start < 30


def test_an_unreachable_cluster_address_fails_at_once():
    from grpo_sdk.runtime.ray_runtime import RayRuntime

    runtime = object.__new__(RayRuntime)
    runtime.startup_timeout = 10.0
    with pytest.raises(GrpoSdkError, match=r"cannot reach the Ray cluster at 127.0.0.1:1 \(cluster.address\)"):
        runtime._probe("127.0.0.1:1")


def test_a_component_registered_in_process_cannot_go_to_a_worker(tmp_path):
    from grpo_sdk.environments.specs import REVERSE_DIGITS
    from grpo_sdk.plugins import ComponentSpec, hookimpl
    from grpo_sdk.plugins.host import PluginHost

    class InProcess:
        @hookimpl
        def grpo_components(self):
            return [ComponentSpec(name="inproc_digits", kind="environment", impl=REVERSE_DIGITS.impl,
                                  capabilities={"generates_prompts"})]

    host = PluginHost()
    host.register(InProcess(), name="inproc")
    registry = Registry.discover(host=host)
    trainer = bare_trainer(tmp_path, "inproc", *SHORT, *RAY, "env.name=inproc_digits", registry=registry)
    with pytest.raises(PluginError, match="registered in this process"):
        train(trainer)
