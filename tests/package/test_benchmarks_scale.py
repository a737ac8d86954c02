"""The TRL comparisons and the CLI start-up benchmark run: benchmarks/scale.py (grpo-sdk and the bare
loop here; TRL is not installed in the test venv, so its contender runs only where it is),
benchmarks/trl_side_by_side.py's options, benchmarks/cli_startup.py, and the long-tailed length
workload they build (benchmarks/_common.py)."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
HAVE_TRL = importlib.util.find_spec("trl") is not None
TINY = ["--sizes", "0.1M", "--lengths", "8", "--steps", "1", "--warmup", "0", "--prompts", "2", "--generations", "2"]


def bench(script: str, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, str(BENCH / script), *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)


@pytest.fixture(scope="module")
def common():
    """benchmarks/_common.py as a module, without leaving its process settings behind."""
    import torch

    environ, threads, path = dict(os.environ), torch.get_num_threads(), list(sys.path)
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module("_common")
    finally:
        os.environ.clear()
        os.environ.update(environ)
        torch.set_num_threads(threads)
        sys.path[:] = path
        sys.modules.pop("_common", None)


def test_the_built_model_emits_eos_at_the_asked_rate(common, tmp_path):
    """The long-tailed workload: EOS with probability p at every step, so lengths are geometric."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    params = common.build_model(tmp_path, hidden=64, layers=2, intermediate=176, heads=2, eos_probability=0.1)
    assert 100_000 < params < 200_000
    model = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    eos = AutoTokenizer.from_pretrained(tmp_path).eos_token_id
    ids = torch.randint(3, 384, (4, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        p_eos = torch.softmax(model(input_ids=ids).logits, -1)[..., eos]
    assert abs(p_eos.mean().item() - 0.1) < 0.01 and p_eos.std().item() < 0.03  # every position, not on average
    prompt = torch.full((256, 3), 5)
    tokens = common.bare_sample(model, prompt, torch.ones_like(prompt), 200, torch.Generator().manual_seed(0),
                                "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values",
                                eos)
    lengths = [int((row == eos).nonzero()[0]) + 1 if (row == eos).any() else 200 for row in tokens]
    assert 8 < statistics.mean(lengths) < 12.5  # geometric, mean 1/p = 10
    assert statistics.median(lengths) < statistics.mean(lengths) < max(lengths) / 3  # a long tail
    assert tokens.shape[1] == max(lengths)  # stopped when every row had sampled EOS


def test_scale_runs_grpo_sdk_and_the_bare_loop(tmp_path):
    proc = bench("scale.py", *TINY, "--contenders", "grpo-sdk,bare", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    [cell] = summary["cells"]
    assert (cell["size"], cell["new_tokens"]) == ("0.1M", 8) and 100_000 < cell["parameters"] < 200_000
    assert set(cell["results"]) == {"grpo-sdk", "bare"}
    for name, result in cell["results"].items():
        assert result["step_s"] > 0 and result["tokens_per_s"] > 0, name
        assert 100 < result["rss_ready_mb"] <= result["peak_rss_mb"] < 4000, name
        assert 1 <= result["lengths"]["median"] <= result["lengths"]["max"] <= 8, name
        assert len(result["step_times"]) == 1
        assert result["lengths_match"] is True, name  # decoded the drawn lengths (issue 35 item 6)
    assert cell["grpo_over_bare_step"] == pytest.approx(cell["results"]["grpo-sdk"]["step_s"] /
                                                        cell["results"]["bare"]["step_s"])
    assert cell["grpo_over_trl_step"] is None and cell["grpo_over_trl_peak_rss"] is None
    assert summary["grpo_overrides"] == [] and summary["load_avg_before"] >= 0 and summary["fixed_lengths"] is True


def test_fixed_lengths_are_drawn_once_from_the_seed(common):
    table = common.fixed_lengths(0, 4.0, 10, steps=3, rows=64)
    assert table == common.fixed_lengths(0, 4.0, 10, steps=3, rows=64) != common.fixed_lengths(1, 4.0, 10, 3, 64)
    lengths = [n for row in table for n in row]
    assert len(table) == 3 and min(lengths) >= 1 and max(lengths) == 10  # geometric, capped
    assert 3 < statistics.mean(lengths) < 5


def test_force_lengths_makes_hf_generate_decode_the_given_lengths(common, tmp_path):
    """TRL's rollouts are HF generate: the processor forces each row's EOS at its length, never before."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessorList

    common.build_model(tmp_path, hidden=64, layers=2, intermediate=176, heads=2, eos_probability=0.3)
    model = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    tok = AutoTokenizer.from_pretrained(tmp_path)
    lengths = [1, 7, 3, 12]
    prompt = torch.full((4, 3), 5)
    out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), do_sample=True, max_new_tokens=16,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                         logits_processor=LogitsProcessorList([common.ForceLengths(lengths, 3, tok.eos_token_id)]))
    completion = out[:, 3:]
    assert completion.shape[1] == max(lengths)
    assert [int((row == tok.eos_token_id).nonzero()[0]) + 1 for row in completion] == lengths


def test_scale_passes_grpo_overrides_to_grpo_sdk():
    """--grpo-override reaches grpo-sdk's config: a wrong key fails its worker, named, exit 1."""
    proc = bench("scale.py", *TINY, "--contenders", "grpo-sdk", "--grpo-override", "policy.no_such_option=1")
    assert proc.returncode == 1
    assert proc.stderr.startswith("error: worker grpo-sdk exited") and "no_such_option" in proc.stderr


@pytest.mark.parametrize("args, message", [
    (["--sizes", "3M"], "--sizes: unknown 3M"),
    (["--contenders", "grpo-sdk,vllm"], "--contenders: unknown vllm"),
    (["--lengths", "8,x"], "--lengths must be comma-separated integers"),
    (["--grpo-override", "policy.lr"], "--grpo-override takes KEY=VALUE"),
    (["--steps", "0"], "--steps >= 1"),
])
def test_scale_bad_options_exit_2_with_the_reason(args, message):
    proc = bench("scale.py", "--contenders", "grpo-sdk", *args, timeout=60)  # args last: they win
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


@pytest.mark.skipif(HAVE_TRL, reason="TRL is installed here: the contender runs (test below)")
def test_scale_without_trl_says_how_to_run():
    proc = bench("scale.py", "--quick", timeout=60)
    assert proc.returncode == 2 and "TRL is not installed" in proc.stderr and "--contenders grpo-sdk,bare" in proc.stderr


@pytest.mark.skipif(not HAVE_TRL, reason="TRL is not installed in this venv (the bench venv has it: docs/benchmarks.md)")
def test_scale_runs_trl_too():
    proc = bench("scale.py", *TINY, "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    [cell] = json.loads(proc.stdout)["cells"]
    assert set(cell["results"]) == {"grpo-sdk", "trl", "bare"} and cell["grpo_over_trl_step"] > 0
    assert all(r["lengths_match"] for r in cell["results"].values())  # TRL too, through ForceLengths
    assert cell["grpo_over_trl_paired"]["spread"] >= 0


def test_trl_side_by_side_help_runs_without_trl():
    proc = bench("trl_side_by_side.py", "--help", timeout=60)
    assert proc.returncode == 0 and "--no-compile" in proc.stdout, proc.stderr


def test_cli_startup_times_the_three_commands():
    proc = bench("cli_startup.py", "--rounds", "1", "--warmup", "0", "--top", "3", "--json", timeout=120)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert set(summary["median_s"]) == {"grpoctl --help", "grpoctl --version", "python -c 'import grpo_sdk'"}
    assert all(0 < t < 30 for t in summary["median_s"].values())
    assert summary["torch_imported"] is False and summary["modules_imported"] > 50
    assert len(summary["imports_cumulative_us"]) == 3 and summary["help_target_met"] in (True, False)
