"""`grpoctl report`: look at a run instead of reading its metrics.jsonl.

The work is in ``grpo_sdk.cli.report`` (importable without typer); matplotlib is imported only
when the command runs, so ``grpoctl --help`` stays light.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from grpo_sdk.cli.common import guarded


def report(
    run_dir: Path = typer.Argument(..., help="Run directory (holds metrics.jsonl, and summary.json once done)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Where the PNGs and report.md go; default "
                                       "RUN_DIR/report."),
) -> None:
    """Plot reward, KL, response length, timing, validation and an async run's pipeline; write report.md.

    Works on a finished, running or crashed run. Exit 2 when RUN_DIR has no readable
    metrics.jsonl; exit 3 when matplotlib is missing (pip install 'grpo-sdk[report]').
    """
    def body() -> None:
        from grpo_sdk.cli.report import write_report

        result = write_report(run_dir, out)
        for note in result.notes:
            print(f"note: {note}", file=sys.stderr)
        for path in result.files:
            print(path)

    guarded(body)
