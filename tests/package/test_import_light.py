"""Importing grpo-sdk and its light CLI commands imports neither torch nor transformers nor ray.

Each case runs in a fresh interpreter (this one has torch loaded by other tests) and prints which
heavy modules ended up in ``sys.modules``. The CLI cases call ``grpo_sdk.cli.app.main`` with the
real entry points installed, so every built-in spec and config module is read as in ``grpoctl``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "ray")

REPORT = f"""
import json, sys
print(json.dumps({{"rc": rc, "heavy": sorted(m for m in {HEAVY!r} if m in sys.modules)}}))
"""


def run_snippet(body: str) -> dict:
    """Run ``body`` (which sets ``rc``) in a fresh interpreter; return its exit code and heavy modules."""
    env = {k: v for k, v in os.environ.items() if k != "GRPO_SDK_STRICT_PLUGINS"}
    env["OMP_NUM_THREADS"] = "1"
    result = subprocess.run([sys.executable, "-c", body + REPORT], env=env, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("module", ["grpo_sdk", "grpo_sdk.plugins", "grpo_sdk.cli.app", "grpo_sdk.testing"])
def test_importing_does_not_import_heavy_modules(module):
    report = run_snippet(f"import {module}\nrc = 0\n")
    assert report["heavy"] == []


@pytest.mark.parametrize("argv", [["--help"], ["plugins", "list"], ["plugins", "list", "--json"],
                                  ["plugins", "show", "hf"], ["plugins", "new", "--help"], ["config", "validate"], ["config", "show"],
                                  ["config", "schema"]], ids=" ".join)
def test_light_cli_commands_do_not_import_heavy_modules(argv):
    report = run_snippet(
        "from grpo_sdk.cli.app import main\n"
        "try:\n"
        f"    rc = main({argv!r})\n"
        "except SystemExit as exc:\n"
        "    rc = exc.code\n")
    assert report == {"rc": 0, "heavy": []}
