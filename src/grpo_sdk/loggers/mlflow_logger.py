"""An MLflow run: every metric per step, the resolved config as params and as an artifact.

Select it with ``logger.loggers: [jsonl, mlflow]``; its block::

    logger:
      mlflow:
        tracking_uri: null         # null: file:<run_dir>/mlruns (a local file store)
        experiment_name: grpo-sdk  # created if missing
        run_name: null             # null: the run directory's name
        log_config: true

Browse a local store with ``MLFLOW_ALLOW_FILE_STORE=true mlflow ui --backend-store-uri
file:<run_dir>/mlruns``. Needs ``pip install 'grpo-sdk[mlflow]'`` (mlflow-skinny; the full
``mlflow`` package provides it too).

MLflow 3.x refuses file stores unless ``MLFLOW_ALLOW_FILE_STORE`` is true; for a ``file:`` URI
this logger sets it (only when unset), since a file store is what the config asked for. Set
``tracking_uri`` to an ``http(s)://`` server or a ``sqlite:`` URI to avoid it.

Talks to MLflow through ``MlflowClient`` rather than the fluent ``mlflow.*`` API, so it sets no
process-wide active run or tracking URI that other code could trip over. Metric keys may contain
``/`` (MLflow allows it); characters MLflow rejects are replaced by ``_``. NaN and infinity are
logged as they are: every MLflow store accepts them (the SQL store keeps infinity as the largest
float).
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import warnings
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from mlflow.entities import Metric, Param
from mlflow.tracking import MlflowClient

from grpo_sdk.loggers.specs import MLflowConfig, flat_config

_BATCH = 100  # MLflow's limit on params per log_batch call (metrics allow 1000)
_MAX_KEY = 250
_MAX_PARAM_VALUE = 6000  # MLflow >= 2.x; longer values are cut rather than rejected


def _key(name: str) -> str:
    # MLflow accepts letters, digits, _ - . space and /; a plugin's metric name must not crash training.
    name = re.sub(r"[^\w\-. /]", "_", name)
    name = "/".join(part for part in name.split("/") if part not in ("", ".", ".."))
    return name[:_MAX_KEY] or "_"


def _param_value(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text[:_MAX_PARAM_VALUE]


class MLflowLogger:
    def __init__(self, config: MLflowConfig | None, context: Any):
        config = config or MLflowConfig()
        run_dir = Path(context.run_dir)
        uri = config.tracking_uri or f"file:{(run_dir / 'mlruns').resolve()}"
        self.tracking_uri = uri
        # MLflow 3 refuses a file store unless MLFLOW_ALLOW_FILE_STORE is set; it checks once, when
        # the client builds its store (cached per URI), so the opt-in lasts only for that.
        file_store = urlparse(uri).scheme in ("", "file") and "MLFLOW_ALLOW_FILE_STORE" not in os.environ
        os.environ.update({"MLFLOW_ALLOW_FILE_STORE": "true"} if file_store else {})
        try:
            self.client = MlflowClient(tracking_uri=uri)
            experiment = self.client.get_experiment_by_name(config.experiment_name)
        finally:
            if file_store:
                os.environ.pop("MLFLOW_ALLOW_FILE_STORE", None)
        experiment_id = (experiment.experiment_id if experiment is not None
                         else self.client.create_experiment(config.experiment_name))
        self.run_id = self.client.create_run(experiment_id, run_name=config.run_name or run_dir.name,
                                             tags={"grpo_sdk.run_dir": str(run_dir)}).info.run_id
        if config.log_config:
            self._log_config(context, run_dir)

    def _log_config(self, context: Any, run_dir: Path) -> None:
        params = [Param(_key(k), _param_value(v)) for k, v in flat_config(context.config).items()]
        for i in range(0, len(params), _BATCH):
            self.client.log_batch(self.run_id, params=params[i:i + _BATCH])
        resolved = run_dir / "config.resolved.yaml"
        if resolved.is_file():
            try:
                self.client.log_artifact(self.run_id, str(resolved))
            except Exception as exc:  # noqa: BLE001 - a remote artifact store without its client
                # library (boto3, ...) should not stop training; the params hold the same config.
                warnings.warn(f"mlflow: could not upload config.resolved.yaml: {exc}", stacklevel=2)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        now = int(time.time() * 1000)
        batch = [Metric(_key(k), float(v), now, int(step)) for k, v in metrics.items()]
        for i in range(0, len(batch), _BATCH):
            self.client.log_batch(self.run_id, metrics=batch[i:i + _BATCH])

    def close(self) -> None:
        # Closed from the loop's `finally`: an exception in flight means the run did not finish.
        error = sys.exc_info()[0]
        status = "FINISHED" if error is None else "KILLED" if issubclass(error, KeyboardInterrupt) else "FAILED"
        self.client.set_terminated(self.run_id, status)
