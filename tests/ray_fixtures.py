"""One local Ray cluster for the whole test run (each start costs seconds), plus a test-only site.

Import the fixture into a test module (``from ray_fixtures import ray_cluster``). A module that
uses it should skip itself when Ray is not installed: ``pytest.importorskip("ray", reason=...)``.

Ray workers discover components from installed entry points, so a test-only component must be
importable in every worker: ``ray_cluster.site`` is a folder of fake distributions (see
``conftest.FakeSite``) that every worker of the cluster has on its ``PYTHONPATH``. The driver
does not: a test that needs one of them adds the folder to its own ``sys.path``
(``monkeypatch.syspath_prepend``) and discovers a registry then.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import attrs
import pytest

from conftest import FakeSite

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
    from grpo_sdk.runtime.ray_runtime import start_local_cluster

    cluster = None
    if not ray.is_initialized():  # as the runtime starts one: loopback only, token auth, a watchdog
        pythonpath = os.pathsep.join(filter(None, [str(site.root), os.environ.get("PYTHONPATH")]))
        cluster = start_local_cluster(
            num_cpus=8, object_store_memory=300 * 1024 * 1024, include_dashboard=False, logging_level=logging.WARNING,
            runtime_env={"env_vars": {"PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}})
    yield RayCluster(site=site.root)
    if cluster is not None:
        cluster.stop()
