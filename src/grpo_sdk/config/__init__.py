"""The run configuration: its schema, how it is loaded, and every rule it is checked against.

Where a config is validated has one answer: ``load_config`` (from ``grpo_sdk.config.loading``).
It reads the built-in defaults, the ``-c`` files and the dotted overrides, structures the result
strictly into ``MasterConfig`` and runs ``check_config``, the list of every cross-field rule; it
raises ``ConfigError`` with every problem at once and logs ``config_warnings``::

    from grpo_sdk.config import load_config
    cfg = load_config(["recipe.yaml"], ["grpo.num_prompts_per_step=8"], registry)

The package, in the order a config flows through it:

* ``schema``: the attrs classes, every option declared with ``option(default, help)``;
* ``files``: YAML files, ``defaults:`` chains and overrides, into plain data;
* ``structure``: plain data into the classes, strictly (cattrs);
* ``checks``: the rules between fields, one module per domain;
* ``loading``: the steps above in order, and dumping a config back to YAML;
* ``context``: ``RunContext``, what every component is built with besides its own block.

It imports ``grpo_sdk.core`` (the contract) and nothing else of grpo-sdk. Light to import (no
torch), and the names below are looked up on first use, so importing ``grpo_sdk.config.schema``
does not load the loader.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["ConfigError", "MasterConfig", "RunContext", "check_config", "config_warnings", "dump_config",
           "load_config", "to_yaml"]

_LAZY = {
    "load_config": "grpo_sdk.config.loading", "dump_config": "grpo_sdk.config.loading",
    "to_yaml": "grpo_sdk.config.loading",
    "check_config": "grpo_sdk.config.checks", "config_warnings": "grpo_sdk.config.checks",
    "MasterConfig": "grpo_sdk.config.schema", "RunContext": "grpo_sdk.config.context",
    "ConfigError": "grpo_sdk.core.errors",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
