"""``RunContext`` gives components what they need: absolute paths, the tokenizer's EOS and pad ids,
the seed, rank and world size (docs/plugins.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import small_trainer

from grpo_sdk.config.loading import load_config
from grpo_sdk.plugins import ComponentSpec, RunContext, hookimpl
from grpo_sdk.plugins.toolkit import load_tokenizer

SEEN: list[RunContext] = []


class ContextProbe:
    """A logger that keeps the context it was built with."""

    def __init__(self, config, context):
        SEEN.append(context)

    def log_metrics(self, step, metrics): ...

    def close(self): ...


class Components:
    @hookimpl
    def grpo_components(self):
        return [ComponentSpec(name="context_probe", kind="logger", impl=f"{__name__}:ContextProbe")]


pytestmark = pytest.mark.hook_plugin(Components())


def context_of(registry, cfg_overrides=(), **fields) -> RunContext:
    cfg = load_config(None, list(cfg_overrides), registry)
    base = dict(config=cfg, run_dir="run", model_path="m", tokenizer_path="m", device="cpu", seed=1,
                needs_reference=False)
    return RunContext(**{**base, **fields})


def test_paths_are_absolute_whoever_builds_the_context(registry, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "tiny").mkdir(parents=True)
    context = context_of(registry, run_dir="runs/../runs/a", model_path="./models/tiny", tokenizer_path="models/tiny")
    assert context.run_dir == tmp_path / "runs" / "a" and context.run_dir.is_absolute()
    assert context.model_path == context.tokenizer_path == str(tmp_path / "models" / "tiny")
    # A hub id names no local directory and stays as written; a missing local path still becomes absolute
    # (so its error names the full path).
    hub = context_of(registry, model_path="Qwen/Qwen2.5-1.5B", tokenizer_path="./missing")
    assert hub.model_path == "Qwen/Qwen2.5-1.5B" and hub.tokenizer_path == str(tmp_path / "missing")
    # attrs.evolve (the teacher's context, a Ray worker's) keeps them absolute.
    monkeypatch.chdir(tmp_path / "models")
    import attrs

    assert attrs.evolve(context, rank=1).run_dir == tmp_path / "runs" / "a"


def test_new_fields_have_defaults(registry):
    context = context_of(registry)
    assert (context.eos_token_id, context.pad_token_id, context.rank, context.world_size) == (None, None, 0, 1)


def test_a_component_sees_absolute_paths_and_the_tokenizer_ids(registry, tiny_model_dir, tmp_path, monkeypatch):
    """The run directory given relative (``grpoctl run --run-dir runs/exp1``): every component's context
    holds it absolute, and the EOS and pad ids of the run's tokenizer, without loading it itself."""
    monkeypatch.chdir(tmp_path)
    SEEN.clear()
    trainer = small_trainer(registry, Path("runs/exp1"), tiny_model_dir, "logger.loggers=[context_probe]",
                            "grpo.seed=11")
    try:
        (context,) = SEEN
        assert context is trainer.components.context
        assert context.run_dir == tmp_path / "runs" / "exp1"
        assert Path(context.model_path).is_absolute() and Path(context.tokenizer_path).is_absolute()
        tokenizer = load_tokenizer(str(tiny_model_dir))
        assert (context.eos_token_id, context.pad_token_id) == (tokenizer.eos_token_id, tokenizer.pad_token_id)
        assert isinstance(context.eos_token_id, int) and isinstance(context.pad_token_id, int)
        assert (context.seed, context.rank, context.world_size) == (11, 0, 1)
    finally:
        trainer.shutdown()
