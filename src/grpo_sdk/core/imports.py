"""Importing an object named by a ``"package.module:Attr.sub"`` string (entry points, specs, sections)."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any


def import_target(target: str) -> Any:
    """Import ``"package.module:Attr.sub"`` and return the attribute."""
    module_name, _, attr = target.partition(":")
    obj = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def import_module_here_too(name: str) -> Any:
    """Import module ``name``, finding ``name.py`` in the current directory too, but after installed
    packages and only for this import (a ./tokenizers.py must not shadow the real one for the whole
    run): what ``grpoctl run -p NAME`` and a reward function named ``module:function`` do."""
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:
        sys.path.append(cwd)
    try:
        return importlib.import_module(name)
    finally:
        if added:
            sys.path.remove(cwd)
