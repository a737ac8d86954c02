"""benchmarks/sampler.py (issue 35 items 6-7) runs its contenders on fixed lengths: --quick on the tiny
0.1M model in seconds, each contender decoding exactly the drawn per-row lengths."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"


def sampler(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, str(BENCH / "sampler.py"), *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)


def test_quick_alternates_today_and_new_on_the_drawn_lengths():
    proc = sampler("--quick", "--restarts", "2", "--json")  # two sets of processes, 2 calls each
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    assert summary["rows"] == 4 and len(summary["lengths"]) == 4
    assert all(1 <= n <= 16 for n in summary["lengths"]) and summary["lengths_origin"].startswith("geometric")
    assert set(summary["results"]) == {"today", "new"}
    for name, r in summary["results"].items():
        assert r["lengths_match"] is True, name  # every call decoded exactly the drawn lengths
        assert len(r["seconds"]) == 4 and r["seconds_min"] <= r["seconds_median"] <= r["seconds_max"], name
        assert r["tokens_per_s"] > 0 and r["threads"] == 1 and 100 < r["peak_rss_mb"] < 4000, name
    # the whole-batch loop: one decode forward per token of the longest row after the first
    assert summary["results"]["today"]["split_median_s"]["decode_steps"] == max(summary["lengths"]) - 1
    ratio = summary["ratios"]["new/today_time"]
    assert ratio["min"] <= ratio["median"] <= ratio["max"] and ratio["spread"] >= 0 and summary["restarts"] == 2
    assert "new/vllm_time" not in summary["ratios"] and len(summary["load_avg_before"]) == 3


def test_natural_lengths_are_the_models_own_and_can_be_replayed(tmp_path):
    proc = sampler("--quick", "--contenders", "today", "--lengths", "natural", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    first = json.loads(proc.stdout)
    assert first["lengths_origin"].startswith("natural") and first["results"]["today"]["lengths_match"]
    saved = tmp_path / "lengths.json"
    saved.write_text(json.dumps(first["lengths"]))
    proc = sampler("--quick", "--contenders", "new", "--lengths", f"file:{saved}", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    again = json.loads(proc.stdout)
    assert again["lengths"] == first["lengths"] and again["results"]["new"]["lengths_match"]


def test_the_eager_attention_contender_decodes_the_same_lengths_and_is_paired_with_new():
    proc = sampler("--quick", "--contenders", "new,new-eager", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    assert set(summary["results"]) == {"new", "new-eager"}
    assert all(r["lengths_match"] is True for r in summary["results"].values())
    ratio = summary["ratios"]["new-eager/new_time"]
    assert ratio["min"] <= ratio["median"] <= ratio["max"]


@pytest.mark.parametrize("args, message", [
    (["--lengths", "uniform:3"], "--lengths takes natural"),
    (["--contenders", "today,trl"], "--contenders: unknown trl"),
    (["--contenders", "vllm", "--vllm-python", "/nonexistent/python"], "no vLLM python at /nonexistent/python"),
])
def test_bad_options_exit_2_with_the_reason(args, message):
    proc = sampler("--quick", *args, timeout=60)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
