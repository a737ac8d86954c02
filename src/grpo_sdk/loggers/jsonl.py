"""Per-step metrics as JSON lines, flushed every step so a crash loses nothing already logged."""

from __future__ import annotations

import json
import math
from typing import Any


def _jsonable(value: float) -> Any:
    # JSON has no NaN or infinity; write them as strings rather than produce invalid JSON.
    return value if math.isfinite(value) else str(value)


class JSONLLogger:
    def __init__(self, config: Any, context: Any):
        self.path = context.run_dir / "metrics.jsonl"
        self.file = open(self.path, "a", encoding="utf-8")

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, **{k: _jsonable(float(v)) for k, v in metrics.items()}}
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()
