"""The prompt sources a run draws from: a dataset (``DatasetPrompts``), a weighted mixture of
datasets (``MixturePrompts``) or an environment that makes its own (``EnvironmentPrompts``), and
``make_prompt_source`` / ``make_validation_prompts``, which build them from the config.

Every source has ``next_prompts(count)``, ``epoch`` (completed passes) and a JSON-serialisable
``state_dict()``; ``load_state_dict`` on a freshly built source over the same data makes it
continue with exactly the prompts the saved one would have produced (exact resume). Nothing
random is stored: a dataset's order in epoch ``e`` is a permutation seeded by
``(grpo.seed, e)``, so a position and an epoch number are its whole state.

A module of its own beside ``grpo_sdk.data.prompts`` (reading, checking, templating and
tokenizing rows into ``Prompt``s): this is the order prompts are drawn in and its checkpointed
position, which the loop and the async collector use.
"""

from __future__ import annotations

import hashlib
import json
import random
from fractions import Fraction
from typing import TYPE_CHECKING, Any, Sequence

from grpo_sdk.core.errors import ConfigError, DataError
from grpo_sdk.core.protocols import PromptSampler
from grpo_sdk.data.prompts import TOO_LONG_HINT, Prompt, PromptBuilder, load_prompts, make_builder
from grpo_sdk.data.hub import data_source

if TYPE_CHECKING:
    from grpo_sdk.config.schema import MasterConfig

# --- prompt sources -------------------------------------------------------------------------------


def _fingerprint(prompts: Sequence[Prompt]) -> str:
    digest = hashlib.sha256()
    for p in prompts:
        digest.update(f"{p.source}\0{p.text}\0".encode())
        if p.messages is not None:  # unrendered (no tokenizer) conversations have no text yet
            digest.update(json.dumps(p.messages).encode())
    return digest.hexdigest()[:16]


class DatasetPrompts:
    """Prompts of a finite dataset, in a fresh permutation every epoch; ``epoch`` counts completed passes."""

    def __init__(self, prompts: list[Prompt], *, shuffle: bool, seed: int, salt: str = "train"):
        self.prompts = prompts
        self.shuffle = shuffle
        self.seed = seed
        self.salt = salt  # tells apart the datasets of a mixture, so they are not shuffled alike
        self.fingerprint = _fingerprint(prompts)
        self.epoch = 0
        self.position = 0
        self.order = self._order()

    def _order(self) -> list[int]:
        order = list(range(len(self.prompts)))
        if self.shuffle:  # a string seed hashes with SHA-512: the same on every platform and Python
            random.Random(f"{self.seed}:{self.salt}:{self.epoch}").shuffle(order)
        return order

    def next_prompts(self, count: int) -> list[Prompt]:
        out = []
        while len(out) < count:
            out.append(self.prompts[self.order[self.position]])
            self.position += 1
            if self.position == len(self.order):  # counted as soon as the pass completes
                self.epoch += 1
                self.position = 0
                self.order = self._order()
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "dataset", "epoch": self.epoch, "position": self.position, "size": len(self.prompts),
                "fingerprint": self.fingerprint, "seed": self.seed, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_state(state, "dataset", {"size": len(self.prompts), "fingerprint": self.fingerprint,
                                        "seed": self.seed, "shuffle": self.shuffle})
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self.order = self._order()


class MixturePrompts:
    """Several datasets, each step's prompts split between them by weight.

    Slot by slot, the next prompt comes from the dataset furthest behind its share
    (``weight_i / sum(weights)`` of all prompts drawn so far; ties go to the earlier dataset), in
    exact fractions (smooth weighted round-robin). Every dataset gets exactly its share whenever
    all shares of the prompts drawn so far are whole (with weights 3:1 and 4 prompts a step: 3
    and 1 every step), and stays within about a prompt of it in between; nothing random is
    involved, so ``drawn`` is the whole state. Each dataset cycles through its own shuffled
    order. ``epoch`` is the least number of passes any dataset has completed: with
    ``grpo.max_num_epochs: 1`` the run ends once every dataset has been seen in full (a small
    dataset with a large weight repeats meanwhile, as its weight asks).
    """

    def __init__(self, parts: list[DatasetPrompts], weights: Sequence[float]):
        self.parts = parts
        self.weights = [Fraction(w) for w in weights]
        self.total_weight = sum(self.weights)
        self.drawn = [0] * len(parts)

    @property
    def epoch(self) -> int:
        return min(p.epoch for p in self.parts)

    def next_prompts(self, count: int) -> list[Prompt]:
        out = []
        for _ in range(count):
            total = sum(self.drawn) + 1
            deficits = [total * w - self.total_weight * d for w, d in zip(self.weights, self.drawn)]
            pick = deficits.index(max(deficits))
            self.drawn[pick] += 1
            out.extend(self.parts[pick].next_prompts(1))
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "mixture", "drawn": list(self.drawn), "weights": [str(w) for w in self.weights],
                "parts": [p.state_dict() for p in self.parts]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_state(state, "mixture", {"weights": [str(w) for w in self.weights]})
        if len(state["parts"]) != len(self.parts):
            raise DataError(f"dataloader state: saved for {len(state['parts'])} datasets, this run mixes "
                            f"{len(self.parts)} (data.datasets)")
        for part, part_state in zip(self.parts, state["parts"]):
            part.load_state_dict(part_state)
        self.drawn = [int(d) for d in state["drawn"]]


class EnvironmentPrompts:
    """An endless stream of prompts from an environment's ``sample_prompts(n, rng)``; ``epoch`` stays 0."""

    def __init__(self, environment: PromptSampler, env_name: str, *, seed: int | str,
                 builder: PromptBuilder | None = None, max_prompt_tokens: int | None = None):
        self.environment = environment
        self.env_name = env_name
        self.rng = random.Random(seed)
        self.builder = builder or PromptBuilder()
        self.max_prompt_tokens = max_prompt_tokens
        self.epoch = 0
        self.count = 0

    def next_prompts(self, count: int) -> list[Prompt]:
        drawn = list(self.environment.sample_prompts(count, self.rng))
        start, self.count = self.count, self.count + len(drawn)
        sources = [f"{self.env_name} prompt {start + i}" for i in range(len(drawn))]
        texts = [self.builder.fill_template(text, meta, src) for (text, meta), src in zip(drawn, sources)]
        texts, ids = self.builder.encode(texts)
        out = []
        for i, ((_, meta), text, source) in enumerate(zip(drawn, texts, sources)):
            if ids is not None and self.max_prompt_tokens is not None and len(ids[i]) > self.max_prompt_tokens:
                raise DataError(f"{source}: prompt is {len(ids[i])} tokens, longer than the "
                                f"{self.max_prompt_tokens} allowed {TOO_LONG_HINT}")
            out.append(Prompt(text=text, metadata=meta, source=source,
                              token_ids=tuple(ids[i]) if ids is not None else None))
        return out

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss_next = self.rng.getstate()
        return {"kind": "environment", "count": self.count,
                "rng_state": {"version": version, "internal": list(internal), "gauss_next": gauss_next}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_state(state, "environment", {})
        rng = state["rng_state"]
        self.rng.setstate((rng["version"], tuple(rng["internal"]), rng["gauss_next"]))
        self.count = int(state["count"])


def _check_state(state: dict[str, Any], kind: str, expected: dict[str, Any]) -> None:
    """Exact resume needs the same data, seed and order: refuse a state that cannot give it."""
    if state.get("kind") != kind:
        raise DataError(f"dataloader state: saved from a {state.get('kind')!r} prompt source, but this run reads "
                        f"a {kind!r} one (data.train_path / data.use_multiple_dataloader changed?)")
    changed = [f"{k}: saved {state.get(k)!r}, now {v!r}" for k, v in expected.items() if state.get(k) != v]
    if changed:
        raise DataError("dataloader state does not match this run's data, so the resumed run would not see the "
                        "prompts the saved one would have (" + "; ".join(changed) + ")")


# --- what the loop calls --------------------------------------------------------------------------


def make_prompt_source(cfg: MasterConfig, environment: Any, tokenizer: Any = None,
                       max_prompt_tokens: int | None = None) -> DatasetPrompts | MixturePrompts | EnvironmentPrompts:
    """The training prompts of a run. Without a tokenizer prompts carry no token ids and are not
    length-checked here (the rollout does both)."""
    data, seed = cfg.data, cfg.grpo.seed
    builder = make_builder(data, tokenizer, environment)
    options = {"builder": builder, "max_prompt_tokens": max_prompt_tokens, "filter_long": data.filter_long_prompts,
               "num_workers": data.num_workers}
    if data.use_multiple_dataloader:
        parts = []
        for i, ds in enumerate(data.datasets):
            prompts = load_prompts(data_source(data, "datasets", i), prompt_key=ds.prompt_key or data.prompt_key,
                                   **options,
                                   key=f"data.datasets[{i}].path", label=f" (data.datasets[{i}])")
            parts.append(DatasetPrompts(prompts, shuffle=data.shuffle, seed=seed, salt=f"train{i}"))
        _check_step_fits(cfg, sum(len(p.prompts) for p in parts), "data.datasets",
                         ", ".join(ds.path for ds in data.datasets))
        return MixturePrompts(parts, [ds.weight for ds in data.datasets])
    if data.train_path:
        prompts = load_prompts(data_source(data, "train"), prompt_key=data.prompt_key, **options)
        _check_step_fits(cfg, len(prompts), "data.train_path", data.train_path)
        return DatasetPrompts(prompts, shuffle=data.shuffle, seed=seed)
    if isinstance(environment, PromptSampler):
        return EnvironmentPrompts(environment, cfg.env.name, seed=seed, builder=builder,
                                  max_prompt_tokens=max_prompt_tokens)
    raise ConfigError([("data.train_path", f"required: environment {cfg.env.name!r} does not generate prompts")])


def _check_step_fits(cfg: MasterConfig, size: int, key: str, where: str) -> None:
    """A step draws each prompt at most once: a dataset smaller than a step would repeat prompts inside
    it, as separate groups, and end epoch 1 in the first step (the config alone cannot know the size)."""
    per_step = cfg.grpo.num_prompts_per_step
    if size < per_step:
        filtered = " after data.filter_long_prompts" if cfg.data.filter_long_prompts else ""
        raise DataError(f"{key}: {where} holds {size} prompts{filtered}, fewer than the grpo.num_prompts_per_step="
                        f"{per_step} every step draws; lower grpo.num_prompts_per_step or add data")


def make_validation_prompts(cfg: MasterConfig, environment: Any, tokenizer: Any = None,
                            max_prompt_tokens: int | None = None) -> list[Prompt] | None:
    """At most ``grpo.max_val_samples`` validation prompts, the same in every run and resume.

    From ``data.validation_path`` (its first rows, in file order), else from the environment with
    an rng seeded by ``grpo.seed`` and a constant (never the training stream's), else None.
    """
    data, limit = cfg.data, cfg.grpo.max_val_samples
    builder = make_builder(data, tokenizer, environment)
    if data.validation_path:
        prompts = load_prompts(data_source(data, "validation", max_rows=limit), prompt_key=data.prompt_key,
                               builder=builder,
                               max_prompt_tokens=max_prompt_tokens, filter_long=data.filter_long_prompts,
                               num_workers=data.num_workers, key="data.validation_path")
        return prompts[:limit]
    if isinstance(environment, PromptSampler):
        stream = EnvironmentPrompts(environment, f"{cfg.env.name} validation", seed=f"{cfg.grpo.seed}:validation",
                                    builder=builder, max_prompt_tokens=max_prompt_tokens)
        return stream.next_prompts(limit)
    return None
