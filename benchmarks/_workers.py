"""The driver's side of the benchmarks' worker processes (real_model.py, scale.py, sampler.py): each
worker prints protocol lines, marked with its script's prefix, among whatever its libraries print.
No torch here: the driver stays light."""

from __future__ import annotations

import json
from typing import Any


def read_event(worker: Any, prefix: str, event: str) -> dict:
    """The worker's next protocol message, which must be ``event``; a clear error with the worker's log
    tail if it sends another or exits first. ``worker`` has ``name``, ``proc`` (stdout piped, text)
    and ``log`` (a Path)."""
    for line in worker.proc.stdout:
        if line.startswith(prefix):
            message = json.loads(line[len(prefix):])
            if message["event"] != event:
                raise RuntimeError(f"{worker.name}: expected {event}, got {message}")
            return message
    worker.proc.wait()
    raise RuntimeError(f"worker {worker.name} exited {worker.proc.returncode} before '{event}':\n"
                       f"{worker.log.read_text()[-3000:]}")
