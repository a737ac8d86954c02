"""grpo-sdk: GRPO-family RL post-training of language models, as a small core plus plugins.

Importing this package is cheap on purpose: nothing here touches torch, transformers or ray.
The training loop and backends are imported when a run starts (`grpo_sdk.trainer`).
Plugin authors import from `grpo_sdk.plugins`.
"""

__all__ = ["__version__"]


def __getattr__(name: str) -> str:
    # Looked up on first use: importlib.metadata costs ~50 ms, paid by every `grpoctl` start-up otherwise.
    if name != "__version__":
        raise AttributeError(f"module 'grpo_sdk' has no attribute {name!r}")
    from importlib.metadata import PackageNotFoundError, version

    try:
        value = version("grpo-sdk")
    except PackageNotFoundError:  # running from a source tree that was never installed
        value = "0+unknown"
    globals()["__version__"] = value
    return value
