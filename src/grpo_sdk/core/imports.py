"""Importing an object named by a ``"package.module:Attr.sub"`` string (entry points, specs, sections)."""

from __future__ import annotations

import importlib
from typing import Any


def import_target(target: str) -> Any:
    """Import ``"package.module:Attr.sub"`` and return the attribute."""
    module_name, _, attr = target.partition(":")
    obj = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj
