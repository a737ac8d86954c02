"""The KV of finished rows, kept so that a continuation does not prefill it again.

A multi-turn episode's next prompt is its last prompt, the tokens it sampled and the environment's
turn: everything but the new turn was already in the sampler's KV cache when the row finished.
``PrefixCache`` keeps each finished row's keys and values (prompt + sampled tokens, less the last
token, whose forward pass never ran) under those token ids, least recently used first out, within a
token budget (``policy.generation.hf.prefix_cache_tokens``). A new row whose prompt extends a kept
sequence prefills only the rest (``ContinuousSampler``). Entries are valid for one weight version: a
weight update makes them stale, and ``finish_generation`` drops them all (a colocated policy trains
next and wants the memory).
"""

from __future__ import annotations

import collections

import attrs
import torch


@attrs.define(eq=False)
class Prefix:
    version: int
    layers: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values [heads, tokens, dim]

    @property
    def tokens(self) -> int:
        return self.layers[0][0].shape[-2] if self.layers else 0


class PrefixCache:
    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self.entries: collections.OrderedDict[tuple[int, ...], Prefix] = collections.OrderedDict()
        self.tokens = 0
        self.hits = 0  # prompts that reused a kept prefix
        self.reused_tokens = 0  # prompt tokens not prefilled thanks to it

    @property
    def enabled(self) -> bool:
        return self.max_tokens > 0

    def store(self, sequence: list[int], version: int, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Keep ``layers`` (the KV of ``sequence``, one per token) for ``version``'s weights."""
        if not sequence or len(sequence) > self.max_tokens:
            return
        key = tuple(sequence)
        old = self.entries.pop(key, None)
        if old is not None:
            self.tokens -= old.tokens
        self.entries[key] = Prefix(version=version, layers=layers)
        self.tokens += len(key)
        while self.tokens > self.max_tokens:
            _, evicted = self.entries.popitem(last=False)
            self.tokens -= evicted.tokens

    def lookup(self, prompt: list[int], version: int) -> tuple[int, Prefix] | None:
        """The longest kept sequence of ``version`` that is a proper prefix of ``prompt`` (a row needs
        at least one token to prefill: the logits of its first sampled token come from it)."""
        best: tuple[int, tuple[int, ...]] | None = None
        for key, prefix in list(self.entries.items()):
            if prefix.version != version:  # stale: new weights would read the old weights' cache
                del self.entries[key]
                self.tokens -= prefix.tokens
            elif len(key) < len(prompt) and (best is None or len(key) > best[0]) and tuple(prompt[:len(key)]) == key:
                best = (len(key), key)
        if best is None:
            return None
        self.entries.move_to_end(best[1])
        self.hits += 1
        self.reused_tokens += best[0]
        return best[0], self.entries[best[1]]

    def clear(self) -> None:
        self.entries.clear()
        self.tokens = 0
