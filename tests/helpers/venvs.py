"""Fresh virtual environments for "install it with pip like a user would" tests, in seconds.

A new venv gets a ``.pth`` file that puts this test environment's site-packages (and grpo-sdk's
source) on its path, so grpo-sdk, torch and the rest are importable *and* visible to pip as
installed: ``pip install --no-deps ./plugin`` then installs only the plugin (its build may fetch
setuptools into pip's build isolation once; pip caches it). The plugin itself is a real pip
install into the new venv, found through its own entry points.
"""

from __future__ import annotations

import os
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import grpo_sdk

SRC = Path(grpo_sdk.__file__).resolve().parent.parent


def make_venv(path: Path) -> Path:
    """Create a venv at ``path`` sharing this environment's packages; returns its python."""
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True, capture_output=True)
    python = path / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    shared = [sysconfig.get_paths()["purelib"], *site.getsitepackages(), str(SRC)]
    Path(purelib, "_grpo_sdk_test_env.pth").write_text("\n".join(dict.fromkeys(shared)) + "\n")
    return python


def venv_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    return env


def pip_install(python: Path, *args: str) -> subprocess.CompletedProcess:
    """``pip install`` into the venv (no dependencies: they are on the shared path)."""
    return subprocess.run([str(python), "-m", "pip", "install", "--no-deps", *args],
                          env=venv_env(), capture_output=True, text=True, timeout=600)
