"""The building blocks of the config classes: plugin slots, removed keys, shared validators and bounds.

Every section module (``grpo``, ``policy``, ``master``) declares its fields with ``option`` (from
``grpo_sdk.core.options``) and the validators below.
"""

from __future__ import annotations

from typing import Any

import attrs
from attrs import validators as v

from grpo_sdk.core.kinds import KIND


def internal_field() -> Any:
    # Filled by the loader; not a key users write.
    return attrs.field(factory=dict, metadata={"internal": True})


def raw_blocks_field() -> Any:
    # Every plugin block as written in the YAML, keyed by plugin name, selected or not (dumped back as is).
    return internal_field()


def structured_blocks_field() -> Any:
    # The selected plugins' blocks structured into their config classes (None: the plugin takes no options).
    return internal_field()


@attrs.frozen
class RemovedOption:
    """A key an earlier release had, declared in its class's ``__removed__`` mapping (key -> RemovedOption).

    A run's ``config.resolved.yaml`` lists every key, so ``--resume`` of an older run meets removed
    keys: at a value in ``inert`` (values that had no effect) the key is dropped, silently at
    ``inert[0]`` (the old default) and with a one-line warning otherwise; any other value is an error
    saying the option was removed and ``why``::

        __removed__ = {"async_engine": RemovedOption(inert=(False,), why="the loop is synchronous")}
    """

    inert: tuple[Any, ...]
    why: str


@attrs.frozen(kw_only=True)
class PluginSlot:
    """Marks a section as pluggable: which component kind it selects and by which key."""

    kind: str
    selector: str
    many: bool = False  # the selector holds a list of names (loggers)

    @classmethod
    def of(cls, kind: str) -> PluginSlot:
        """The slot of ``kind``, as the kinds table (``core.kinds``) declares it."""
        entry = KIND[kind]
        return cls(kind=kind, selector=entry.selector, many=entry.many)


positive = v.gt(0)
non_negative = v.ge(0)

# Upper bounds on sizes, so an absurd number is a config error at `config validate` instead of gigabytes
# spent before the first step (issue 12). Each is far past any real run: NeMo-RL's largest recipes use
# ~32k rows per step, and the longest-context open models 1-10M tokens.
MAX_ROWS = 2**20  # rows of one rollout or validation batch, and prompts per step
MAX_TOKENS = 2**24  # any sequence length
MAX_THREADS = 4096  # threads or processes one machine runs (torch.set_num_threads takes a C int)
MAX_MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc's HEAP_MAX / 2 on 64-bit: mallopt refuses more
MAX_TIMEOUT_S = 30 * 24 * 3600.0  # a deadline on one call; longer ones overflow some timers and are typos

row_count = [positive, v.le(MAX_ROWS)]
token_count = [positive, v.le(MAX_TOKENS)]


def non_empty(instance: Any, attribute: Any, value: str | None) -> None:
    # An empty key matches no row, so every row would fail to load with a confusing message.
    if value is not None and not value:
        raise ValueError("must not be empty")

