"""The hf backend's continuous-batching sampler (``policy.generation.hf.continuous_batching``).

What the whole-batch loop paid for, this does not:

* **Finished rows leave.** A row that samples a stop token or reaches its budget is dropped from the
  decode batch and its KV cache at once (the cache's rows are compacted, and columns that are
  padding for every remaining row are cut), so a long-tailed batch costs about the sum of its rows'
  lengths, not rows x longest.
* **Waiting rows are admitted.** At most ``max_num_seqs`` rows decode at once; the others wait and
  are prefilled and merged into the running batch as slots free up (continuous batching), whichever
  request they belong to (``submit`` and ``generate`` calls from any thread share the batch).
* **One prefill per prompt.** Rows admitted together whose prompts are the same token ids (the G
  samples of a group) share one prefill; the cache is expanded by reference to its rows.
* **A row's tokens are its own.** Each row's randomness is a counter-based function of its seed and
  the token's index (``row_uniforms``), so its tokens do not depend on what else is in the batch or
  when it was admitted (up to the last-bit differences of batched float kernels, which can flip a
  near-tie).

The KV cache is a transformers ``DynamicCache``; rows share one column layout, left-padded, with
per-row position ids. Weight versions are tracked per token, and a weight update lands between two
steps exactly as in the whole-batch loop (``StepGate``): the next forward either re-prefills every
running row under the new weights (recompute) or reads the old cache (keep).
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import attrs
import torch

from grpo_sdk.backends.hf.kv_cache import GrowingCache, GrowingLayer
from grpo_sdk.backends.hf.prefix_cache import PrefixCache
from grpo_sdk.plugins import GenerationInput, GenerationOutput, SamplingParams
from grpo_sdk.plugins.tensors import left_pad, position_ids_for, sample_rows, signed_seed


@attrs.define(eq=False)
class Row:
    request: Any
    prompt: list[int]
    budget: int
    sampling: SamplingParams
    stop_ids: frozenset[int]
    seed: int  # with the token's index, all of the row's randomness (row_uniforms)
    tokens: list[int] = attrs.field(factory=list)
    logprobs: list[float] = attrs.field(factory=list)
    versions: list[int] = attrs.field(factory=list)
    stopped: bool = False

    @property
    def done(self) -> bool:
        return self.stopped or len(self.tokens) >= self.budget


@attrs.define(eq=False)
class Request:
    request_id: Any
    rows: list[Row]
    version: int  # the weights' version when the request arrived: its output's version if it samples nothing
    open: int = 0  # rows not yet done
    error: BaseException | None = None  # set when a step failed while the request was in the sampler


def _rebuild(cache: Any, change: Callable[[torch.Tensor], torch.Tensor], room: int) -> None:
    """Apply ``change`` to every layer's keys and values, leaving ``room`` spare columns for decoding."""
    layers = getattr(cache, "layers", None)
    if layers is None or any(not hasattr(layer, "set") for layer in layers):
        raise RuntimeError("policy.generation.hf.continuous_batching needs a cache of keys and values per layer; "
                           "this model's cache is another kind: set it to false")
    for layer in layers:
        layer.set(change(layer.keys), change(layer.values), room=room)


def _room(rows: list[Row]) -> int:
    """Columns the running rows can still write: the longest remaining budget."""
    return max((r.budget - len(r.tokens) for r in rows), default=0) + 1


def _pad_left(tensor: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    extra = width - tensor.shape[dim]
    if extra == 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = extra
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)


class ContinuousSampler:
    """Rows in, finished requests out: ``add`` queues a request's rows, ``step`` runs one decode step of
    every running row (admitting waiting rows first) and returns the requests it completed. Not
    thread-safe: the host (``HFGeneration``) calls it under a lock."""

    def __init__(self, host: Any, max_num_seqs: int, prefix_cache_tokens: int = 0):
        self.host = host
        self.max_num_seqs = max_num_seqs
        self.prefixes = PrefixCache(prefix_cache_tokens)
        self.waiting: collections.deque[Row] = collections.deque()
        self.rows: list[Row] = []  # running, aligned with the batch dimension below
        self.cache: Any = None
        self.mask: torch.Tensor | None = None  # [n, L] long
        self.positions: torch.Tensor | None = None  # [n, 1]: the position of each row's next token
        self.logits: torch.Tensor | None = None  # [n, V]: each row's next-token logits
        self.logits_versions: list[int] = []  # per running row: the weights that gave its logits
        self.version = 0  # the weights that wrote the cache's newest column (the oldest, after a merge)
        self.steps = 0  # decode steps since the sampler was last idle: the seam's step number
        self.decode_rows = 0  # row-forwards run by decode steps (a benchmark's count of compute)

    @property
    def idle(self) -> bool:
        return not self.rows and not self.waiting

    def add(self, request_id: Any, prompts: GenerationInput, sampling: SamplingParams, seeds: list[int],
            budgets: list[int], stop_ids: frozenset[int]) -> Request:
        ids, pads = prompts.input_ids.tolist(), (prompts.attention_mask == 0).sum(1).tolist()  # left padding
        request = Request(request_id=request_id, rows=[], version=self.host.weight_version)
        for i, seed in enumerate(seeds):
            row = Row(request=request, prompt=ids[i][pads[i]:], budget=budgets[i], sampling=sampling,
                      stop_ids=stop_ids, seed=signed_seed(seed))
            request.rows.append(row)
            if not row.done:
                request.open += 1
                self.waiting.append(row)
        return request

    def cancel(self, request_ids: set[Any]) -> None:
        self.waiting = collections.deque(r for r in self.waiting if r.request.request_id not in request_ids)
        keep = [i for i, r in enumerate(self.rows) if r.request.request_id not in request_ids]
        if len(keep) < len(self.rows):
            self._select(keep)

    def fail(self, error: BaseException) -> None:
        """A step failed: every request in the sampler gets the error, and the sampler starts afresh."""
        for row in [*self.rows, *self.waiting]:
            row.request.error = error
        self.waiting.clear()
        self.rows, self.logits_versions, self.steps = [], [], 0
        self.cache = self.mask = self.positions = self.logits = None

    def step(self, between: Callable[[int], None]) -> list[Request]:
        """Admit, sample one token per running row, drop the finished rows, and run the forward pass of
        the rest (``between(step)`` first: where an in-flight weight update lands)."""
        self._admit()
        if not self.rows:
            return []
        finished = self._sample()
        if self.prefixes.enabled:
            self._keep_prefixes(finished)
        completed = []
        for row in finished:
            row.request.open -= 1
            if row.request.open == 0:
                completed.append(row.request)
        if finished:
            done = {id(row) for row in finished}
            self._select([i for i, r in enumerate(self.rows) if id(r) not in done])
        self.steps += 1
        if self.rows:
            between(self.steps)
            self._decode()
        elif not self.waiting:
            self.steps = 0
        return completed

    def _admit(self) -> None:
        room = self.max_num_seqs - len(self.rows)
        if room <= 0 or not self.waiting:
            return
        admitted = [self.waiting.popleft() for _ in range(min(room, len(self.waiting)))]
        host = self.host
        try:
            with host._gate.forward():
                version = host.weight_version
                found = [self.prefixes.lookup(r.prompt, version) if self.prefixes.enabled else None for r in admitted]
                fresh = [r for r, hit in zip(admitted, found) if hit is None]
                reused = [(r, hit) for r, hit in zip(admitted, found) if hit is not None]
                parts = []
                if fresh:
                    parts.append((fresh, *self._prefill([r.prompt for r in fresh], _room(fresh))))
                if reused:
                    rows = [r for r, _ in reused]
                    parts.append((rows, *self._prefill_after([hit for _, hit in reused], rows, _room(rows))))
        except BaseException:
            self.waiting.extendleft(reversed(admitted))  # still the sampler's: a failure reaches them
            raise
        for rows, cache, mask, logits in parts:
            positions = mask.sum(1, keepdim=True)  # a row's next position: its token count, gaps excluded
            if not self.rows:
                self.cache, self.mask, self.positions, self.logits = cache, mask, positions, logits
                self.version = version  # else the older rows' cache is the staler: a recompute redoes every row
            else:
                self._merge(cache, mask, positions, logits, _room(self.rows + rows))
            self.rows += rows
            self.logits_versions += [version] * len(rows)

    def _prefill_after(self, hits: list[tuple[int, Any]], rows: list[Row], room: int) -> tuple[Any, torch.Tensor,
                                                                                              torch.Tensor]:
        """Prefill only what follows each row's kept prefix: the prefixes' KV, left-padded to one width,
        is the past; each row's rest is right-aligned after it (a masked gap between them where the rest
        is shorter than the longest). The cache, mask and last logits, one row per row."""
        host = self.host
        lengths = torch.tensor([n for n, _ in hits])
        width = int(lengths.max())
        ids, rest = left_pad([r.prompt[n:] for r, (n, _) in zip(rows, hits)], host.pad_token_id)
        past = (torch.arange(width) >= (width - lengths)[:, None]).long()
        cache = GrowingCache(host.autocast_dtype)
        for layer_index in range(len(hits[0][1].layers)):
            keys = torch.stack([_pad_left(p.layers[layer_index][0], width, 1) for _, p in hits])
            values = torch.stack([_pad_left(p.layers[layer_index][1], width, 1) for _, p in hits])
            layer = GrowingLayer()
            layer.lazy_initialization(keys, values)
            layer.set(keys, values, room=ids.shape[1] + room)
            cache.layers.append(layer)
        mask = torch.cat([past, rest], 1).to(host.device)
        positions = (lengths[:, None] + rest.cumsum(1) - 1).clamp(min=0).to(host.device)
        out = host._forward(input_ids=ids.to(host.device), attention_mask=mask, position_ids=positions,
                            use_cache=True, **host.prefill_args, **{host.cache_arg: cache})
        return getattr(out, host.cache_arg), mask, out.logits[:, -1]

    def _keep_prefixes(self, finished: list[Row]) -> None:
        """Keep each finished row's KV (its prompt and sampled tokens but the last, which no forward pass
        read) when one weight version wrote all of it."""
        index = {id(row): i for i, row in enumerate(self.rows)}
        kept = [row for row in finished if len(set(row.versions)) == 1]
        if not kept:
            return
        rows = torch.tensor([index[id(row)] for row in kept], device=self.mask.device)
        # One gather per layer for all of them; a row whose valid columns are one run (no gap: it did not
        # continue a kept prefix itself) keeps a view of its slice, any other row its own copy.
        mask = self.mask.index_select(0, rows).bool()
        gathered = [(layer.keys.index_select(0, rows), layer.values.index_select(0, rows)) for layer in self.cache.layers]
        counts, width = mask.sum(1), mask.shape[1]
        one_run = (mask.flip(1).long().cumprod(1).sum(1) == counts).tolist()  # its valid columns are the last ones
        counts = counts.tolist()
        for j, row in enumerate(kept):
            if one_run[j]:
                layers = [(k[j, :, width - counts[j]:], v[j, :, width - counts[j]:]) for k, v in gathered]
            else:
                layers = [(k[j][:, mask[j]], v[j][:, mask[j]]) for k, v in gathered]
            self.prefixes.store(row.prompt + row.tokens[:-1], row.versions[0], layers)

    def _prefill(self, sequences: list[list[int]], room: int) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """One forward pass over the distinct sequences (left-padded); the cache, mask and last logits
        expanded back to one row per sequence."""
        host = self.host
        index: dict[tuple[int, ...], int] = {}
        which = [index.setdefault(tuple(seq), len(index)) for seq in sequences]
        distinct = [list(seq) for seq in index]
        ids, mask = left_pad(distinct, host.pad_token_id)
        ids, mask = ids.to(host.device), mask.to(host.device)
        out = host._forward(input_ids=ids, attention_mask=mask, position_ids=position_ids_for(mask), use_cache=True,
                            **host.prefill_args, **{host.cache_arg: GrowingCache(host.autocast_dtype)})
        cache, logits = getattr(out, host.cache_arg), out.logits[:, -1]
        rows = torch.tensor(which, device=host.device)
        _rebuild(cache, lambda kv: kv.index_select(0, rows), room)  # one row per sequence, room to decode
        return cache, mask.index_select(0, rows), logits.index_select(0, rows)

    def _merge(self, cache: Any, mask: torch.Tensor, positions: torch.Tensor, logits: torch.Tensor,
               room: int) -> None:
        """Append newly prefilled rows to the running batch, left-padding the narrower to one width."""
        width = max(self.mask.shape[1], mask.shape[1])
        for mine, theirs in zip(self.cache.layers, cache.layers):
            mine.set(torch.cat([_pad_left(mine.keys, width, 2), _pad_left(theirs.keys, width, 2)]),
                     torch.cat([_pad_left(mine.values, width, 2), _pad_left(theirs.values, width, 2)]), room=room)
        self.mask = torch.cat([_pad_left(self.mask, width, 1), _pad_left(mask, width, 1)])
        self.positions = torch.cat([self.positions, positions])
        self.logits = torch.cat([self.logits, logits])

    def _select(self, keep: list[int]) -> None:
        """Keep these running rows; cut the leading columns that are padding for all of them."""
        self.rows = [self.rows[i] for i in keep]
        self.logits_versions = [self.logits_versions[i] for i in keep]
        if not keep:
            self.cache = self.mask = self.positions = self.logits = None
            return
        rows = torch.tensor(keep, device=self.mask.device)
        mask = self.mask.index_select(0, rows)
        lead = int((mask.cumsum(1) == 0).sum(1).min())
        _rebuild(self.cache, lambda kv: kv.index_select(0, rows)[:, :, lead:], _room(self.rows))
        self.mask, self.positions = mask[:, lead:], self.positions.index_select(0, rows)
        self.logits = self.logits.index_select(0, rows)

    def _sample(self) -> list[Row]:
        """One token per running row, drawn with its own counter-based uniform; the rows now done."""
        groups: dict[SamplingParams, list[int]] = {}
        for i, row in enumerate(self.rows):
            groups.setdefault(row.sampling, []).append(i)
        tokens = torch.empty(len(self.rows), dtype=torch.long)
        logprobs = torch.empty(len(self.rows), dtype=torch.float32)
        for sampling, index in groups.items():
            logits = self.logits if len(index) == len(self.rows) else self.logits[index]
            rows = [self.rows[i] for i in index]
            token, logprob = sample_rows(logits, sampling, torch.tensor([r.seed for r in rows]),
                                         torch.tensor([len(r.tokens) for r in rows]))
            tokens[index] = token.cpu()
            logprobs[index] = logprob.cpu()
        finished = []
        for row, token, logprob, version in zip(self.rows, tokens.tolist(), logprobs.tolist(), self.logits_versions):
            row.tokens.append(token)
            row.logprobs.append(logprob)
            row.versions.append(version)
            row.stopped = token in row.stop_ids
            if row.done:
                finished.append(row)
        return finished

    def _decode(self) -> None:
        """The forward pass of every running row's newest token (or, after a weight update with
        recompute, a re-prefill of prompt + tokens so far under the new weights)."""
        host = self.host
        with host._gate.forward(stale=lambda: host.weight_version != self.version):
            version = host.weight_version
            if version != self.version and host._gate.recompute_kv_cache:
                self.cache, self.mask, self.logits = self._prefill([r.prompt + r.tokens for r in self.rows],
                                                                   _room(self.rows))
                self.positions = self.mask.sum(1, keepdim=True)
            else:
                token = torch.tensor([[r.tokens[-1]] for r in self.rows], device=host.device)
                self.mask = torch.cat([self.mask, self.mask.new_ones((len(self.rows), 1))], 1)
                out = host._forward(input_ids=token, attention_mask=self.mask, position_ids=self.positions,
                                    use_cache=True, **{host.cache_arg: self.cache})
                self.cache, self.logits = getattr(out, host.cache_arg), out.logits[:, -1]
                self.positions = self.positions + 1
                self.decode_rows += len(self.rows)
            self.version = version
        self.logits_versions = [version] * len(self.rows)


def request_output(request: Request, pad_token_id: int) -> GenerationOutput:
    """A completed request's rows as one ``GenerationOutput`` (right-padded)."""
    rows = request.rows
    width = max((len(r.tokens) for r in rows), default=0)
    versions = {v for r in rows for v in r.versions}
    oldest = min(versions, default=request.version)

    def right(field: str, pad: float, dtype: torch.dtype) -> torch.Tensor:  # one tensor from padded lists
        return torch.tensor([getattr(r, field) + [pad] * (width - len(r.tokens)) for r in rows], dtype=dtype)

    return GenerationOutput(
        response_ids=right("tokens", pad_token_id, torch.long).view(len(rows), width),
        response_lengths=torch.tensor([len(r.tokens) for r in rows], dtype=torch.long),
        logprobs=right("logprobs", 0.0, torch.float32).view(len(rows), width),
        truncated=torch.tensor([not r.stopped for r in rows]), weight_version=oldest,
        token_weight_versions=right("versions", oldest, torch.long).view(len(rows), width) if len(versions) > 1
        else None,
    )
