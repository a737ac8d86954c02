"""Colocated megatron generation: which runs share the megatron policy's model, and how the generation
finds it (light: no torch here; the config checks import it).

A megatron generation shares the policy's ``GPTModel`` (no second copy, no weight conversion on
refit) only when both live in one process: ``cluster.runtime=local`` with
``policy.generation.colocated.enabled``. The policy is built first and publishes itself here with
:func:`publish`; the generation, built next with the same ``RunContext``, finds it with :func:`lookup`.
On Ray the policy and the generation are separate actors, so each generation replica
holds its own model and takes the policy's weights in Hugging Face names (the seed instead runs
colocated generation inside the policy workers: not built here).
"""

from __future__ import annotations

import weakref
from typing import Any

_published: dict[tuple[str, str], weakref.ref] = {}


def shares_policy_model(config: Any) -> bool:
    """Whether a megatron generation of this run generates on the megatron policy's own model."""
    return (config.policy.backend == "megatron" and bool(config.policy.generation.colocated.enabled)
            and config.cluster.runtime == "local")


def _key(context: Any) -> tuple[str, str]:
    return str(context.run_dir), str(context.model_path)


def publish(context: Any, policy: Any) -> None:
    """Make ``policy`` findable by a generation built with the same run and model. The first one wins:
    a teacher policy built later from the same model must not replace the trained policy. Held weakly,
    so a shut-down policy is not kept alive by this."""
    ref = _published.get(_key(context))
    if ref is None or ref() is None:
        _published[_key(context)] = weakref.ref(policy)


def lookup(context: Any) -> Any | None:
    """The policy published for this run and model, or None."""
    ref = _published.get(_key(context))
    return ref() if ref is not None else None


def forget(context: Any) -> None:
    _published.pop(_key(context), None)
