"""check_hf.py's sigkill_resume check: ``grpoctl run`` in a subprocess, SIGKILLed after a checkpoint and
resumed with ``--resume``, against an uninterrupted run (tests/e2e/test_lifecycle.py's approach)."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

RESUME_STEPS, SAVE_PERIOD, KILL_AT = 4, 2, 3  # killed at step 3, after the step-2 checkpoint
VOLATILE = ("timing/", "perf/")  # wall-clock metrics differ between runs by nature (tests/faults/campaign.py)


def _child_env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "HF_HUB_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1"}


def _grpoctl(args: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "grpo_sdk.cli.entry", *args], cwd=cwd, env=_child_env(),
                          capture_output=True, text=True, timeout=timeout)


def _run_and_kill_after(args: list[str], cwd: Path, step: int, timeout: float) -> bool:
    """``grpoctl run`` SIGKILLed as soon as it prints ``step N/``; whether that happened in time."""
    proc = subprocess.Popen([sys.executable, "-m", "grpo_sdk.cli.entry", *args], cwd=cwd, env=_child_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    killed = False
    timer = threading.Timer(timeout, proc.kill)  # a stuck run: bounded, never a hang
    timer.start()
    try:
        for line in proc.stdout:
            if line.startswith(f"step {step}/"):
                proc.send_signal(signal.SIGKILL)
                killed = True
                break
        proc.wait(timeout=60)
    finally:
        timer.cancel()
        proc.kill()
    return killed


def _metrics(run: Path) -> tuple[list[dict], list[dict]]:
    """The run's per-step metrics without the wall-clock ones, and as logged."""
    path = run / "metrics.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows], rows


def killed_and_resumed(overrides: list[str], base: Path, timeout: float) -> tuple[bool, str, dict, list[dict]]:
    """(passed, what was seen, figures, the uninterrupted run's metrics as logged) of: an uninterrupted
    run of ``overrides`` in base/a, the same run in base/b SIGKILLed at step KILL_AT then resumed."""
    args = ["run", "--run-dir", "run", *overrides]
    for d in ("a", "b"):
        (base / d).mkdir(parents=True)
    reference = _grpoctl(args, base / "a", timeout)
    if reference.returncode != 0:
        return False, f"the uninterrupted run exited {reference.returncode}: {reference.stderr[-1500:]}", {}, []
    killed = _run_and_kill_after(args, base / "b", KILL_AT, timeout)
    killed_rows = len(_metrics(base / "b" / "run")[0])
    resumed = _grpoctl(["run", "--resume", "run"], base / "b", timeout)
    want, raw = _metrics(base / "a" / "run")
    got, _ = _metrics(base / "b" / "run")
    resumed_from = f"resumed from step {SAVE_PERIOD}" in resumed.stdout
    ok = (killed and resumed.returncode == 0 and resumed_from and [r["step"] for r in want] ==
          list(range(1, RESUME_STEPS + 1)) and got == want)
    # Where they differ: by how much (nondeterministic kernels give ~1e-6; a lost state gives far more).
    diffs = [abs(a[k] - b[k]) for a, b in zip(got, want) for k in a.keys() & b.keys()
             if isinstance(a[k], (int, float)) and isinstance(b[k], (int, float))]
    max_diff = max(diffs, default=math.nan)
    detail = (f"killed at step {KILL_AT} ({killed}, {killed_rows} steps logged), resume exit {resumed.returncode}, "
              f"'resumed from step {SAVE_PERIOD}' {resumed_from}, per-step metrics equal to the uninterrupted run "
              f"{got == want} ({len(got)} vs {len(want)} steps, max |diff| {max_diff:.3g})")
    if resumed.returncode != 0:
        detail += f": {resumed.stderr[-1500:]}"
    return ok, detail, {"metrics_max_diff": max_diff, "killed_at_step": KILL_AT, "killed_steps_logged": killed_rows}, raw
