"""Which policy a colocated generation of this process samples with (light: no torch here).

A generation backend that can run on its policy's own model (the megatron and hf backends, in one
process: ``cluster.runtime=local``) finds that policy here instead of loading a second copy. The
policy is built first and publishes itself with :func:`publish_policy`; the generation, built next
with the same ``RunContext``, finds it with :func:`published_policy`. Keyed by run directory and model
path, so a teacher loaded from another model is never taken for the policy. Public through
``grpo_sdk.plugins.toolkit``.
"""

from __future__ import annotations

import weakref
from typing import Any

_published: dict[tuple[str, str], weakref.ref] = {}


def _key(context: Any) -> tuple[str, str]:
    return str(context.run_dir), str(context.model_path)


def publish_policy(context: Any, policy: Any) -> None:
    """Make ``policy`` findable by a generation built with the same run and model. The first one wins:
    a teacher policy built later from the same model must not replace the trained policy. Held weakly,
    so a shut-down policy is not kept alive by this."""
    ref = _published.get(_key(context))
    if ref is None or ref() is None:
        _published[_key(context)] = weakref.ref(policy)


def published_policy(context: Any) -> Any | None:
    """The policy published for this run and model, or None."""
    ref = _published.get(_key(context))
    return ref() if ref is not None else None


def forget_policy(context: Any) -> None:
    """Drop the policy published for this run and model (its ``shutdown``)."""
    _published.pop(_key(context), None)
