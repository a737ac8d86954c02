"""Scalars as TensorBoard event files.

Select it with ``logger.loggers: [jsonl, tensorboard]``; its block ``logger.tensorboard`` takes
``log_dir`` (null: ``<run_dir>/tensorboard``) and ``flush_secs``. View with
``tensorboard --logdir <run_dir>/tensorboard``. Needs ``pip install 'grpo-sdk[tensorboard]'``.

Written with tensorboard's own event writer (no TensorFlow, no torch.utils.tensorboard), so it
works with any torch build. Tags are the metric keys as they are (``reward/mean`` groups under
``reward`` in the UI). Non-finite values are written as they are: the event format stores NaN
and infinity, and TensorBoard shows them, which is what a diverging run should look like.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from tensorboard.compat.proto.event_pb2 import Event, SessionLog
from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.summary.writer.event_file_writer import EventFileWriter

from grpo_sdk.loggers.specs import TensorBoardConfig


class TensorBoardLogger:
    def __init__(self, config: TensorBoardConfig | None, context: Any):
        config = config or TensorBoardConfig()
        self.log_dir = Path(config.log_dir) if config.log_dir else Path(context.run_dir) / "tensorboard"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.writer = EventFileWriter(str(self.log_dir), flush_secs=config.flush_secs)
        resume_step = getattr(context, "resume_step", None)
        if resume_step is not None:
            # A resumed run logs the steps after its checkpoint again. A session START at the first
            # new step makes TensorBoard drop those steps of the earlier event files (what
            # torch's SummaryWriter(purge_step=...) writes), so each step shows once.
            start = SessionLog(status=SessionLog.START)
            self.writer.add_event(Event(wall_time=time.time(), step=resume_step + 1, session_log=start))

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        values = [Summary.Value(tag=key, simple_value=float(value)) for key, value in metrics.items()]
        self.writer.add_event(Event(wall_time=time.time(), step=int(step), summary=Summary(value=values)))
        self.writer.flush()  # a crash loses nothing already logged, as with metrics.jsonl

    def close(self) -> None:
        self.writer.close()
