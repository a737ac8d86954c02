"""Every metric of every step on stdout."""

from __future__ import annotations

from typing import Any


class ConsoleLogger:
    def __init__(self, config: Any, context: Any):
        pass

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        body = " ".join(f"{k}={v:.4g}" for k, v in sorted(metrics.items()))
        print(f"[step {step}] {body}", flush=True)

    def close(self) -> None:
        pass
