"""`grpoctl config validate` finds what `grpoctl run` would fail on at setup (cli/preflight.py):
missing data, model sources that name nothing, prompts longer than the sequence budget, and an
environment's generated prompts that do not fit; each problem printed with its key, exit 2."""

from __future__ import annotations

import json
import time

import pytest

from helpers import run_grpoctl
from grpo_sdk.cli.preflight import preflight
from grpo_sdk.config.loading import load_config


def problems_of(registry, *overrides: str, notes: list[str] | None = None) -> dict[str, str]:
    cfg = load_config(None, list(overrides), registry)
    found: dict[str, str] = {}
    for key, message in preflight(cfg, registry, notes):
        found[key] = f"{found[key]} | {message}" if key in found else message
    return found


def write_rows(path, count: int, width: int = 5):
    path.write_text("".join(json.dumps({"prompt": f"{i:0{width}d}"[-width:] + ">",
                                        "target": f"{i:0{width}d}"[-width:][::-1]}) + "\n" for i in range(count)))
    return path


def test_the_built_in_recipe_passes_and_says_what_it_checked(registry):
    notes: list[str] = []
    assert problems_of(registry, notes=notes) == {}
    assert notes[0].startswith("training prompts: 8 prompts checked, the longest 7 tokens (59 allowed)")
    assert notes[1].startswith("validation prompts: 128 prompts checked")


def test_missing_data_files_name_their_keys(registry, tmp_path):
    found = problems_of(registry, f"data.train_path={tmp_path}/train.jsonl",
                        f"data.validation_path={tmp_path}/val.parquet")
    assert found == {"data.train_path": f"{tmp_path}/train.jsonl: no such file or directory",
                     "data.validation_path": f"{tmp_path}/val.parquet: no such file or directory"}
    mixture = problems_of(registry, "data.use_multiple_dataloader=true",
                          f"data.datasets=[{{path: {write_rows(tmp_path / 'a.jsonl', 20)}}}, "
                          f"{{path: {tmp_path}/b.jsonl}}]")
    assert mixture == {"data.datasets": f"{tmp_path}/b.jsonl: no such file or directory"}


@pytest.mark.parametrize("name, message", [
    ("./no-model", "no model directory at ./no-model"),
    ("a/b/c", "no model directory at a/b/c"),
    ("bad~name", "'bad~name' is neither a local directory, nor builtin:NAME, nor a hub id (ORG/NAME)"),
    ("Qwen/Qwen2.5-0.5B", "'Qwen/Qwen2.5-0.5B' is a hub id, but the local cache does not hold it and the hub "
                          "cannot be reached (HF_HUB_OFFLINE=1 is set)"),
])
def test_model_sources_that_name_nothing_loadable(registry, name, message):
    found = problems_of(registry, f"policy.model_name={name}")
    assert found["policy.model_name"].startswith(message), found


def test_a_hub_id_in_the_cache_passes_offline(registry, tmp_path, monkeypatch):
    from huggingface_hub import constants

    snapshot = tmp_path / "models--acme--tiny" / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (tmp_path / "models--acme--tiny" / "refs").mkdir()
    (tmp_path / "models--acme--tiny" / "refs" / "main").write_text("a" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    assert "policy.model_name" not in problems_of(registry, "policy.model_name=acme/tiny")
    assert "policy.tokenizer.name" in problems_of(registry, "policy.tokenizer.name=acme/other")


def test_a_prompt_longer_than_the_budget_is_found_in_a_1000_row_file(registry, tmp_path):
    path = write_rows(tmp_path / "d.jsonl", 1000)
    lines = path.read_text().splitlines()
    lines[736] = json.dumps({"prompt": "1234567890" * 7 + ">", "target": "0"})  # 72 tokens with <bos>
    path.write_text("\n".join(lines) + "\n")
    notes: list[str] = []
    start = time.perf_counter()
    found = problems_of(registry, f"data.train_path={path}", notes=notes)
    elapsed = time.perf_counter() - start
    assert found == {"policy.max_total_sequence_length": f"{path} line 737: prompt is 72 tokens, longer than the 59 "
                     "allowed (data.max_input_seq_length, or policy.max_total_sequence_length - "
                     "policy.generation.max_new_tokens); data.filter_long_prompts=true drops such prompts"}
    assert elapsed < 30, elapsed  # measured ~0.1 s for the file once transformers is imported (docs/data.md)
    notes = []
    assert problems_of(registry, f"data.train_path={path}", "data.filter_long_prompts=true", notes=notes) == {}
    assert notes[0].startswith("training prompts: 999 prompts checked, the longest 7 tokens (59 allowed)")


def test_a_local_tokenizer_directory_is_used(registry, tmp_path, tiny_model_dir):
    path = write_rows(tmp_path / "d.jsonl", 40)
    notes: list[str] = []
    assert problems_of(registry, f"policy.model_name={tiny_model_dir}", f"data.train_path={path}",
                       "policy.max_total_sequence_length=12", "policy.generation.max_new_tokens=5",
                       notes=notes) == {}
    assert "40 prompts checked, the longest 7 tokens (7 allowed)" in notes[0]
    found = problems_of(registry, f"policy.model_name={tiny_model_dir}", f"data.train_path={path}",
                        "policy.max_total_sequence_length=11", "policy.generation.max_new_tokens=5")
    assert "line 1: prompt is 7 tokens, longer than the 6 allowed" in found["policy.max_total_sequence_length"]


def test_generated_prompts_that_do_not_fit(registry):
    found = problems_of(registry, "env.reverse_digits.num_digits=70")
    assert found == {"policy.max_total_sequence_length":
                     "reverse_digits prompt 0: prompt is 72 tokens, longer than the 59 allowed (data.max_input_seq_"
                     "length, or policy.max_total_sequence_length - policy.generation.max_new_tokens) | "
                     "reverse_digits validation prompt 0: prompt is 72 tokens, longer than the 59 allowed "
                     "(data.max_input_seq_length, or policy.max_total_sequence_length - "
                     "policy.generation.max_new_tokens)"}


def test_a_dataset_smaller_than_a_step(registry, tmp_path):
    found = problems_of(registry, f"data.train_path={write_rows(tmp_path / 'd.jsonl', 5)}")
    assert found["data.train_path"].startswith(f"data.train_path: {tmp_path}/d.jsonl holds 5 prompts, fewer than "
                                               "the grpo.num_prompts_per_step=8")


def test_grpoctl_config_validate_prints_each_problem_with_its_key_and_exits_2(tmp_path):
    proc = run_grpoctl("config", "validate", "data.train_path=missing.jsonl", "policy.model_name=./none",
                       "env.reverse_digits.num_digits=70", cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert "error: 2 config problems:\n  policy.model_name: no model directory at ./none\n" \
           "  data.train_path: missing.jsonl: no such file or directory\n" in proc.stderr
    budget = run_grpoctl("config", "validate", "policy.generation.max_new_tokens=64", cwd=tmp_path, timeout=120)
    assert budget.returncode == 2 and "policy.generation.max_new_tokens: 64 leaves no room for a prompt within " \
                                      "policy.max_total_sequence_length=64" in budget.stderr


def test_validate_never_imports_torch_for_the_built_in_tokenizer(tmp_path):
    blocker = tmp_path / "torch"
    blocker.mkdir()
    (blocker / "__init__.py").write_text("raise ImportError('config validate must not import torch')\n")
    path = write_rows(tmp_path / "d.jsonl", 50)
    proc = run_grpoctl("config", "validate", f"data.train_path={path}", cwd=tmp_path, timeout=120,
                       PYTHONPATH=str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "training prompts: 50 prompts checked" in proc.stdout


def test_the_torch_free_built_in_tokenizer_gives_the_runs_token_ids():
    from grpo_sdk.cli.preflight import BackendTokenizer
    from grpo_sdk.recipes.tiny_model import build_char_tokenizer, char_tokenizer_backend

    texts = ["12345>", "a+b=>", "What?", ""]
    run, light = build_char_tokenizer(), BackendTokenizer(char_tokenizer_backend())
    assert light(texts)["input_ids"] == run(texts, add_special_tokens=True)["input_ids"]
    assert light(texts, add_special_tokens=False)["input_ids"] == run(texts, add_special_tokens=False)["input_ids"]
    assert (light.eos_token_id, light.pad_token_id) == (run.eos_token_id, run.pad_token_id)
