"""Entry-point targets and config classes of the built-in loggers.

Light module: no logging backend is imported here (``requires`` is checked from installed
metadata), so ``grpoctl plugins list`` and ``config validate`` stay fast without them.

Select loggers with ``logger.loggers`` and configure each one in its own block::

    logger:
      loggers: [jsonl, tensorboard, wandb, mlflow]
      tensorboard: {log_dir: null}                 # null: <run_dir>/tensorboard
      wandb: {project: grpo-sdk, mode: offline}    # offline by default: no account, no network
      mlflow: {tracking_uri: null, experiment_name: grpo-sdk}   # null: file:<run_dir>/mlruns
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import attrs

from grpo_sdk.plugins import ComponentSpec, option

if TYPE_CHECKING:
    from grpo_sdk.plugins.toolkit import MasterConfig

JSONL = ComponentSpec(
    name="jsonl",
    kind="logger",
    impl="grpo_sdk.loggers.jsonl:JSONLLogger",
    summary="One JSON object per step in <run_dir>/metrics.jsonl.",
)

CONSOLE = ComponentSpec(
    name="console",
    kind="logger",
    impl="grpo_sdk.loggers.console:ConsoleLogger",
    summary="Every metric of every step on stdout (verbose; for debugging).",
)


@attrs.frozen(kw_only=True)
class TensorBoardConfig:
    log_dir: str | None = option(None, "Directory of the event files; null: <run_dir>/tensorboard.")
    flush_secs: int = option(30, "Also flush pending events at least this often (seconds); every step is "
                             "flushed anyway.", validator=attrs.validators.gt(0))


@attrs.frozen(kw_only=True)
class WandbConfig:
    project: str = option("grpo-sdk", "W&B project.")
    entity: str | None = option(None, "W&B entity (user or team); null: the account's default.")
    name: str | None = option(None, "Run name; null: the run directory's name.")
    group: str | None = option(None, "Run group, to compare runs of one sweep together.")
    tags: list[str] = option(factory=list, help="Run tags.")
    mode: Literal["online", "offline", "disabled"] = option(
        "offline", "offline (default): write <dir>/wandb/offline-run-* without an account or network; upload "
                   "later with `wandb sync`. online: stream to the W&B server (needs `wandb login`). "
                   "disabled: log nothing. The WANDB_MODE environment variable, if set, wins.")
    dir: str | None = option(None, "Parent of the wandb/ directory W&B writes; null: <run_dir>.")


@attrs.frozen(kw_only=True)
class MLflowConfig:
    tracking_uri: str | None = option(None, "MLflow tracking URI (http://host:5000, databricks, a file: or "
                                            "sqlite: URI); null: file:<run_dir>/mlruns.")
    experiment_name: str = option("grpo-sdk", "Experiment the run is created in (created if missing).")
    run_name: str | None = option(None, "Run name; null: the run directory's name.")
    log_config: bool = option(True, "Log the resolved run config as params (dotted keys) and as the artifact "
                              "config.resolved.yaml.")


TENSORBOARD = ComponentSpec(
    name="tensorboard",
    kind="logger",
    impl="grpo_sdk.loggers.tensorboard:TensorBoardLogger",
    config="grpo_sdk.loggers.specs:TensorBoardConfig",
    requires=("tensorboard>=2.15",),
    extra="tensorboard",
    summary="Scalars as TensorBoard event files in <run_dir>/tensorboard.",
)

WANDB = ComponentSpec(
    name="wandb",
    kind="logger",
    impl="grpo_sdk.loggers.wandb_logger:WandbLogger",
    config="grpo_sdk.loggers.specs:WandbConfig",
    requires=("wandb>=0.17",),
    extra="wandb",
    summary="Weights & Biases run (offline by default) with the resolved config.",
)

MLFLOW = ComponentSpec(
    name="mlflow",
    kind="logger",
    impl="grpo_sdk.loggers.mlflow_logger:MLflowLogger",
    config="grpo_sdk.loggers.specs:MLflowConfig",
    requires=("mlflow-skinny>=2.10",),
    extra="mlflow",
    summary="MLflow run (local file store by default) with metrics and the resolved config as params.",
)


def flat_config(config: MasterConfig) -> dict[str, Any]:
    """The resolved run config as ``{"grpo.seed": 42, "policy.optimizer.lr": 5e-06, ...}``.

    W&B and MLflow both record it: dotted keys keep every value a scalar or a short list, which
    MLflow params need and which W&B shows as one sortable column per key.
    """
    from grpo_sdk.plugins.toolkit import dump_config

    out: dict[str, Any] = {}

    def walk(value: Any, prefix: str) -> None:
        if isinstance(value, dict) and value:
            for key, sub in value.items():
                walk(sub, f"{prefix}.{key}" if prefix else str(key))
        elif prefix:
            out[prefix] = value  # scalars, lists, and empty blocks ({}) so a selected plugin still shows

    walk(dump_config(config), "")
    return out
