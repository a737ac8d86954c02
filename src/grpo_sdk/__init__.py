"""grpo-sdk: GRPO-family RL post-training of language models, as a small core plus plugins.

Importing this package is cheap on purpose: nothing here touches torch, transformers or ray.
The training loop and backends are imported when a run starts (`grpo_sdk.trainer`).
Plugin authors import from `grpo_sdk.plugins`.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("grpo-sdk")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = ["__version__"]
