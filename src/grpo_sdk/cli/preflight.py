"""What `grpoctl run` would fail on at setup, found before anything heavy is built.

``config validate`` structures and cross-checks a config (``grpo_sdk.config.checks``); a run can still
fail at start-up, after minutes of loading, on what only the files say: a data file that is not
there, a model path that names nothing, a hub id the machine cannot reach, a prompt longer than
``policy.max_total_sequence_length`` allows, a task whose generated prompts do not fit.
``preflight(cfg)`` looks for each the way setup meets it: the model sources as the loaders check
them, and the prompts read, templated and tokenized by the same code as the run
(``data.prompt_sources.make_prompt_source`` / ``make_validation_prompts``), with the environment built
when it generates prompts. No model is built.

Torch is imported only to tokenize with a local tokenizer directory (transformers' AutoTokenizer
imports it); the built-in model's character tokenizer runs on ``tokenizers`` alone, and a hub
tokenizer is not loaded, so its prompts are read and checked for everything but their length.
A 1000-row JSONL file is read and tokenized in about 0.05 s (docs/data.md gives the numbers).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from grpo_sdk.core.builtin_models import packaged_file
from grpo_sdk.core.errors import ConfigError, DataError, GrpoSdkError, ModelLoadError
from grpo_sdk.core.gguf_cache import cached_model_dir, is_gguf
from grpo_sdk.core.hub import in_cache, is_hub_id, offline_hint, probe
from grpo_sdk.core.models import check_model_source
from grpo_sdk.core.protocols import SupportsShutdown

if TYPE_CHECKING:
    from grpo_sdk.config.schema import MasterConfig


def preflight(cfg: MasterConfig, registry: Any = None, notes: list[str] | None = None,
              prompt_lengths: list[int] | None = None) -> list[tuple[str, str]]:
    """``(key, message)`` for each thing the run would fail on at setup; ``notes`` (when given)
    receives one line per prompt source checked (how many prompts, the longest, the time taken),
    ``prompt_lengths`` the longest prompt's tokens of each source that was tokenized."""
    problems = model_problems(cfg)
    if any(key in ("policy.model_name", "policy.tokenizer.name") for key, _ in problems):
        tokenizer = None  # the run stops at the tokenizer; the prompts are still read and checked
    else:
        tokenizer, problem = local_tokenizer(cfg)
        problems += problem
    return problems + prompt_problems(cfg, registry, tokenizer, notes if notes is not None else [], prompt_lengths)


# --- models ---------------------------------------------------------------------------------------


def model_sources(cfg: MasterConfig) -> list[tuple[str, str]]:
    sources = [("policy.model_name", cfg.policy.model_name), ("policy.tokenizer.name", cfg.policy.tokenizer.name),
               ("on_policy_distillation.teacher_model", cfg.on_policy_distillation.teacher_model)]
    return [(key, name) for key, name in sources if name]


def model_problems(cfg: MasterConfig) -> list[tuple[str, str]]:
    """A local path that is not a model directory, a name that is neither a path nor ``builtin:`` nor
    a hub id, and a hub id that the cache lacks while the hub cannot be reached."""
    problems = []
    for key, name in model_sources(cfg):
        packaged = packaged_file(name, key)  # a packaged built-in that is not installed: PluginError, exit 3
        if packaged is not None:
            check_model_source(str(packaged), key=key)  # gguf and accelerate, unless converted before
            continue
        if name.startswith("builtin:"):
            continue  # config.checks.model.check_model names an unknown built-in
        if Path(name).expanduser().exists() or not is_hub_id(name):
            try:
                check_model_source(name, key=key)  # a GGUF file: its first bytes; a missing gguf: exit 3
            except ModelLoadError as exc:
                problems.append((key, str(exc).removeprefix(f"{key}: ")))
                continue
            if not Path(name).expanduser().exists():
                problems.append((key, f"{name!r} is neither a local directory, nor builtin:NAME, nor a hub id "
                                 "(ORG/NAME)"))
            continue
        unreachable = probe()
        if unreachable is not None and not in_cache(name):
            problems.append((key, f"{name!r} is a hub id, but the local cache does not hold it and the hub cannot "
                             f"be reached ({unreachable}); "
                             f"{offline_hint('a local model directory (saved with save_pretrained)')}"))
    return problems


def local_tokenizer(cfg: MasterConfig) -> tuple[Any, list[tuple[str, str]]]:
    """The run's tokenizer when it is built in or a local directory, else None (a hub tokenizer is not
    downloaded to validate a config)."""
    key = "policy.tokenizer.name" if cfg.policy.tokenizer.name else "policy.model_name"
    name = cfg.policy.tokenizer.name or cfg.policy.model_name
    try:
        converted = _converted_dir(name, key)
        if converted is not None:  # a GGUF file converted before: its tokenizer (an unconverted one is not converted here)
            from grpo_sdk.core.models import load_tokenizer

            return load_tokenizer(converted, key=key), []
        if name.startswith("builtin:"):
            from grpo_sdk.recipes.tiny_model import char_tokenizer_backend

            builtin = {"tiny-gpt2": char_tokenizer_backend}.get(name.split(":", 1)[1])
            return (BackendTokenizer(builtin()) if builtin else None), []
        if Path(name).expanduser().is_dir():
            from grpo_sdk.core.models import load_tokenizer

            return load_tokenizer(name, key=key), []
    except GrpoSdkError as exc:
        return None, [(key, str(exc).removeprefix(f"{key}: "))]
    return None, []


def _converted_dir(name: str, key: str) -> str | None:
    packaged = packaged_file(name, key)
    path = str(packaged) if packaged is not None else name
    directory = cached_model_dir(path) if is_gguf(path) else None
    return str(directory) if directory is not None else None


class BackendTokenizer:
    """A ``tokenizers.Tokenizer`` as ``data.prompts.PromptBuilder`` calls a transformers tokenizer (the
    built-in tokenizer has no chat template), so validating needs neither transformers nor torch."""

    chat_template = None
    is_fast = True  # its batch encoding runs in Rust: PromptBuilder keeps it in one process

    def __init__(self, backend: Any):
        self.backend = backend
        self.eos_token_id = backend.token_to_id("<eos>")
        self.pad_token_id = backend.token_to_id("<pad>")

    def __call__(self, texts: list[str], add_special_tokens: bool = True) -> dict[str, list[list[int]]]:
        return {"input_ids": [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=add_special_tokens)]}


# --- prompts --------------------------------------------------------------------------------------


def prompt_problems(cfg: MasterConfig, registry: Any, tokenizer: Any, notes: list[str],
                    prompt_lengths: list[int] | None = None) -> list[tuple[str, str]]:
    """Build the run's training and validation prompts as setup does, and report what fails."""
    from grpo_sdk.data.prompts import TOO_LONG_HINT
    from grpo_sdk.data.prompt_sources import make_prompt_source, make_validation_prompts

    if tokenizer is None and cfg.data.use_chat_template:  # the template is the tokenizer's: read the rows without it
        cfg = attrs.evolve(cfg, data=attrs.evolve(cfg.data, use_chat_template=False))
    data, gen = cfg.data, cfg.policy.generation
    max_prompt_tokens = data.max_input_seq_length or (cfg.policy.max_total_sequence_length - gen.max_new_tokens)
    environment, problems = _environment(cfg, registry, tokenizer)
    train_key = "data.datasets" if data.use_multiple_dataloader else "data.train_path"

    def attempt(key: str, what: str, build: Any) -> None:
        start = time.perf_counter()
        try:
            prompts = build()
        except ConfigError as exc:
            problems.extend(exc.problems)
            return
        except DataError as exc:
            text = str(exc)
            if TOO_LONG_HINT in text:  # the fix is a length setting, whichever row showed it
                key = "data.max_input_seq_length" if data.max_input_seq_length else "policy.max_total_sequence_length"
            problems.append((key, text))
            return
        except Exception as exc:  # noqa: BLE001 - an unforeseen failure is reported, not a traceback
            problems.append((key, f"building the {what} failed: {type(exc).__name__}: {exc}"))
            return
        if prompts:
            lengths = [len(p.token_ids) for p in prompts if p.token_ids is not None]
            longest = f", the longest {max(lengths)} tokens ({max_prompt_tokens} allowed)" if lengths else ""
            if lengths and prompt_lengths is not None:
                prompt_lengths.append(max(lengths))
            notes.append(f"{what}: {len(prompts)} prompts checked{longest} in {time.perf_counter() - start:.2f} s")

    def train() -> list[Any]:
        source = make_prompt_source(cfg, environment, tokenizer, max_prompt_tokens)
        if hasattr(source, "prompts"):
            return source.prompts
        if hasattr(source, "parts"):
            return [p for part in source.parts for p in part.prompts]
        return source.next_prompts(cfg.grpo.num_prompts_per_step)  # a generator: one step's prompts

    try:
        attempt(train_key, "training prompts", train)
        attempt("data.validation_path" if data.validation_path else f"env.{cfg.env.name}", "validation prompts",
                lambda: make_validation_prompts(cfg, environment, tokenizer, max_prompt_tokens) or [])
    finally:
        if isinstance(environment, SupportsShutdown):
            environment.shutdown()
    return problems


def _environment(cfg: MasterConfig, registry: Any, tokenizer: Any) -> tuple[Any, list[tuple[str, str]]]:
    """The environment when the run draws prompts from it (setup builds it the same way), else None."""
    from grpo_sdk.core.capabilities import Capability

    data = cfg.data
    needs_prompts = not (data.train_path or data.use_multiple_dataloader) or not data.validation_path
    info = registry.info("environment", cfg.env.name) if registry is not None else None
    if not needs_prompts or info is None or info.spec is None \
            or Capability.GENERATES_PROMPTS not in info.spec.capabilities:
        return None, []
    from grpo_sdk.config.schema import plugin_config
    from grpo_sdk.config.context import RunContext

    name = cfg.policy.model_name
    context = RunContext(config=cfg, run_dir=Path(cfg.logger.log_dir) / "preflight", model_path=name,
                         tokenizer_path=cfg.policy.tokenizer.name or name, device="cpu", seed=cfg.grpo.seed,
                         needs_reference=False, registry=registry,
                         eos_token_id=getattr(tokenizer, "eos_token_id", None),
                         pad_token_id=getattr(tokenizer, "pad_token_id", None))
    try:
        return registry.load_impl("environment", cfg.env.name)(plugin_config(cfg.env), context), []
    except Exception as exc:  # noqa: BLE001 - the run would fail here too: say so, with the cause
        return None, [(f"env.{cfg.env.name}", f"environment {cfg.env.name!r} could not be built: "
                       f"{type(exc).__name__}: {exc}")]
