"""grpo-sdk: GRPO-family RL post-training of language models, as a small core plus plugins.

The Python API (``grpo_sdk.api``; the same runs as `grpoctl run`)::

    import grpo_sdk

    summary = grpo_sdk.train("recipe.yaml", overrides=["grpo.max_num_steps=50"], reward_funcs=[my_reward])
    config = grpo_sdk.load_config("recipe.yaml", overrides=["grpo.seed=3"])
    summary = grpo_sdk.Trainer(config, run_dir="runs/x").train()

Importing this package is cheap on purpose: nothing here touches torch, transformers or ray, and
the names below are looked up on first use. The training loop and backends are imported when a
run starts. Plugin authors import from ``grpo_sdk.plugins``.
"""

__all__ = [
    "ConfigError",
    "DataError",
    "GrpoSdkError",
    "MasterConfig",
    "ModelLoadError",
    "PluginError",
    "RunStatus",
    "RunSummary",
    "Trainer",
    "__version__",
    "export_model",
    "load_config",
    "train",
]

# The one place the version is written: pyproject.toml reads it (tool.setuptools.dynamic), so
# `grpoctl --version` needs no importlib.metadata lookup (~10-50 ms at start-up).
__version__ = "0.1.0"

_LAZY = {
    "train": "grpo_sdk.api", "load_config": "grpo_sdk.api", "Trainer": "grpo_sdk.api",
    "export_model": "grpo_sdk.api",
    "MasterConfig": "grpo_sdk.config.schema",
    "RunStatus": "grpo_sdk.core.records", "RunSummary": "grpo_sdk.core.records",
    "GrpoSdkError": "grpo_sdk.core.errors", "ConfigError": "grpo_sdk.core.errors",
    "DataError": "grpo_sdk.core.errors", "PluginError": "grpo_sdk.core.errors",
    "ModelLoadError": "grpo_sdk.core.errors",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
    else:
        raise AttributeError(f"module 'grpo_sdk' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
