"""Several nodes (``cluster.num_nodes``), simulated: a two-node Ray cluster on this machine.

The cluster (``helpers.ray_fixtures.two_nodes``) is Ray's own test utility, ``ray.cluster_utils.Cluster``:
a head node and a worker node, each a raylet of its own, both on 127.0.0.1. What that proves and
what it does not: the run places its workers on two Ray nodes and coordinates them (placement
groups pinned per node, torch.distributed and weight sync between processes of different raylets,
a lost node); the nodes share one machine's cores, memory and filesystem, and nothing crosses a
real network.

``grpoctl run`` joins the cluster from a process of its own (this process may be connected to the
session's one-node cluster). The node helpers (which node each bundle goes to, which nodes are
chosen, the errors) are tested without Ray.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from helpers import config_problems, grpoctl_env, run_grpoctl
from grpo_sdk.config.loading import load_config
from grpo_sdk.core.errors import GrpoSdkError
from grpo_sdk.plugins.registry import Registry
from grpo_sdk.runtime import nodes

# The built-in recipe, 3 steps; a checkpoint at the end to compare the weights.
SHORT = ["grpo.max_num_steps=3", "grpo.val_period=0", "grpo.val_at_end=false", "checkpointing.save_period=3"]
TOLERANCE = 1e-5
RUN_TIMEOUT_S = 420  # a two-rank run starts in ~1 min here under load; a hang must not outlive the test


def node(node_id, cpus, alive=True, gpus=0):
    return {"NodeID": node_id, "Alive": alive, "NodeManagerAddress": "127.0.0.1",
            "Resources": {"CPU": float(cpus), **({"GPU": float(gpus)} if gpus else {})}}


# --- the node helpers, without Ray -------------------------------------------------------------------


def test_bundles_go_to_the_nodes_in_contiguous_near_equal_blocks():
    assert nodes.node_of_bundles(2, 2) == [0, 1]
    assert nodes.node_of_bundles(4, 2) == [0, 0, 1, 1]
    assert nodes.node_of_bundles(5, 2) == [0, 0, 0, 1, 1]
    assert nodes.node_of_bundles(5, 4) == [0, 0, 1, 2, 3]
    for bundles in range(1, 12):
        for n in range(1, bundles + 1):
            node_of = nodes.node_of_bundles(bundles, n)
            assert node_of == sorted(node_of) and set(node_of) == set(range(n))
            assert max(map(node_of.count, range(n))) - min(map(node_of.count, range(n))) <= 1
    with pytest.raises(ValueError):
        nodes.node_of_bundles(1, 2)
    assert nodes.block_resources({"CPU": 1.0, "GPU": 1.0}, [0, 0, 1], 2) == [{"CPU": 2.0, "GPU": 2.0},
                                                                          {"CPU": 1.0, "GPU": 1.0}]


def test_the_driver_node_comes_first_and_nodes_too_small_or_dead_are_passed_over():
    cluster = [node("cc", 8), node("aa", 0), node("bb", 8), node("dd", 8, alive=False), node("ee", 1)]
    blocks = [{"CPU": 2.0}, {"CPU": 2.0}]
    assert nodes.choose_nodes(cluster, blocks, driver_node="cc", address=None) == ["cc", "bb"]
    assert nodes.choose_nodes(cluster, blocks, driver_node="aa", address=None) == ["bb", "cc"]  # head: 0 CPUs
    gpu_blocks = [{"CPU": 1.0, "GPU": 1.0}] * 2
    assert nodes.choose_nodes([node("a", 4, gpus=1), node("b", 4), node("c", 4, gpus=2)], gpu_blocks,
                              driver_node="b", address=None) == ["a", "c"]


def test_fewer_nodes_than_cluster_num_nodes_is_refused_naming_the_key_and_listing_the_nodes():
    cluster = [node("1234567890ab", 4), node("feedbeef0000", 4, alive=False)]
    with pytest.raises(GrpoSdkError) as info:
        nodes.choose_nodes(cluster, [{"CPU": 1.0}] * 2, driver_node=None, address="127.0.0.1:6379")
    message = str(info.value)
    assert message.startswith("cluster.num_nodes=2, but the Ray cluster at 127.0.0.1:6379 has 1 alive node(s): ")
    assert "node 12345678 (127.0.0.1, CPU 4, GPU 0)" in message and "node feedbeef (127.0.0.1, dead)" in message
    with pytest.raises(GrpoSdkError, match=r"only 1 of the 2 alive nodes .* can hold a block of CPU 3"):
        nodes.choose_nodes([node("a", 4), node("b", 2)], [{"CPU": 3.0}] * 2, driver_node=None, address=None)


def test_config_checks_of_num_nodes():
    ray = ["cluster.runtime=ray", "cluster.address=127.0.0.1:6379"]
    registry = Registry.discover()
    assert config_problems(registry, *ray, "cluster.num_nodes=2")["cluster.num_nodes"] == (
        "2 nodes, but the run has 1 worker bundle(s) to spread over them (colocated: max(policy_workers, "
        "generation_workers)), so some node would stay empty; raise cluster.policy_workers or "
        "cluster.generation_workers, or lower cluster.num_nodes")
    load_config(None, [*ray, "cluster.num_nodes=2", "cluster.policy_workers=2"], registry)
    non_colocated = [*ray, "policy.generation.colocated.enabled=false"]
    load_config(None, [*non_colocated, "cluster.num_nodes=2"], registry)  # 1 + 1 bundles: one per node
    assert "(non-colocated: policy_workers + generation_workers)" in config_problems(
        registry, *non_colocated, "cluster.num_nodes=3")["cluster.num_nodes"]


def test_a_resume_may_join_the_cluster_at_a_new_address_but_not_change_num_nodes(tmp_path):
    from grpo_sdk.core.errors import ConfigError
    from grpo_sdk.trainer.launch import check_resumable

    registry = Registry.discover()
    run = ["cluster.runtime=ray", "cluster.policy_workers=2", "cluster.num_nodes=2"]
    saved = load_config(None, [*run, "cluster.address=10.0.0.1:6379"], registry)
    check_resumable(saved, load_config(None, [*run, "cluster.address=10.0.0.1:6380"], registry), tmp_path)
    with pytest.raises(ConfigError, match="cluster.num_nodes"):
        check_resumable(saved, load_config(None, [*run, "cluster.address=10.0.0.1:6379", "cluster.num_nodes=1"],
                                           registry), tmp_path)


# --- on two nodes ---------------------------------------------------------------------------------------


def grpoctl(cluster, *args, timeout=RUN_TIMEOUT_S):
    """``grpoctl ARGS`` joined to the two-node cluster (its token, loopback addresses)."""
    return run_grpoctl(*args, env=cluster.env, timeout=timeout)


def steps_of(run_dir):
    """Per-step metrics from metrics.jsonl; a step logged twice (a resumed run) keeps its last record."""
    steps = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "loss" in record:
            steps[record["step"]] = record
    return steps


def assert_same_steps(a, b, which):
    assert sorted(a) == sorted(b) and a
    for step in a:
        for key in ("loss", "reward/mean", "grad_norm", "advantages/max"):
            assert abs(a[step][key] - b[step][key]) <= TOLERANCE, (which, step, key, a[step][key], b[step][key])


def test_two_nodes_hold_the_run_and_give_the_one_node_results(tmp_path, two_nodes):
    """2 FSDP2 policy ranks and 2 generation replicas, colocated: bundle i (policy rank i, replica i)
    on node i, as each worker reports from its own process; per-step losses and rewards, and the
    weights after 3 steps, equal those of the same run on one node of the same cluster."""
    args = [*SHORT, "cluster.runtime=ray", f"cluster.address={two_nodes.address}", "cluster.policy_workers=2",
            "cluster.generation_workers=2", "weight_sync.backend=collective"]
    runs = {}
    for n in (2, 1):
        run_dir = tmp_path / f"nodes_{n}"
        result = grpoctl(two_nodes, "run", "--run-dir", run_dir, *args, f"cluster.num_nodes={n}")
        assert result.returncode == 0, result.stderr[-3000:]
        runs[n] = run_dir

    placement = json.loads((runs[2] / "placement.json").read_text())
    head, worker = (n["node_id"] for n in two_nodes.nodes)
    assert placement["num_nodes"] == 2 and placement["nodes"] == [head, worker]  # the driver's node first
    where = {(w["role"], w["index"]): w["node_id"] for w in placement["workers"]}
    assert where[("policy", 0)] == where[("generation", 0)] == head
    assert where[("policy", 1)] == where[("generation", 1)] == worker
    one_node = {w["node_id"] for w in json.loads((runs[1] / "placement.json").read_text())["workers"]
                if w["role"] != "environment"}
    assert len(one_node) == 1

    assert_same_steps(steps_of(runs[2]), steps_of(runs[1]), "2 nodes vs 1")
    weights = [load_file(run / "checkpoints" / "step_3" / "policy" / "model.safetensors") for run in (runs[2], runs[1])]
    assert set(weights[0]) == set(weights[1]) and weights[0]
    for name in weights[0]:
        assert (weights[0][name] - weights[1][name]).abs().max().item() <= TOLERANCE, name


def test_a_local_cluster_is_always_new_never_the_last_cluster_started_on_the_machine(two_nodes):
    """``ray.init()`` without an address joins the cluster named in <ray temp dir>/ray_current_cluster
    (anyone's `ray start`, or this fixture's head for a moment). start_local_cluster must start its
    own: here the file names the two-node cluster, and the process even holds its token."""
    temp = Path(tempfile.mkdtemp(prefix="grpo-ray-", dir="/tmp"))  # short: Ray's socket paths live under it
    try:
        (temp / "ray").mkdir()
        (temp / "ray" / "ray_current_cluster").write_text(two_nodes.address)
        code = ("import json, ray; from grpo_sdk.runtime.local_cluster import start_local_cluster; "
                "c = start_local_cluster(num_cpus=1, include_dashboard=False); "
                "print(json.dumps([c.address, len(ray.nodes())])); c.stop()")
        result = subprocess.run([sys.executable, "-c", code], env={**two_nodes.env, "RAY_TMPDIR": str(temp)},
                                capture_output=True, text=True, timeout=180)
        assert result.returncode == 0, result.stderr[-3000:]
        address, count = json.loads(result.stdout.strip().splitlines()[-1])
        assert address != two_nodes.address and count == 1
    finally:
        shutil.rmtree(temp, ignore_errors=True)


def test_a_lost_node_stops_the_run_naming_it_and_the_run_resumes_when_the_node_is_back(tmp_path, two_nodes):
    """The worker node's raylet is SIGKILLed during step 4: the run stops within seconds (not at a
    deadline) with a WorkerError naming the worker and its node; a resume while the node is gone is
    refused at once, naming cluster.num_nodes; with a new node it continues from step_2 and
    reproduces step 3. Runs after the test above: it kills that test's worker node."""
    run_dir = tmp_path / "run"
    args = ["grpo.max_num_steps=40", "grpo.val_period=0", "grpo.val_at_end=false", "checkpointing.save_period=2",
            "cluster.runtime=ray", f"cluster.address={two_nodes.address}", "cluster.num_nodes=2",
            "cluster.policy_workers=2", "cluster.call_timeout_s=120"]
    lost = two_nodes.nodes[1]
    process = subprocess.Popen([sys.executable, "-m", "grpo_sdk.cli.entry", "run", "--run-dir", str(run_dir), *args],
                               env=grpoctl_env(two_nodes.env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while not ((run_dir / "metrics.jsonl").exists() and 3 in steps_of(run_dir)):
            assert process.poll() is None and time.monotonic() < deadline, "the run ended or stalled before step 3"
            time.sleep(0.05)
        os.kill(lost["raylet_pid"], signal.SIGKILL)
        killed = time.monotonic()
        _, stderr = process.communicate(timeout=120)
        stopped_after = time.monotonic() - killed
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 1, stderr[-3000:]
    error = stderr.strip().splitlines()[-1]
    assert error.startswith("error: policy worker 1 (pid "), stderr[-3000:]
    assert f" on 127.0.0.1 node {lost['node_id'][:8]}) died during " in error
    assert stopped_after < 60, stopped_after  # Ray's health checks (0.5 s here), not call_timeout_s (120 s)
    original = steps_of(run_dir)
    assert max(original) == 3
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("*step_*")) == ["step_2"]  # none partial
    print(f"lost node: stopped {stopped_after:.1f} s after the kill: {error}")

    start = time.monotonic()
    refused = grpoctl(two_nodes, "run", "--resume", run_dir, "grpo.max_num_steps=3", timeout=180)
    assert refused.returncode == 1
    assert time.monotonic() - start < 120  # refused up front: not a wait of cluster.startup_timeout_s (600 s)
    message = refused.stderr.strip().splitlines()[-1]
    assert message.startswith(f"error: cluster.num_nodes=2, but the Ray cluster at {two_nodes.address} has 1 alive "
                              "node(s): "), refused.stderr[-3000:]
    assert f"node {lost['node_id'][:8]} (127.0.0.1, dead)" in message

    added = two_nodes.add_node()
    resumed = grpoctl(two_nodes, "run", "--resume", run_dir, "grpo.max_num_steps=3")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    placement = json.loads((run_dir / "placement.json").read_text())
    assert placement["nodes"] == [two_nodes.nodes[0]["node_id"], added["node_id"]]
    assert_same_steps({3: steps_of(run_dir)[3]}, {3: original[3]}, "resumed vs original")
