"""The two ways to call ``AdvantageEstimator.compute_advantages``, and the bridge between them.

Plugin API 1 passed tensors and a bag of keywords, ``compute_advantages(rewards, group_ids, mask,
**extras)``; the protocol now takes one typed record, ``compute_advantages(batch:
AdvantageInput)``, whose fields are exactly the old arguments. Both keep working until a major
release removes the old form (docs/compatibility.md), each with a DeprecationWarning:

* an estimator *written* the old way is adapted where the registry loads it
  (``adapt_estimator_class``), so the loop only ever makes the new call;
* an estimator *called* the old way (a script, a test) works when its method carries
  ``@advantage_input``, as every built-in does.

Imports no torch.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from typing import Any, Callable

import attrs

from grpo_sdk.core.records import AdvantageInput

_P = inspect.Parameter
_POSITIONAL = (_P.POSITIONAL_ONLY, _P.POSITIONAL_OR_KEYWORD)
EXTRAS = tuple(f.name for f in attrs.fields(AdvantageInput) if f.name not in ("rewards", "group_ids", "mask"))
# How the loop called an estimator under plugin API 1 (what an adapted estimator must accept).
API1_CALL = inspect.Signature([_P("rewards", _P.POSITIONAL_OR_KEYWORD), _P("group_ids", _P.POSITIONAL_OR_KEYWORD),
                               _P("mask", _P.POSITIONAL_OR_KEYWORD), _P("extras", _P.VAR_KEYWORD)])


def input_of(rewards: Any, group_ids: Any, mask: Any, **extras: Any) -> AdvantageInput:
    """An old-form call's arguments as the record; an unknown keyword is a TypeError naming the fields."""
    unknown = sorted(set(extras) - set(EXTRAS))
    if unknown:
        raise TypeError(f"compute_advantages got unknown keyword(s) {unknown}; AdvantageInput has {list(EXTRAS)}")
    given = {k: v for k, v in extras.items() if v is not None}  # the old callers passed None for "absent"
    return AdvantageInput(rewards=rewards, group_ids=group_ids, mask=mask, **given)


def extras_of(batch: AdvantageInput) -> dict[str, Any]:
    """The record as API 1's ``**extras`` (what the loop passed before: every key, None when absent)."""
    return {name: getattr(batch, name) for name in EXTRAS}


def typed_call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> AdvantageInput | None:
    """The record when a call passed just one (``f(batch)`` or ``f(batch=batch)``), else None."""
    given = args if not kwargs else tuple(kwargs.values()) if not args and list(kwargs) == ["batch"] else ()
    return given[0] if len(given) == 1 and isinstance(given[0], AdvantageInput) else None


def advantage_input(method: Callable[[Any, AdvantageInput], Any]) -> Callable[..., Any]:
    """Decorate ``compute_advantages(self, batch: AdvantageInput)`` so that the old call,
    ``(rewards, group_ids, mask, **extras)``, reaches it too (with a DeprecationWarning)."""

    @functools.wraps(method)
    def compute_advantages(self: Any, *args: Any, **kwargs: Any) -> Any:
        batch = typed_call(args, kwargs)
        if batch is not None:
            return method(self, batch)
        if not kwargs and not args:
            raise TypeError("compute_advantages() needs an AdvantageInput")
        warnings.warn("compute_advantages(rewards, group_ids, mask, **extras) is plugin API 1's call; pass one "
                      "AdvantageInput(rewards=..., group_ids=..., mask=..., ...) instead",
                      DeprecationWarning, stacklevel=2)
        return method(self, input_of(*args, **kwargs))

    return compute_advantages


def takes_old_call(cls: type) -> bool:
    """The class's ``compute_advantages`` was written for API 1: past ``self`` it takes two or more
    positional arguments (``rewards, group_ids, mask``), not the one record."""
    method = getattr(cls, "compute_advantages", None)
    if not callable(method):
        return False
    try:
        params = [p for p in inspect.signature(method).parameters.values() if p.kind in _POSITIONAL][1:]  # past self
    except (TypeError, ValueError):
        return False
    return len(params) >= 2


_ADAPTED: dict[type, type] = {}  # one adapted class per API-1 class: isinstance keeps working across loads


def adapt_estimator_class(cls: type, name: str) -> type:
    """``cls`` itself, or for an API-1 estimator a subclass whose ``compute_advantages(batch)``
    makes the old call (isinstance checks and ``last_metrics`` still see the original class).
    The same subclass every time, and the DeprecationWarning once."""
    if not isinstance(cls, type) or not takes_old_call(cls):
        return cls
    if cls not in _ADAPTED:
        warnings.warn(f"the advantage estimator {name!r} ({cls.__module__}.{cls.__qualname__}) implements plugin API "
                      "1's compute_advantages(rewards, group_ids, mask, **extras); grpo-sdk adapts it for now: take "
                      "one AdvantageInput instead (docs/compatibility.md)", DeprecationWarning, stacklevel=2)
        old = cls.compute_advantages

        def compute_advantages(self: Any, *args: Any, **kwargs: Any) -> Any:
            batch = typed_call(args, kwargs)
            if batch is not None:
                return old(self, batch.rewards, batch.group_ids, batch.mask, **extras_of(batch))
            return old(self, *args, **kwargs)  # called the old way too, as its own tests and docs do

        # ``api1_estimator``: the class as written, which the contract kit checks against API1_CALL.
        _ADAPTED[cls] = type(cls.__name__, (cls,), {
            "compute_advantages": compute_advantages, "__module__": cls.__module__, "__qualname__": cls.__qualname__,
            "__doc__": cls.__doc__, "api1_estimator": cls})
    return _ADAPTED[cls]
