"""The TensorBoard, W&B and MLflow loggers: what each backend stores, read back with its own reader.

Nothing touches a network: W&B runs offline (its .wandb transaction log is read back below) and
MLflow writes a local file store. The end-to-end test trains three steps with every logger on.
"""

from __future__ import annotations

import glob
import importlib.metadata as md
import json
import math
import os
import struct
import time
from pathlib import Path

import pytest

from grpo_sdk.cli.app import main
from grpo_sdk.cli.common import STATE
from grpo_sdk.config.loading import load_config
from grpo_sdk.config.context import RunContext
from grpo_sdk.core.errors import PluginError
from grpo_sdk.plugins.registry import Registry
from helpers import run_grpoctl

METRICS = {  # step -> metrics, with the key shapes the loop logs and one NaN
    1: {"reward/mean": 0.25, "timing/train": 0.5, "loss": 1.5, "val/pass@4": 0.5},
    2: {"reward/mean": 0.5, "timing/train": 0.25, "loss": float("nan"), "val/pass@4": 0.75},
    3: {"reward/mean": 0.75, "timing/train": 0.125, "loss": -0.5, "val/pass@4": 1.0},
}


@pytest.fixture(scope="module")
def run_config():
    return load_config(None, ["logger.loggers=[jsonl,tensorboard,wandb,mlflow]", "grpo.seed=7"], Registry.discover())


@pytest.fixture
def run_dir_context(run_config, tmp_path):
    run_dir = tmp_path / "run-a"
    run_dir.mkdir()
    (run_dir / "config.resolved.yaml").write_text("grpo:\n  seed: 7\n")  # the loop writes it before loggers start
    return RunContext(config=run_config, run_dir=run_dir, model_path="m", tokenizer_path="m", device="cpu",
                      seed=7, needs_reference=False)


def feed(logger):
    for step, metrics in METRICS.items():
        logger.log_metrics(step, metrics)
    logger.close()


def expected(key):
    return [(step, m[key]) for step, m in METRICS.items()]


def assert_history(pairs, key):
    """``pairs`` equals ``expected(key)``, NaN matching NaN, values to float32 precision."""
    assert [s for s, _ in pairs] == [s for s, _ in expected(key)], key
    for (_, got), (_, want) in zip(pairs, expected(key)):
        assert (math.isnan(got) and math.isnan(want)) or got == pytest.approx(want, rel=1e-6), key


# --- TensorBoard ------------------------------------------------------------------------------


def test_tensorboard_event_file_holds_every_scalar(run_dir_context):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from grpo_sdk.loggers.specs import TensorBoardConfig
    from grpo_sdk.loggers.tensorboard import TensorBoardLogger

    feed(TensorBoardLogger(TensorBoardConfig(), run_dir_context))
    acc = EventAccumulator(str(run_dir_context.run_dir / "tensorboard"))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == {"reward/mean", "timing/train", "loss", "val/pass@4"}
    for key in METRICS[1]:
        assert_history([(e.step, e.value) for e in acc.Scalars(key)], key)


def test_tensorboard_resume_replaces_the_steps_after_the_checkpoint(run_dir_context):
    import attrs
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from grpo_sdk.loggers.specs import TensorBoardConfig
    from grpo_sdk.loggers.tensorboard import TensorBoardLogger

    feed(TensorBoardLogger(TensorBoardConfig(), run_dir_context))  # steps 1-3, then a crash; checkpoint at 1
    if "resume_step" not in attrs.fields_dict(type(run_dir_context)):
        pytest.skip("RunContext has no resume_step")
    resumed = TensorBoardLogger(TensorBoardConfig(), attrs.evolve(run_dir_context, resume_step=1))
    for step in (2, 3, 4):
        resumed.log_metrics(step, {"reward/mean": 10.0 * step})
    resumed.close()
    acc = EventAccumulator(str(run_dir_context.run_dir / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("reward/mean")] == [(1, 0.25), (2, 20.0), (3, 30.0), (4, 40.0)]


def test_tensorboard_log_dir_option(run_dir_context, tmp_path):
    from grpo_sdk.loggers.specs import TensorBoardConfig
    from grpo_sdk.loggers.tensorboard import TensorBoardLogger

    feed(TensorBoardLogger(TensorBoardConfig(log_dir=str(tmp_path / "tb")), run_dir_context))
    assert glob.glob(str(tmp_path / "tb" / "events.out.tfevents.*"))
    assert not (run_dir_context.run_dir / "tensorboard").exists()


# --- W&B --------------------------------------------------------------------------------------


@pytest.fixture
def wandb_env(monkeypatch, tmp_path):
    """Offline, and every file W&B writes outside the run (cache, settings) under tmp_path."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))
    monkeypatch.setenv("WANDB_SILENT", "true")


def wandb_records(path: Path):
    """Records of a .wandb file: a LevelDB-format log (32 KiB blocks of CRC/length/type-framed
    chunks) after a 7-byte ``:W&B`` header, each record a ``wandb_internal_pb2.Record``. wandb
    >= 0.19 ships no Python reader of its own, and the format is stable (``wandb sync`` reads it)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:  # block trailer padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:  # zero padding to the end of a block
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk  # FULL/FIRST start, MIDDLE/LAST extend
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            yield record


def test_wandb_offline_run_holds_history_and_config(run_dir_context, wandb_env):
    from grpo_sdk.loggers.specs import WandbConfig
    from grpo_sdk.loggers.wandb_logger import WandbLogger

    feed(WandbLogger(WandbConfig(), run_dir_context))
    (run_file,) = glob.glob(str(run_dir_context.run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    # wandb's service process writes the file; finish() can return while its first block still reads
    # as zeros (a clean-clone CI run on a quiet machine read 8676 bytes and no record at all), so the
    # records are read once the file holds its run record, for at most 20 s.
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not any(
            r.WhichOneof("record_type") == "run" for r in wandb_records(Path(run_file))):
        time.sleep(0.2)
    history, config, name, kinds = [], {}, None, []
    for record in wandb_records(Path(run_file)):
        kind = record.WhichOneof("record_type")
        kinds.append(kind)
        if kind == "history":
            # Keys sit in `key` or, in newer versions, `nested_key` (one part, "/" left alone).
            history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json.replace("NaN", '"nan"'))
                            for item in record.history.item})
        elif kind == "run":
            name = record.run.display_name
            config.update({item.key: json.loads(item.value_json) for item in record.run.config.update})
        elif kind == "config":
            config.update({item.key: json.loads(item.value_json) for item in record.config.update})
    # name: null -> the run directory's name. (Seen twice under load average > 10: no run record at
    # all; the record kinds are in the message for whoever meets it next.)
    assert name == "run-a", f"{Path(run_file).stat().st_size} bytes, records: {kinds}"
    assert config["grpo.seed"] == 7 and config["logger.loggers"] == ["jsonl", "tensorboard", "wandb", "mlflow"]
    for key in METRICS[1]:
        assert_history([(h["_step"], float(h[key])) for h in history], key)


def test_wandb_disabled_mode_writes_nothing(run_dir_context, wandb_env, monkeypatch):
    from grpo_sdk.loggers.specs import WandbConfig
    from grpo_sdk.loggers.wandb_logger import WandbLogger

    monkeypatch.delenv("WANDB_MODE")  # the config decides when the environment does not
    feed(WandbLogger(WandbConfig(mode="disabled"), run_dir_context))
    assert not glob.glob(str(run_dir_context.run_dir / "wandb" / "*run-*"))


def test_wandb_online_without_login_is_a_clear_error(run_dir_context, wandb_env, monkeypatch):
    from grpo_sdk.core.errors import GrpoSdkError
    from grpo_sdk.loggers.specs import WandbConfig
    from grpo_sdk.loggers.wandb_logger import WandbLogger

    # No credentials from anywhere (env, ~/.netrc, settings), and a server nothing listens on, so
    # even a machine with a W&B login sends nothing.
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(run_dir_context.run_dir / "no-netrc"))
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
    with pytest.raises(GrpoSdkError, match="logger.wandb.mode=offline"):
        WandbLogger(WandbConfig(), run_dir_context)


# --- MLflow -----------------------------------------------------------------------------------


@pytest.fixture
def no_file_store_opt_in(monkeypatch):
    # Unset for the test (the logger must opt in itself) and removed again afterwards.
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")


def test_mlflow_file_store_holds_metrics_params_and_config(run_dir_context, no_file_store_opt_in):
    from mlflow.tracking import MlflowClient

    from grpo_sdk.loggers.mlflow_logger import MLflowLogger
    from grpo_sdk.loggers.specs import MLflowConfig

    logger = MLflowLogger(MLflowConfig(), run_dir_context)
    assert "MLFLOW_ALLOW_FILE_STORE" not in os.environ, "the logger's opt-in must not outlive its store's creation"
    feed(logger)
    assert logger.tracking_uri == f"file:{run_dir_context.run_dir.resolve() / 'mlruns'}"
    client = MlflowClient(logger.tracking_uri)
    run = client.get_run(logger.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "run-a"
    assert client.get_experiment(run.info.experiment_id).name == "grpo-sdk"
    for key in ("reward/mean", "timing/train", "loss"):  # '/' is fine in MLflow keys; NaN is stored
        assert_history([(m.step, m.value) for m in client.get_metric_history(logger.run_id, key)], key)
    # '@' is not: it becomes '_'
    assert [m.value for m in client.get_metric_history(logger.run_id, "val/pass_4")] == [0.5, 0.75, 1.0]
    params = run.data.params
    assert params["grpo.seed"] == "7"
    assert json.loads(params["logger.loggers"]) == ["jsonl", "tensorboard", "wandb", "mlflow"]
    assert [a.path for a in client.list_artifacts(logger.run_id)] == ["config.resolved.yaml"]


def test_mlflow_marks_a_failed_run(run_dir_context, no_file_store_opt_in, tmp_path):
    from mlflow.tracking import MlflowClient

    from grpo_sdk.loggers.mlflow_logger import MLflowLogger
    from grpo_sdk.loggers.specs import MLflowConfig

    uri = f"file:{tmp_path / 'store'}"
    logger = MLflowLogger(MLflowConfig(tracking_uri=uri, experiment_name="exp", run_name="r1",
                                       log_config=False), run_dir_context)
    logger.log_metrics(1, {"reward/mean": 0.5})
    try:
        raise RuntimeError("training crashed")
    except RuntimeError:
        logger.close()  # as the loop's `finally` does while the error propagates
    run = MlflowClient(uri).get_run(logger.run_id)
    assert run.info.status == "FAILED" and run.info.run_name == "r1" and run.data.params == {}


# --- discovery --------------------------------------------------------------------------------


def list_loggers(capsys, monkeypatch) -> dict[str, dict]:
    # main() replaces the invocation state; later tests get theirs back.
    monkeypatch.setattr(STATE, "host", STATE.host)
    monkeypatch.setattr(STATE, "registry", STATE.registry)
    assert main(["plugins", "list", "--json", "--kind", "logger"]) == 0
    return {c["name"]: c for c in json.loads(capsys.readouterr().out)["components"]}


def test_plugins_list_shows_the_loggers_ok(capsys, monkeypatch):
    rows = list_loggers(capsys, monkeypatch)
    for name in ("tensorboard", "wandb", "mlflow"):
        assert rows[name]["status"] == "ok", rows[name]


def test_missing_backend_gives_the_pip_hint(capsys, monkeypatch):
    real_version = md.version

    def version(name):
        if name == "wandb":
            raise md.PackageNotFoundError(name)
        return real_version(name)

    monkeypatch.setattr(md, "version", version)
    rows = list_loggers(capsys, monkeypatch)
    assert rows["wandb"]["status"] == "missing-requirements"
    assert rows["wandb"]["hint"] == "pip install 'grpo-sdk[wandb]'"
    assert "wandb is not installed" in rows["wandb"]["problem"]
    assert rows["mlflow"]["status"] == "ok"
    with pytest.raises(PluginError, match=r"pip install 'grpo-sdk\[wandb\]'"):
        Registry.discover().get("logger", "wandb")


# --- end to end -------------------------------------------------------------------------------


@pytest.mark.slow
def test_training_run_with_every_logger(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_ALLOW_FILE_STORE"}
    home = {var: str(tmp_path / "wandb-home") for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR",
                                                          "WANDB_DATA_DIR")}
    result = run_grpoctl("run", "--run-dir", run_dir, "grpo.max_num_steps=3", "grpo.val_period=0",
                         "logger.loggers=[jsonl,tensorboard,mlflow,wandb]", cwd=tmp_path, env=env, timeout=300,
                         WANDB_MODE="offline", WANDB_SILENT="true", **home)
    assert result.returncode == 0, result.stderr[-3000:]

    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 3
    assert glob.glob(str(run_dir / "tensorboard" / "events.out.tfevents.*"))
    assert glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # to read the store back here
    client = MlflowClient(f"file:{run_dir / 'mlruns'}")
    (run,) = client.search_runs([client.get_experiment_by_name("grpo-sdk").experiment_id])
    assert run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "reward/mean")] == [1, 2, 3]

    report = run_grpoctl("report", run_dir, cwd=tmp_path, env=env, timeout=120)
    assert report.returncode == 0, report.stderr
    assert (run_dir / "report" / "reward.png").is_file() and (run_dir / "report" / "report.md").is_file()
