"""The benchmark scripts run: benchmarks/async_vs_sync.py with tiny settings prints its table, and
the environments it trains on behave as documented (benchmarks/async_envs.py)."""

from __future__ import annotations

import math
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

ROOT = Path(__file__).resolve().parents[2]
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
    rows = {m.group(1): m for m in re.finditer(r"^(sync|async A=1)\s+([\d.]+)\s+([\d.]+) \(.*$", out, re.MULTILINE)}
    assert set(rows) == {"sync", "async A=1"}, out
    assert float(rows["sync"].group(3)) == 1.0
    sync, asyn = float(rows["sync"].group(2)), float(rows["async A=1"].group(2))
    assert sync > 0 and asyn > 0
    # 128 rows per step behind a 0.2 s judge: a step cannot take less than the sleep
    assert sync < 128 / 0.2 and asyn < 128 / 0.2
    ratio = re.search(r"^async A=1: samples/s x([\d.]+) of sync", out, re.MULTILINE)
    assert ratio and abs(float(ratio.group(1)) - asyn / sync) < 0.02
    # the reward curve: 3 steps give checkpoints at steps 1, 2, 3 (25% rounds to 1, 75% to 2)
    assert re.search(r"^contender\s+128 rows \(1 steps\)\s+256 rows \(2 steps\)\s+384 rows \(3 steps\)$", out,
                     re.MULTILINE), out
    final = {c: re.search(r"([\d.]+) \([\d.]+\)\s*$", m.group(0)).group(1) for c, m in rows.items()}
    curve = {m.group(1): m.group(2) for m in re.finditer(r"^(sync|async A=1)(?:\s+[\d.]+ \([\d.]+\)){2}\s+([\d.]+) "
                                                          r"\([\d.]+\)$", out, re.MULTILINE)}
    assert set(curve) == {"sync", "async A=1"} and curve == final, out  # 100% of the samples is the final reward
    assert "async A=1 - sync: " in out and "one round: no seed spread" in out
    assert re.search(r"load avg \d", out)
    assert time.perf_counter() - start < 60


def test_bad_options_exit_2_with_the_reason():
    proc = bench("--steps", "1", timeout=60)
    assert proc.returncode == 2 and "--steps must be at least 3" in proc.stderr
    proc = bench("--contenders", "async A=1", timeout=60)
    assert proc.returncode == 2 and "must include sync" in proc.stderr
    proc = bench("--seed", "41", timeout=60)
    assert proc.returncode == 2 and "--seed must be at least 42" in proc.stderr


@pytest.fixture(scope="module")
def script():
    """benchmarks/async_vs_sync.py as a module, without leaving its process settings behind."""
    import importlib

    import torch

    environ, threads, path = dict(os.environ), torch.get_num_threads(), list(sys.path)
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module("async_vs_sync")
    finally:
        os.environ.clear()
        os.environ.update(environ)
        torch.set_num_threads(threads)
        sys.path[:] = path
        sys.modules.pop("async_vs_sync", None)


def synthetic_run(script, contender: str, round_: int, rewards: list[float]):
    run = script.Run(contender, round_, rows=128)
    run.metrics = [{"reward/mean": r} for r in rewards]
    run.times = [float(i) for i in range(len(rewards))]
    return run


def test_reward_curve_checkpoints_and_noise(script, capsys):
    assert script.checkpoints(200) == [50, 100, 150, 200]
    assert script.checkpoints(3) == [1, 2, 3]
    ramp = synthetic_run(script, "sync", 0, [0.1 * i for i in range(30)])
    assert ramp.trailing_reward(3) == pytest.approx(0.1)  # fewer than WINDOW steps: the ones there are
    assert ramp.trailing_reward(30) == pytest.approx(2.45)  # steps 21-30 only
    assert ramp.final_reward() == ramp.trailing_reward(30)
    # sync: one constant reward per seed (0.1, 0.2, 0.3); async 0.1 above it for 20 steps (inside the
    # seed noise: SE 0.082), then 0.5 above (outside); the window at step 20 still sees only the first part
    sync = [synthetic_run(script, "sync", r, [0.1 * (r + 1)] * 40) for r in range(3)]
    asyn = [synthetic_run(script, "async A=1", r, [0.1 * (r + 2)] * 20 + [0.1 * (r + 1) + 0.5] * 20)
            for r in range(3)]
    diff, se = script.difference(asyn, sync, 20)
    assert diff == pytest.approx(0.1) and se == pytest.approx((0.01 / 3 * 2) ** 0.5)
    assert script.difference(asyn, sync, 30)[0] == pytest.approx(0.5)
    assert math.isnan(script.difference(asyn[:1], sync[:1], 20)[1])
    script.report_curve({"sync": sync, "async A=1": asyn})
    out = capsys.readouterr().out
    assert re.search(r"^sync\s+0\.200 \(0\.100 0\.200 0\.300\)", out, re.MULTILINE), out
    assert re.search(r"^async A=1 .* 0\.700 \(0\.600 0\.700 0\.800\)$", out, re.MULTILINE), out
    assert "async A=1 - sync: +0.100 +/- 0.082, +0.100 +/- 0.082, +0.500 +/- 0.082, +0.500 +/- 0.082" in out
    assert "within noise (|diff| <= 2 SE) at 2 of 4" in out


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


def test_longtail_repeat_prompts_one_digit_and_its_judge_sleeps(async_envs):
    cfg = async_envs.LongTailConfig(min_digits=2, max_digits=40, alpha=1.2)
    prompts = async_envs.LongTailRepeat(cfg, None).sample_prompts(500, random.Random(0))
    assert all(p == m["target"] + ">" and len(set(m["target"])) == 1 for p, m in prompts)
    lengths = [len(m["target"]) for _, m in prompts]
    assert min(lengths) == 2 and max(lengths) >= 20  # the same Pareto lengths as longtail_reverse
    fixed = async_envs.LongTailRepeat(async_envs.LongTailConfig(min_digits=5, max_digits=5, latency_s=0.2), None)
    meta = [m for _, m in fixed.sample_prompts(2, random.Random(1))]
    assert [len(m["target"]) for m in meta] == [5, 5]
    start = time.perf_counter()
    got = fixed.step([log(meta[0]["target"]), log(meta[1]["target"][:4])], meta)
    assert time.perf_counter() - start >= 0.2
    assert got.rewards["correct_digits"] == [1.0, 0.8]


def test_endpoint_overhead_prints_the_table():
    """benchmarks/endpoint_overhead.py, one round of 16 rollouts: every contender plays, and the counts add up."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(BENCH / "endpoint_overhead.py"), "--repeats", "1", "--rollouts", "16"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert re.search(r"load avg \d", out) and "1 prompts x 16 = 16 rollouts" in out
    number = r"\s+([\d.,]+)"
    rows = {m.group(1): [float(v.replace(",", "")) for v in m.groups()[1:]]
            for m in re.finditer(r"^(\(\w+\) .+?)" + number * 7 + "$", out, re.MULTILINE)}
    assert list(rows) == ["(a) in-process", "(b) endpoint, urllib", "(c) endpoint, openai",
                          "(c1) openai, a client per rollout", "(d) Endpoint.chat, fake engine"], out
    for name, (wall, ratio, cpu, turns, per_s, calls, inside) in rows.items():
        assert wall > 0 and 16 <= turns <= 48, (name, out)  # every rollout plays 1-3 turns
        assert inside <= wall
    assert rows["(a) in-process"][1] == 1.0
    assert 1 <= rows["(a) in-process"][5] <= 3  # one generate call per turn
    for name in list(rows)[1:4]:
        assert rows[name][5] >= 1  # batched: at most one call per request
        assert rows[name][5] <= rows[name][3]
    assert rows["(d) Endpoint.chat, fake engine"][3] == 48 and rows["(d) Endpoint.chat, fake engine"][5] == 0
    assert re.search(r"^\(d\) the endpoint's own cost per request .*: \d+ us$", out, re.MULTILINE), out
    assert "the openai client over urllib, (c) - (b):" in out
    probes = re.findall(r"^  (\S.*?)\s+([\d.]+) ms wall\s+([\d.]+) ms CPU$", out, re.MULTILINE)
    assert [p[0] for p in probes] == ["urllib, a connection per request", "openai over one keep-alive httpx client",
                                      "openai, the same, server without TCP_NODELAY",
                                      "building an httpx.Client (its TLS context)",
                                      "Endpoint.chat, no HTTP"], out


def test_env_concurrency_prints_one_row_per_contender():
    """benchmarks/env_concurrency.py, 3 steps a run: the four contenders train and are timed."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(BENCH / "env_concurrency.py"), "--steps", "3", "--skip", "1"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = dict(re.findall(r"^\s*((?:sync|async A=1) calls=\d+)\s+([\d.]+)\s+[\d.]+$", proc.stdout, re.MULTILINE))
    assert list(rows) == ["sync calls=0", "async A=1 calls=0", "sync calls=8", "async A=1 calls=8"], proc.stdout
    assert all(float(step) >= 0.2 for step in rows.values())  # a step waits for at least one 0.2 s call


def test_endpoint_overhead_bad_options_exit_2():
    proc = subprocess.run([sys.executable, str(BENCH / "endpoint_overhead.py"), "--rollouts", "20"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2 and "--rollouts must be a positive multiple of 16" in proc.stderr


def test_the_gpu_checks_import_on_a_machine_without_a_gpu():
    """The GPU checks cannot run here, but each must at least import (names, helpers shared through
    check_vllm / grpo_runs), so a maintainer with a GPU does not meet a NameError first."""
    checks = sorted(p.stem for p in (BENCH / "gpu").glob("*.py"))
    assert {"check_sglang", "check_trtllm", "check_dynamo", "grpo_runs"} <= set(checks)
    code = f"import sys; sys.path.insert(0, {str(BENCH / 'gpu')!r}); " + "; ".join(f"import {c}" for c in checks)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_hf_memory_prints_both_peaks_and_the_ratios():
    """benchmarks/hf_memory.py with a tiny model, one round: every contender runs in its own process."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(BENCH / "hf_memory.py"), "--tiny", "--rounds", "1"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    peaks = re.search(r"peak RSS median: shared ([\d.]+) MB, copy ([\d.]+) MB, shared/copy ([\d.]+)", out)
    assert peaks and float(peaks.group(1)) > 0 and abs(float(peaks.group(1)) / float(peaks.group(2))
                                                        - float(peaks.group(3))) < 1e-3, out
    for variant in ("checkpointing", "autocast"):
        assert re.search(rf"^{variant} vs plain: step memory .* MB \([\d.-]+x\), step time .* s \([\d.]+x\)$", out,
                         re.MULTILINE), out


def test_sampler_waste_splits_a_rollout_and_measures_the_decode_waste():
    recipe = ROOT / "src" / "grpo_sdk" / "recipes" / "tiny_reverse.yaml"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, str(BENCH / "sampler_waste.py"), "-c", str(recipe), "--rounds", "2",
                          "grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=180, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    rounds = re.findall(r"round \d: rows 16, .* decode waste (\d\.\d\d); wall ([\d.]+) s = prefill ([\d.]+) \+ decode "
                        r"forwards ([\d.]+) \((\d+) steps", out.stdout)
    assert len(rounds) == 2, out.stdout
    for waste, wall, prefill, decode, steps in rounds:
        assert 0 <= float(waste) < 1 and float(prefill) + float(decode) <= float(wall) and int(steps) >= 1
    bad = subprocess.run([sys.executable, str(BENCH / "sampler_waste.py"), "-c", str(recipe), "grpo.nope=1"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert bad.returncode == 2 and "grpo.nope" in bad.stderr and "Traceback" not in bad.stderr
