"""benchmarks/gpu/check_hf.py (issue 42 item 1): its CPU smoke run (--tiny) passes every implemented check.

The --tiny run is the script's own smoke test on the built-in tiny Llama, not a GPU measurement: it
shows the checks run and can pass here (each carries a control that would fail if the weights never
reached the sampler), not that they pass at real size on CUDA. The not-yet-implemented checks must
say SKIP, never PASS.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu" / "check_hf.py"
IMPLEMENTED = ["logprobs", "grpo_inprocess", "shared_vs_copy", "bf16_checkpointing", "lora_merged", "sigkill_resume"]
NOT_IMPLEMENTED = ["cuda_ipc", "collective", "packing", "async_a1", "trl"]


def _check_hf(*args: str, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
def test_tiny_run_passes_every_implemented_check(tmp_path):
    pytest.importorskip("peft")
    result = _check_hf("--tiny", "--json", "--out", str(tmp_path / "out"), cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    checks = report["checks"]
    assert [name for name in checks if name in IMPLEMENTED] == IMPLEMENTED  # all ran, in this order
    assert {name: checks[name]["status"] for name in IMPLEMENTED} == dict.fromkeys(IMPLEMENTED, "PASS")
    assert {name: checks[name]["status"] for name in NOT_IMPLEMENTED} == dict.fromkeys(NOT_IMPLEMENTED, "SKIP")
    assert report["failures"] == [] and report["complete"] and report["device"] == "cpu" and report["size"] == "tiny"
    for name in IMPLEMENTED:
        assert f"PASS  {name}: " in result.stdout
        assert checks[name]["wall_s"] > 0
    # the figures each check records
    inprocess = checks["grpo_inprocess"]
    assert inprocess["weight_versions"] == [0, 1, 2, 3, 4]
    assert all(abs(e - 1) <= 2e-3 for e in inprocess["token_mult_prob_error"])
    assert inprocess["drift_from_initial"] > 1 + 2e-3  # the control: the weights the sampler got had moved
    assert len(inprocess["step_s"]) == 5 and all(t > 0 for t in inprocess["tokens_per_s"])
    assert inprocess["peak_rss_mib"] > 0
    assert checks["logprobs"]["bf16_autocast"]["vs_float32_policy"] > 1  # bf16 autocast did run
    assert checks["lora_merged"]["drift_from_initial"] > 1 + 2e-3
    # --out: the JSON and the log, as run_all.sh's results
    saved = json.loads((tmp_path / "out" / "check_hf.json").read_text())
    assert saved["checks"].keys() == checks.keys()
    assert "PASS  sigkill_resume" in (tmp_path / "out" / "check_hf.log").read_text()


def test_without_cuda_the_real_size_run_is_refused_with_exit_2(tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the real-size run would start")
    result = _check_hf("--json", str(tmp_path / "r.json"), cwd=tmp_path, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "refused: no CUDA device" in result.stdout and "--tiny" in result.stdout
    assert "Traceback" not in result.stderr


BROKEN_SYNC = """
import runpy, sys
from grpo_sdk.weight_sync import inprocess

real = inprocess.InProcessWeightSync.sync_weights


class SendsNothing:  # the generation keeps its old weights; only the version moves
    def named_weights(self):
        return iter(())


inprocess.InProcessWeightSync.sync_weights = lambda self, policy, gen, *, version: real(self, SendsNothing(), gen,
                                                                                         version=version)
sys.argv = [sys.argv[1], "--tiny", "--only", "grpo_inprocess", "--json"]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_a_sync_that_sends_no_weights_fails_the_inprocess_check(tmp_path):
    """The negative control: the check can fail. A sync that only moves the version number (a FAKE, made
    here) leaves the sampler on the initial weights: the control and token_mult_prob_error both catch it."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-c", BROKEN_SYNC, str(SCRIPT)], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    check = report["checks"]["grpo_inprocess"]
    assert check["status"] == "FAIL" and report["failures"] == ["grpo_inprocess"]
    assert abs(check["drift_from_initial"] - 1) < 2e-3  # the sampler never left the initial weights
    assert max(check["token_mult_prob_error"]) > 1 + 2e-3  # and disagrees with the trained policy
    assert list(report["checks"]) == ["grpo_inprocess"]  # --only: no other check, no SKIP lines
