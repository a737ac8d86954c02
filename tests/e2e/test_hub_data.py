"""Datasets by name (``data.train_path: hf:NAME``) and hub names offline (docs/data.md).

No hub is reachable here, so two things are tested. (1) Offline, a hub dataset or model fails
within seconds with what to do: with ``HF_HUB_OFFLINE=1``, and without it against two unreachable
hubs: huggingface.co itself (whatever this sandbox does with it: DNS fails at once here) and a
fake endpoint on 127.0.0.1 that accepts connections and never answers (the slow case, bounded by
the probe's timeout). (2) The load path, for real, on a local directory laid out like a hub
dataset repo (data files plus a README.md whose YAML declares two configs): ``load_dataset`` reads
it by the same config/split/data-file rules as a downloaded repo. What that does not prove: the
download itself, authentication, and a hub that answers slowly mid-download.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import grpoctl_env, run_grpoctl
from faults.campaign import final_weights, metrics_of
from grpo_sdk.core.errors import DataError, ModelLoadError
from grpo_sdk.data.hub import DataSource, source_rows

FAST = 20.0  # seconds: the probe's 5 s plus starting Python and importing datasets on a loaded machine


def digits(i: int, n: int) -> str:
    return f"{i * 7919 % 10**n:0{n}d}"


def write_hub_repo(root: Path) -> Path:
    """A dataset repo as the hub lays one out: config `five` (default; 5-digit rows, 40 train and
    12 test) and `three` (3-digit rows), columns `question`/`answer` (not what the run reads)."""
    for config, n in (("five", 5), ("three", 3)):
        (root / config).mkdir(parents=True)
        for split, count in (("train", 40), ("test", 12)):
            rows = [{"question": digits(i, n) + ">", "answer": digits(i, n)[::-1], "id": i} for i in range(count)]
            (root / config / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "README.md").write_text(
        "---\nconfigs:\n"
        "- config_name: five\n  default: true\n  data_files:\n"
        "  - {split: train, path: five/train.jsonl}\n  - {split: test, path: five/test.jsonl}\n"
        "- config_name: three\n  data_files:\n"
        "  - {split: train, path: three/train.jsonl}\n  - {split: test, path: three/test.jsonl}\n"
        "---\n# A local stand-in for a hub dataset repo\n")
    return root


@pytest.fixture
def hub_repo(tmp_path, monkeypatch):
    import datasets.config

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "datasets-cache"))
    return write_hub_repo(tmp_path / "repo")


# --- the load path ------------------------------------------------------------------------------


def test_subset_split_and_column_mapping(hub_repo):
    rows = source_rows(DataSource(path=f"hf:{hub_repo}", key="data.train_path", subset="three", split="test",
                                  columns={"question": "prompt", "answer": "target"}))
    assert len(rows) == 12
    assert rows[1] == (f"hf:{hub_repo} (three, test) row 1", {"prompt": digits(1, 3) + ">",
                                                               "target": digits(1, 3)[::-1], "id": 1})
    default = source_rows(DataSource(path=f"hf:{hub_repo}", key="data.train_path"))  # config five, split train
    assert len(default) == 40 and default[3][1]["question"] == digits(3, 5) + ">"


def test_streaming_reads_only_the_first_rows_and_needs_a_bound(hub_repo):
    streamed = source_rows(DataSource(path=f"hf:{hub_repo}", key="data.train_path", streaming=True, max_rows=7))
    whole = source_rows(DataSource(path=f"hf:{hub_repo}", key="data.train_path"))
    assert [r for _, r in streamed] == [r for _, r in whole[:7]]
    with pytest.raises(DataError, match=r"data.train_path: data.streaming=true needs data.max_rows"):
        source_rows(DataSource(path=f"hf:{hub_repo}", key="data.train_path", streaming=True))


@pytest.mark.parametrize("options, message", [
    ({"subset": "seven"}, r"BuilderConfig 'seven' not found. Available: \['five', 'three'\]"),
    ({"split": "validation"}, r"Unknown split \"validation\". Should be one of \['train', 'test'\]"),
    ({"columns": {"query": "prompt"}}, r"row 0: no column 'query' to rename \(data.columns\); columns: "
                                       r"\['answer', 'id', 'question'\]"),
    ({"columns": {"question": "id"}}, r"renames 'question' to 'id', a column the row already has"),
])
def test_bad_options_name_the_key_and_the_choices(hub_repo, options, message):
    with pytest.raises(DataError, match=message):
        source_rows(DataSource(path=f"hf:{hub_repo}", key="data.train_path", **options))


def test_a_name_that_is_neither_a_hub_id_nor_a_directory(tmp_path):
    with pytest.raises(DataError, match=r"data.train_path: hf:no/such/dir: 'no/such/dir' is neither a hub dataset "
                                        r"id \(hf:ORG/NAME\) nor a directory"):
        source_rows(DataSource(path="hf:no/such/dir", key="data.train_path"))


def test_columns_and_max_rows_apply_to_local_files_too(tmp_path):
    from grpo_sdk.config.loading import load_config
    from grpo_sdk.plugins.registry import Registry
    from grpo_sdk.data.prompt_sources import make_prompt_source

    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"q": digits(i, 5) + ">", "a": digits(i, 5)[::-1]}) + "\n" for i in range(30)))
    cfg = load_config(None, [f"data.train_path={path}", "data.columns.q=prompt", "data.columns.a=target",
                             "data.max_rows=20", "data.shuffle=false"], Registry.discover())
    source = make_prompt_source(cfg, None)
    assert len(source.prompts) == 20
    assert source.prompts[4].text == digits(4, 5) + ">" and source.prompts[4].metadata == {"target": digits(4, 5)[::-1]}
    assert source.prompts[4].source == f"{path} line 5"


# --- offline ------------------------------------------------------------------------------------


def test_offline_hub_dataset_fails_at_once_with_what_to_do():
    assert os.environ.get("HF_HUB_OFFLINE") == "1"  # conftest
    start = time.perf_counter()
    with pytest.raises(DataError) as info:
        source_rows(DataSource(path="hf:openai/gsm8k", key="data.train_path", subset="main"))
    assert time.perf_counter() - start < FAST
    text = str(info.value)
    assert text.startswith("data.train_path: hf:openai/gsm8k is not in the local cache and the hub cannot be "
                           "reached (HF_HUB_OFFLINE=1 is set)")
    assert "a local dataset file" in text and "unset HF_HUB_OFFLINE" in text


def test_offline_hub_model_fails_at_once_with_what_to_do():
    from grpo_sdk.core.models import load_tokenizer

    start = time.perf_counter()
    with pytest.raises(ModelLoadError) as info:
        load_tokenizer("Qwen/Qwen2.5-0.5B", key="policy.model_name")
    assert time.perf_counter() - start < FAST
    assert "policy.model_name: 'Qwen/Qwen2.5-0.5B' is not in the local cache and the hub cannot be reached" in str(
        info.value)
    assert "a local model directory" in str(info.value)


@pytest.fixture
def silent_endpoint():
    """A fake hub endpoint: it accepts TCP connections (the kernel's backlog) and never answers."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    server.close()


def online_env(tmp_path: Path, endpoint: str | None) -> dict[str, str]:
    env = {k: v for k, v in grpoctl_env().items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE",
                                                                 "TRANSFORMERS_OFFLINE", "HF_ENDPOINT")}
    env["HF_HOME"] = str(tmp_path / "hf-home")  # an empty cache
    if endpoint:
        env["HF_ENDPOINT"] = endpoint
    return env


LOAD_BOTH = """
import time
from grpo_sdk.data.hub import DataSource, source_rows
from grpo_sdk.core.models import load_tokenizer
for load in (lambda: source_rows(DataSource(path="hf:openai/gsm8k", key="data.train_path", subset="main")),
             lambda: load_tokenizer("Qwen/Qwen2.5-0.5B", key="policy.model_name")):
    start = time.perf_counter()
    try:
        load()
    except Exception as exc:
        print(f"{time.perf_counter() - start:.1f}", type(exc).__name__, exc)
"""


@pytest.mark.parametrize("endpoint", ["huggingface.co", "silent"])
def test_unreachable_hub_without_offline_mode_fails_within_seconds(tmp_path, silent_endpoint, endpoint):
    """A real attempt, no HF_HUB_OFFLINE: one probe of at most 5 s, then the cache; before, ~50 s of retries."""
    url = silent_endpoint if endpoint == "silent" else None
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", LOAD_BOTH], env=online_env(tmp_path, url), capture_output=True,
                          text=True, timeout=120)
    lines = proc.stdout.splitlines()
    assert len(lines) == 2, proc.stdout + proc.stderr[-2000:]
    assert time.perf_counter() - start < 2 * FAST
    (data_s, data_error, data_text), (model_s, model_error, model_text) = (ln.split(" ", 2) for ln in lines)
    assert data_error == "DataError" and model_error == "ModelLoadError", lines
    assert float(data_s) < 8 and float(model_s) < 8  # the probe is shared: the second load does not wait again
    host = url or "https://huggingface.co"
    for text in (data_text, model_text):
        assert f"the hub cannot be reached (no answer from {host} within 5 s" in text, text
        assert "HF_ENDPOINT (a mirror), HF_TOKEN or HTTPS_PROXY" in text
    assert "Retrying in" not in proc.stderr


@pytest.mark.parametrize("offline", [True, False])
def test_grpoctl_run_on_an_unreachable_hub_model_exits_1_with_the_hint(tmp_path, silent_endpoint, offline):
    env = None if offline else online_env(tmp_path, silent_endpoint)
    start = time.perf_counter()
    proc = run_grpoctl("run", "--run-dir", "run", "policy.model_name=Qwen/Qwen2.5-0.5B", "grpo.max_num_steps=1",
                       cwd=tmp_path, env=env, timeout=180, **({} if offline else {"HF_HUB_OFFLINE": "0"}))
    assert time.perf_counter() - start < 3 * FAST
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and "Retrying in" not in proc.stderr
    assert "error: policy.model_name: 'Qwen/Qwen2.5-0.5B' is not in the local cache" in proc.stderr
    assert ("HF_HUB_OFFLINE=1 is set" if offline else f"no answer from {silent_endpoint}") in proc.stderr


# --- a training run on it -----------------------------------------------------------------------

RUN = ["grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4", "grpo.max_num_steps=6",
       "checkpointing.save_period=2", "grpo.val_period=3", "grpo.max_val_samples=4",
       "grpo.val_num_generations_per_prompt=1", "data.subset=five", "data.columns.question=prompt",
       "data.columns.answer=target", "data.streaming=true", "data.max_rows=24"]


@pytest.mark.slow
def test_a_run_on_a_streamed_hub_layout_dataset_resumes_exactly(tmp_path):
    """Train and validation from the repo (splits train and test), streamed to 24 rows, columns
    renamed; killed after step 3 and resumed: the same metrics and bit-identical weights."""
    from helpers import run_and_kill_after

    repo = write_hub_repo(tmp_path / "repo")
    args = ["run", "--run-dir", "run", f"data.train_path=hf:{repo}", f"data.validation_path=hf:{repo}", *RUN]
    env = {"HF_HOME": str(tmp_path / "hf-home")}
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    reference = run_grpoctl(*args, cwd=tmp_path / "a", timeout=600, **env)
    assert reference.returncode == 0, reference.stdout[-2000:] + reference.stderr[-3000:]
    os.environ.update(env)  # run_and_kill_after passes this process's environment on
    try:
        run_and_kill_after(args, tmp_path / "b", step=3)
    finally:
        os.environ.pop("HF_HOME")
    resumed = run_grpoctl("run", "--resume", "run", cwd=tmp_path / "b", timeout=600, **env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from step 2" in resumed.stdout
    a, b = tmp_path / "a" / "run", tmp_path / "b" / "run"
    assert [r["step"] for r in metrics_of(a)] == [1, 2, 3, 4, 5, 6]
    assert "val/accuracy" in metrics_of(a)[2]
    assert metrics_of(b) == metrics_of(a)
    assert final_weights(b) == final_weights(a)

    # Other rows under the same name: the resume is refused, not trained on.
    first = repo / "five" / "train.jsonl"
    first.write_text(first.read_text().replace(digits(0, 5), "99999", 1))
    changed = run_grpoctl("run", "--resume", "run", "grpo.max_num_steps=8", cwd=tmp_path / "b", timeout=600, **env)
    assert changed.returncode != 0 and "Traceback" not in changed.stderr
    assert "dataloader state does not match this run's data" in changed.stderr, changed.stderr[-2000:]
