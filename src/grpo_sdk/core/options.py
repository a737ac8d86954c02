"""How a documented option is declared: ``option(default, help)``, an attrs field with its help text.

The run config (``grpo_sdk.config.schema``) and every component's own config class declare their
fields with it (``grpoctl config schema`` and the docs print the help), so it belongs to the
contract plugin authors import (``grpo_sdk.plugins.option``). Light: attrs only.
"""

from __future__ import annotations

from typing import Any

import attrs


def option(default: Any = attrs.NOTHING, help: str = "", *, factory: Any = None, validator: Any = None) -> Any:
    """An attrs field with its documentation attached (``grpoctl config schema`` prints it)."""
    if factory is not None:
        return attrs.field(factory=factory, validator=validator, metadata={"help": help})
    return attrs.field(default=default, validator=validator, metadata={"help": help})
