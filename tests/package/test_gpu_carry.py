"""The carry plan of issue 42 (benchmarks/gpu/build_carry.sh, run_all.sh, test_carry.sh): the wheels the
GPU machine needs, built here and installed there with no network.

The slow test builds the carry into a scratch folder and runs test_carry.sh: every carried wheel
installs with no index into a fresh Python 3.12 venv, the light imports and `grpoctl --help` work,
`pip check` finds only torch missing, and run_all.sh's own install step (--setup-only) works. It needs
python3.12 and the network (the wheels are downloaded); it is skipped, saying which, without them. It
does not prove anything that needs torch or CUDA: that happens on the GPU machine.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
GPU = REPO / "benchmarks" / "gpu"


def _bash(script: str, *args: str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(GPU / script), *args], cwd=REPO, env={**os.environ, **env},
                          capture_output=True, text=True, timeout=timeout)


def test_run_all_without_wheels_is_a_setup_failure(tmp_path):
    result = _bash("run_all.sh", env={"CARRY": str(tmp_path / "none"), "OUT": str(tmp_path / "out"),
                                      "CARRY_SITE": str(tmp_path / "site")}, timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "SETUP FAILED: no wheels under" in result.stdout
    assert "build_carry.sh" in result.stdout
    # The log comes back from the device call even when nothing ran.
    assert "SETUP FAILED" in (tmp_path / "out" / "run_all.log").read_text()


def test_test_carry_without_wheels_says_to_build_them(tmp_path):
    result = _bash("test_carry.sh", env={"CARRY_DIR": str(tmp_path / "none")}, timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "build_carry.sh" in result.stderr


@pytest.mark.skipif(not (REPO / ".git").exists(), reason="build_carry.sh needs a git checkout")
def test_build_carry_refuses_a_folder_git_would_commit():
    # Checked before anything is downloaded: wheels must never land in a tracked folder.
    result = _bash("build_carry.sh", env={"CARRY_DIR": "benchmarks/gpu/not-ignored"}, timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "not git-ignored" in result.stderr
    assert not (GPU / "not-ignored").exists()


def _python312() -> str | None:
    candidates = [os.environ.get("PYTHON312"), shutil.which("python3.12")]
    candidates += sorted(str(p) for p in Path.home().glob(".pyenv/versions/3.12*/bin/python3.12"))
    for candidate in filter(None, candidates):
        probe = subprocess.run([candidate, "-c", "import sys; assert sys.version_info[:2] == (3, 12)"],
                               capture_output=True, timeout=30)
        if probe.returncode == 0:
            return candidate
    return None


def _network(tmp_path: Path) -> bool:
    # The smallest wheel of the carry, fetched the way build_carry.sh fetches.
    try:
        probe = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                                "-d", str(tmp_path / "probe"), "mdurl==0.1.2"], capture_output=True, timeout=60)
    except subprocess.TimeoutExpired:
        return False
    return probe.returncode == 0


@pytest.mark.slow
def test_the_carry_installs_offline_into_a_fresh_python312_venv(tmp_path):
    python312 = _python312()
    if python312 is None:
        pytest.skip("no Python 3.12 here (set PYTHON312): the GPU machine's Python is 3.12")
    if not (REPO / ".git").exists():
        pytest.skip("build_carry.sh needs a git checkout")
    if not _network(tmp_path):
        pytest.skip("the package index is unreachable: build_carry.sh downloads the wheels")
    env = {"CARRY_DIR": str(tmp_path / "carry"), "MCORE_VERSIONS": "0.16.1", "PYTHON312": python312}
    built = _bash("build_carry.sh", env=env, timeout=400)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    assert "of the 64 MiB limit" in built.stdout
    assert "bash benchmarks/gpu/run_all.sh" in built.stdout
    wheels = sorted(p.name for p in (tmp_path / "carry").glob("*/*.whl"))
    assert not [w for w in wheels if w.startswith(("torch-", "triton-", "nvidia_", "numpy-"))], wheels
    assert any(w.startswith("grpo_sdk-") for w in wheels) and any(w.startswith("megatron_core-") for w in wheels)

    tested = _bash("test_carry.sh", env=env, timeout=400)
    if tested.returncode == 2:
        pytest.skip(f"test_carry.sh could not run: {tested.stderr.strip()[-300:]}")
    assert tested.returncode == 0, tested.stdout[-4000:] + tested.stderr[-3000:]
    assert "pip check: only torch is missing" in tested.stdout
    assert "grpoctl --help: ok" in tested.stdout
    assert tested.stdout.rstrip().endswith("test_carry: PASS")
