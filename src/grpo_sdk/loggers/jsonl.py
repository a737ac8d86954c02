"""Per-step metrics as JSON lines, flushed every step so a crash loses nothing already logged."""

from __future__ import annotations

import json
import math
from typing import Any

from grpo_sdk.plugins.toolkit import write_text_atomic


def _jsonable(value: float) -> Any:
    # JSON has no NaN or infinity; write them as strings rather than produce invalid JSON.
    return value if math.isfinite(value) else str(value)


class JSONLLogger:
    def __init__(self, config: Any, context: Any):
        self.path = context.run_dir / "metrics.jsonl"
        if context.resume_step is not None and self.path.exists():
            keep_steps_up_to(self.path, context.resume_step)
        self.file = open(self.path, "a", encoding="utf-8")

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, **{k: _jsonable(float(v)) for k, v in metrics.items()}}
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def keep_steps_up_to(path: Any, step: int) -> None:
    """On resume, drop lines logged after the checkpoint (and a line cut short by a crash): the
    resumed run logs those steps again. Step 0 (validation before training) is kept only when
    there is a checkpoint, since a run resumed from nothing validates again."""
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and step > 0 and record.get("step", 0) <= step:
            kept.append(line)
    write_text_atomic(path, "".join(line + "\n" for line in kept))  # a kill here must not lose the kept lines
