"""docs/your-own-task.md, run verbatim: every file it shows is written as shown, every command block
runs in bash as shown (with this venv's `grpoctl` and `python` first on PATH), and the Python block
runs as a script, all in one empty directory. Then what the page promises is checked: the reward
climbs, the report and the exported models exist, and the Python run is the CLI run, step for step.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import grpoctl_env

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "your-own-task.md"
BLOCK = re.compile(r"<!-- guide: (file (?P<name>\S+)|run|python) -->\n```\w*\n(?P<body>.*?)```", re.DOTALL)


def guide_blocks() -> list[tuple[str, str | None, str]]:
    """``(kind, file name, body)`` for each marked block, in page order."""
    return [(m.group(1).split()[0], m.group("name"), m.group("body")) for m in BLOCK.finditer(GUIDE.read_text())]


def test_the_guide_marks_its_files_commands_and_python():
    kinds = [kind for kind, _, _ in guide_blocks()]
    assert kinds.count("file") == 3 and kinds.count("run") == 3 and kinds.count("python") == 1


def _history(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [{k: v for k, v in row.items() if not k.startswith(("timing/", "perf/")) and k != "time"} for row in rows]


@pytest.mark.slow
def test_the_guide_runs_verbatim(tmp_path):
    env = grpoctl_env(PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    outputs = []
    for kind, name, body in guide_blocks():
        if kind == "file":
            (tmp_path / name).write_text(body)
            continue
        command = ["bash", "-euo", "pipefail", "-c", body] if kind == "run" else [sys.executable, "-c", body]
        proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, f"{kind} block failed:\n{body}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
        outputs.append(proc.stdout)

    summary = json.loads((tmp_path / "runs" / "sort" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 300 and summary["ended_by"] is None
    assert summary["reward_first"] < 0.15 and summary["reward_last"] > 0.4, summary  # the page: ~0.04 -> ~0.6
    assert summary["validation"]["accuracy"] > 0.4
    assert "config OK" in outputs[1] and "300 steps requested" in outputs[1]  # validate, then the dry run
    assert (tmp_path / "runs" / "sort" / "report" / "report.md").is_file()
    for model in ("sorted-model", "sorted-model-py"):
        assert (tmp_path / model / "config.json").is_file() and list((tmp_path / model).glob("*.safetensors"))
    assert outputs[-1].startswith("completed ")
    assert _history(tmp_path / "runs" / "sort-py") == _history(tmp_path / "runs" / "sort")
