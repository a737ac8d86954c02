"""Loading a run config: defaults, then ``-c`` files, then dotted overrides, then strict structuring.

Precedence is class defaults < files (left to right) < overrides; ``grpo_sdk.config.files``
reads the files and applies the overrides (the Hydra subset: ``a.b=v``, ``~a.b``, ``+a.b=v``),
``grpo_sdk.config.structure`` structures the result into the config classes, reporting every
problem at once, and ``grpo_sdk.config.checks`` checks the rules between fields.

Example::

    cfg = load_config(["recipe.yaml"], ["grpo.num_prompts_per_step=8"], registry)
    cfg.grpo.num_prompts_per_step   # 8
"""

from __future__ import annotations

import copy
import difflib
import logging
import weakref
from typing import Any

import attrs
import yaml

from grpo_sdk.config import schema as C
from grpo_sdk.config.checks import check_config, config_warnings
from grpo_sdk.config.files import BUILTIN_RECIPE, raw_config
from grpo_sdk.config.structure import Structurer
from grpo_sdk.core.errors import ConfigError

__all__ = ["BUILTIN_RECIPE", "Structurer", "check_config", "dump_config", "load_config", "raw_config", "to_yaml"]

log = logging.getLogger(__name__)


_STRUCTURERS: weakref.WeakKeyDictionary[Any, dict[tuple[tuple[str, str], ...], Structurer]] = \
    weakref.WeakKeyDictionary()


def structurer_for(registry: Any) -> Structurer:
    """The registry's Structurer, made once: cattrs generates a structuring function per class (about
    0.5 ms each, 4x the cost of structuring a config), and a converter keeps them."""
    sections = {s.name: s.config for s in registry.host.config_sections()}
    try:
        by_sections = _STRUCTURERS.setdefault(registry, {})
    except TypeError:  # a registry stand-in that takes no weak reference: no cache
        return Structurer(registry, sections)
    key = tuple(sorted(sections.items()))
    if key not in by_sections:  # a proxy: the cache must not keep the registry alive
        by_sections[key] = Structurer(weakref.proxy(registry), sections)
    return by_sections[key]


def load_config(files: list[str] | None, overrides: list[str] | None, registry: Any) -> C.MasterConfig:
    """Defaults < files < overrides, structured strictly and cross-checked; raises ConfigError."""
    raw = raw_config(files, overrides)
    warnings: list[tuple[str, str]] = []
    cfg = structurer_for(registry).structure(raw, warnings=warnings)
    problems = unknown_resets(cfg, overrides or []) + check_config(cfg, registry)
    if problems:
        raise ConfigError(problems)
    # Not fatal, but loud: the CLI configures no logging, so these reach stderr as they are.
    for key, message in warnings + config_warnings(cfg, registry):
        log.warning("grpo-sdk: warning: %s: %s", key, message)
    return cfg


def unknown_resets(cfg: C.MasterConfig, overrides: list[str]) -> list[tuple[str, str]]:
    """``~key`` overrides whose key the config does not have (a typo would otherwise reset nothing)."""
    resets = [text[1:] for text in overrides if text.startswith("~")]
    tree = dump_config(cfg) if resets else {}
    problems = []
    for path in resets:
        node, parts = tree, path.split(".")
        for i, part in enumerate(parts):
            if isinstance(node, dict) and part in node:
                node = node[part]
                continue
            close = difflib.get_close_matches(part, sorted(node) if isinstance(node, dict) else [], n=1)
            hint = f"; did you mean ~{'.'.join(parts[:i] + close)}?" if close else ""
            problems.append((f"~{path}", f"is not a key of this config (nor of a selected plugin's block){hint}"))
            break
    return problems


# --- dumping --------------------------------------------------------------------------------------


def dump_config(obj: Any) -> Any:
    """A YAML-ready dict of a config; selected plugin blocks are written out in full."""
    if attrs.has(type(obj)):
        out: dict[str, Any] = {}
        for field in attrs.fields(type(obj)):
            if field.metadata.get("internal"):
                continue
            out[field.name] = dump_config(getattr(obj, field.name))
        if getattr(type(obj), "__plugin__", None) is not None:
            for name, block in obj.raw_blocks.items():
                out[name] = copy.deepcopy(block)
            for name, plugin_cfg in obj.structured_blocks.items():
                out[name] = dump_config(plugin_cfg) if plugin_cfg is not None else {}
        if isinstance(obj, C.MasterConfig):
            for name, section in obj.extra_sections.items():
                out[name] = dump_config(section)
        return out
    if isinstance(obj, (list, tuple)):
        return [dump_config(x) for x in obj]
    if isinstance(obj, dict):
        return {k: dump_config(x) for k, x in obj.items()}
    return obj


def to_yaml(cfg: C.MasterConfig) -> str:
    return yaml.safe_dump(dump_config(cfg), sort_keys=False, default_flow_style=False)
