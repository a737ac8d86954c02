"""One local Ray cluster for the whole test run (each start costs seconds), plus a test-only site;
and a two-node cluster on loopback for the multi-node tests (``two_nodes``).

tests/conftest.py imports both fixtures, so every module shares one definition: a module that imported
them itself would get a ``ray_cluster`` of its own, whose site no worker of the already running
cluster sees. A module that uses them should skip itself when Ray is not installed:
``pytest.importorskip("ray", reason=...)``.

Ray workers discover components from installed entry points, so a test-only component must be
importable in every worker: ``ray_cluster.site`` is a folder of fake distributions (see
``helpers.FakeSite``) that every worker of the cluster has on its ``PYTHONPATH``. The driver
does not: a test that needs one of them adds the folder to its own ``sys.path``
(``monkeypatch.syspath_prepend``) and discovers a registry then.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import select
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

from helpers import FakeSite

STALL_ENV = '''
import os, time

from grpo_sdk.environments.reverse_digits import ReverseDigitsEnvironment
from grpo_sdk.plugins import ComponentSpec

SPEC = ComponentSpec(name="stall_digits", kind="environment", impl="grpo_test_stall_env:StallDigits",
                     capabilities={"generates_prompts"}, summary="reverse_digits that hangs on its second step")


class StallDigits(ReverseDigitsEnvironment):
    """reverse_digits whose second step() call sleeps for a minute: a stuck environment worker."""

    def __init__(self, config, context):
        super().__init__(None, context)
        self.calls = 0

    def step(self, message_logs, metadata):
        self.calls += 1
        if self.calls == 2:
            time.sleep(60)
        return super().step(message_logs, metadata)
'''


SLOW_HF = '''
import time

from grpo_sdk.backends.hf.generation import HFGeneration
from grpo_sdk.plugins import ComponentSpec

SPEC = ComponentSpec(name="slow-hf", kind="generation", impl="grpo_test_slow_hf:SlowHF",
                     config="grpo_sdk.backends.hf.config:HFGenerationConfig",
                     capabilities={"in_flight_weight_updates"}, summary="hf with 30 ms between decode steps")


class SlowHF(HFGeneration):
    """hf generation that pauses 30 ms between decode steps, as a bigger model would take: a
    weight update then lands in flight at all on the tiny model."""

    def _between_decode_steps(self, next_token):
        time.sleep(0.03)
'''


COUNT_TURNS = '''
from grpo_sdk.environments.reverse_digits import ReverseDigitsEnvironment
from grpo_sdk.plugins import ComponentSpec, EnvironmentReturn, Message

SPEC = ComponentSpec(name="count_turns", kind="environment", impl="grpo_test_count_turns:CountTurns",
                     capabilities={"generates_prompts", "multi_turn"},
                     summary="multi-turn: answers turn k with '=k>' for three turns")


class CountTurns(ReverseDigitsEnvironment):
    """Three turns an episode: turn k is answered "=k>"; each turn scores its digit count / 10 plus,
    on the last, reverse_digits' reward of that turn. The turn count travels in the metadata."""

    def step(self, message_logs, metadata):
        scored = super().step(message_logs, metadata).rewards["correct_digits"]
        turns = [m.get("turn", 0) + 1 for m in metadata]
        return EnvironmentReturn(
            rewards={"digits": [sum(c.isdigit() for c in log[-1].content) / 10 + (s if t == 3 else 0.0)
                                for log, s, t in zip(message_logs, scored, turns)]},
            done=[t >= 3 for t in turns], observations=[Message(role="tool", content=f"={t}>") for t in turns],
            metadata=[{**m, "turn": t} for m, t in zip(metadata, turns)],
            metrics={"turn": sum(turns) / len(turns)})
'''


@attrs.frozen
class RayCluster:
    site: Path  # on every worker's PYTHONPATH, not on the driver's sys.path


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory: pytest.TempPathFactory):
    ray = pytest.importorskip("ray", reason="the Ray runtime needs ray: pip install 'grpo-sdk[ray]'")
    site = FakeSite(tmp_path_factory.mktemp("ray_site"))
    site.add("grpo-test-stall-env",
             entry_points={"grpo_sdk.environments": {"stall_digits": "grpo_test_stall_env:SPEC"}},
             files={"grpo_test_stall_env.py": STALL_ENV})
    site.add("grpo-test-count-turns",
             entry_points={"grpo_sdk.environments": {"count_turns": "grpo_test_count_turns:SPEC"}},
             files={"grpo_test_count_turns.py": COUNT_TURNS})
    site.add("grpo-test-slow-hf", entry_points={"grpo_sdk.generation": {"slow-hf": "grpo_test_slow_hf:SPEC"}},
             files={"grpo_test_slow_hf.py": SLOW_HF})
    from grpo_sdk.runtime.local_cluster import start_local_cluster

    cluster = None
    if not ray.is_initialized():  # as the runtime starts one: loopback only, token auth, a watchdog
        pythonpath = os.pathsep.join(filter(None, [str(site.root), os.environ.get("PYTHONPATH")]))
        cluster = start_local_cluster(
            num_cpus=8, object_store_memory=300 * 1024 * 1024, include_dashboard=False, logging_level=logging.WARNING,
            runtime_env={"env_vars": {"PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}})
    yield RayCluster(site=site.root)
    if cluster is not None:
        cluster.stop()


TWO_NODE_START_S = 120  # a node starts in ~2 s here, alone; minutes would mean it never will
TWO_NODE_STOP_S = 60


@attrs.define
class TwoNodes:
    """A two-node Ray cluster on 127.0.0.1, run by ``two_node_cluster.py`` in a process of its own."""

    address: str
    nodes: list[dict]  # {"node_id", "raylet_pid", "head"}, head first
    env: dict[str, str]  # for a process that joins it (grpoctl): its token, loopback addresses
    process: subprocess.Popen

    def add_node(self) -> dict:
        """Another worker node like the first (after a test killed one)."""
        self.process.stdin.write("add\n")
        self.process.stdin.flush()
        node = json.loads(_line_within(self.process, TWO_NODE_START_S))
        self.nodes.append(node)
        return node


def _line_within(process: subprocess.Popen, timeout: float) -> str:
    ready, _, _ = select.select([process.stdout], [], [], timeout)
    line = process.stdout.readline() if ready else ""
    if not line:
        raise RuntimeError(f"the two-node Ray cluster did not answer within {timeout:g} s "
                           f"(exit code {process.poll()}); see the test's captured stderr")
    return line


@pytest.fixture(scope="module")
def two_nodes():
    """Head node and one worker node, 3 logical CPUs each, on loopback, with a token of their own:
    a process of its own (this one may already be connected to ``ray_cluster``), stopped however the
    tests end; if this process dies, the helper sees its stdin close and stops the nodes."""
    pytest.importorskip("ray", reason="the Ray runtime needs ray: pip install 'grpo-sdk[ray]'")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",  # Ray's loopback-only switch: every node on 127.0.0.1
               RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32),
               OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    process = subprocess.Popen([sys.executable, str(Path(__file__).with_name("two_node_cluster.py")), "3"],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        info = json.loads(_line_within(process, TWO_NODE_START_S))
        yield TwoNodes(address=info["address"], nodes=info["nodes"], env=env, process=process)
    finally:
        process.stdin.close()
        try:
            process.wait(timeout=TWO_NODE_STOP_S)
        except subprocess.TimeoutExpired:
            process.kill()  # its watchdogs see it gone and kill the nodes
            process.wait(timeout=10)
