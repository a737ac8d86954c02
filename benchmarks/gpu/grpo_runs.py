"""The GRPO-run check the engine GPU checks share: a short ``grpoctl run`` and what its metrics must say.

A synchronous run samples every step with the weights of the step before, so each step's
``token_mult_prob_error`` is within 2e-3 of 1 (the engine's processed logprobs agree with the hf
policy's) and ``generation/weight_version`` counts 0, 1, 2, ... An async run (``grpo.async_grpo``)
trains on rollouts up to a step old, so the policy's logprobs differ from the sampler's by that
staleness: there only the run finishing all its steps is required (its metrics are printed).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from check_vllm import check

STEPS = 5


def grpo_run(run: Path, common: list[str], extra: list[str]) -> tuple[subprocess.CompletedProcess, list[dict]]:
    result = subprocess.run([sys.executable, "-m", "grpo_sdk.cli.entry", "run", "--run-dir", str(run),
                             f"grpo.max_num_steps={STEPS}", *common, *extra], capture_output=True, text=True)
    metrics = run / "metrics.jsonl"
    rows = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
    return result, rows


def check_run(label: str, run: Path, common: list[str], extra: list[str], failures: list[str]) -> None:
    start = time.time()
    result, rows = grpo_run(run, common, extra)
    if result.returncode != 0:
        check(label, False, result.stderr[-2000:], failures)
        return
    errors = [r["token_mult_prob_error"] for r in rows]
    versions = [r["generation/weight_version"] for r in rows]
    synchronous = "grpo.async_grpo.enabled=true" not in extra
    ok = len(rows) == STEPS and (not synchronous or (max(abs(e - 1) for e in errors) < 2e-3
                                                     and versions == list(range(STEPS))))
    check(label, ok, f"token_mult_prob_error {[round(e, 5) for e in errors]}, versions {versions}, "
                     f"step time {(time.time() - start) / max(len(rows), 1):.1f} s (incl. start-up)", failures)


def start_server(args: list[str], log: Path, health_url: str, *, name: str, timeout_s: float) -> subprocess.Popen:
    """Start an engine's server and wait (bounded) until ``health_url`` answers 200; its log on failure."""
    import urllib.request

    process = subprocess.Popen(args, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(health_url, timeout=10) as reply:
                if reply.status == 200:
                    return process
        except OSError:
            time.sleep(2)
    process.kill()
    raise RuntimeError(f"{name} did not answer within {timeout_s:g} s:\n{log.read_text()[-3000:]}")
