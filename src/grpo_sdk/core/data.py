"""Where prompts come from: a JSONL file, or an environment that makes its own (synthetic tasks).

Every prompt carries a ``source`` label (``"data.jsonl line 7"``, ``"reverse_digits prompt 12"``)
so an error about it can name it.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import attrs

from grpo_sdk.core.errors import ConfigError, DataError


@attrs.frozen(kw_only=True)
class Prompt:
    text: str
    metadata: dict[str, Any]
    source: str  # where it came from, for error messages


def read_jsonl_prompts(path: str | Path, prompt_key: str = "prompt") -> list[Prompt]:
    """Read and check every row up front, so a bad row fails at start-up, not at step 900."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise DataError(f"data.train_path: no file at {path}")
    prompts = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path} line {line_no}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
            if not isinstance(row, dict):
                raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
            if prompt_key not in row:
                raise DataError(f"{where}: no {prompt_key!r} key (data.prompt_key); keys: {sorted(row)}")
            text = row.pop(prompt_key)
            if not isinstance(text, str) or not text:
                raise DataError(f"{where}: {prompt_key!r} must be a non-empty string, got {text!r}")
            prompts.append(Prompt(text=text, metadata=row, source=where))
    if not prompts:
        raise DataError(f"data.train_path: {path} holds no rows")
    return prompts


class DatasetPrompts:
    """Prompts of a finite dataset, reshuffled every epoch; ``epoch`` counts completed passes."""

    def __init__(self, prompts: list[Prompt], *, shuffle: bool, seed: int):
        self.prompts = prompts
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self.order = self._order()

    def _order(self) -> list[int]:
        order = list(range(len(self.prompts)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        return order

    def next_prompts(self, count: int) -> list[Prompt]:
        out = []
        while len(out) < count:
            if self.position == len(self.order):
                self.epoch += 1
                self.position = 0
                self.order = self._order()
            out.append(self.prompts[self.order[self.position]])
            self.position += 1
        return out


class EnvironmentPrompts:
    """An endless stream of prompts from an environment's ``sample_prompts``."""

    def __init__(self, environment: Any, env_name: str, *, seed: int):
        self.environment = environment
        self.env_name = env_name
        self.rng = random.Random(seed)
        self.epoch = 0
        self.count = 0

    def next_prompts(self, count: int) -> list[Prompt]:
        out = []
        for text, metadata in self.environment.sample_prompts(count, self.rng):
            out.append(Prompt(text=text, metadata=metadata, source=f"{self.env_name} prompt {self.count}"))
            self.count += 1
        return out


def make_prompt_source(cfg: Any, environment: Any) -> DatasetPrompts | EnvironmentPrompts:
    if cfg.data.train_path:
        return DatasetPrompts(read_jsonl_prompts(cfg.data.train_path, cfg.data.prompt_key),
                              shuffle=cfg.data.shuffle, seed=cfg.grpo.seed)
    if hasattr(environment, "sample_prompts"):
        return EnvironmentPrompts(environment, cfg.env.name, seed=cfg.grpo.seed)
    raise ConfigError([("data.train_path", f"required: environment {cfg.env.name!r} does not generate prompts")])
