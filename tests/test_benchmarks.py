"""The benchmark scripts run: benchmarks/async_vs_sync.py with tiny settings prints its table, and
the environments it trains on behave as documented (benchmarks/async_envs.py)."""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from grpo_sdk.core.records import Message
from grpo_sdk.environments.reverse_digits import ReverseDigitsEnvironment

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"


@pytest.fixture(scope="module")
def async_envs():
    sys.path.insert(0, str(BENCH))
    try:
        import async_envs

        yield async_envs
    finally:
        sys.path.remove(str(BENCH))


def bench(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, str(BENCH / "async_vs_sync.py"), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)


def test_async_vs_sync_prints_the_table():
    start = time.perf_counter()
    proc = bench("--scenarios", "b", "--rounds", "1", "--steps", "3", "--contenders", "sync", "async A=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "(b) 0.2 s per scoring call" in out and "samples/s" in out and "x sync" in out
    rows = {m.group(1): m for m in re.finditer(r"^(sync|async A=1)\s+([\d.]+)\s+([\d.]+) \(", out, re.MULTILINE)}
    assert set(rows) == {"sync", "async A=1"}, out
    assert float(rows["sync"].group(3)) == 1.0
    sync, asyn = float(rows["sync"].group(2)), float(rows["async A=1"].group(2))
    assert sync > 0 and asyn > 0
    # 128 rows per step behind a 0.2 s judge: a step cannot take less than the sleep
    assert sync < 128 / 0.2 and asyn < 128 / 0.2
    ratio = re.search(r"^async A=1: samples/s x([\d.]+) of sync", out, re.MULTILINE)
    assert ratio and abs(float(ratio.group(1)) - asyn / sync) < 0.02
    assert re.search(r"load avg \d", out)
    assert time.perf_counter() - start < 60


def test_bad_options_exit_2_with_the_reason():
    proc = bench("--steps", "1", timeout=60)
    assert proc.returncode == 2 and "--steps must be at least 3" in proc.stderr
    proc = bench("--contenders", "async A=1", timeout=60)
    assert proc.returncode == 2 and "must include sync" in proc.stderr


def log(answer: str) -> list[Message]:
    return [Message(role="user", content="12>"), Message(role="assistant", content=answer)]


def test_slow_reverse_digits_sleeps_then_scores_as_reverse_digits(async_envs):
    env = async_envs.SlowReverseDigits(async_envs.SlowReverseDigitsConfig(latency_s=0.2), None)
    plain = ReverseDigitsEnvironment(None, None)
    prompts = env.sample_prompts(4, random.Random(3))
    assert prompts == plain.sample_prompts(4, random.Random(3))
    metadata = [m for _, m in prompts]
    logs = [log(metadata[0]["target"]), log("0"), log(""), log(metadata[3]["target"][:2] + "9999")]
    start = time.perf_counter()
    got = env.step(logs, metadata)
    assert time.perf_counter() - start >= 0.2
    assert got.rewards == plain.step(logs, metadata).rewards


def test_longtail_lengths_have_a_tail(async_envs):
    cfg = async_envs.LongTailConfig(min_digits=2, max_digits=40, alpha=1.2)
    env = async_envs.LongTailReverse(cfg, None)
    lengths = [len(m["target"]) for _, m in env.sample_prompts(4000, random.Random(0))]
    assert min(lengths) == 2 and max(lengths) == 40
    assert sorted(lengths)[len(lengths) // 2] <= 4  # the median prompt is short
    assert 0.01 < sum(n >= 20 for n in lengths) / len(lengths) < 0.1  # a few are ten times longer
    prompt, meta = env.sample_prompts(1, random.Random(1))[0]
    assert prompt == meta["target"][::-1] + ">"
    got = env.step([log(meta["target"]), log("x")], [meta, meta])
    assert got.rewards["correct_digits"][0] == 1.0 and got.rewards["correct_digits"][1] < 1.0
    assert got.metrics["exact_match"] == 0.5 and got.metrics["length_max"] == len(meta["target"])
