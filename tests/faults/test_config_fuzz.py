"""Fault corpus: malformed configs and data files through the real CLI, never a traceback.

Every case runs `grpoctl config validate` (configs) or `grpoctl run` on the built-in recipe with
one step and no checkpoints (data), in-process through ``grpo_sdk.cli.app.main`` for speed, and
asserts the documented exit code (2: config or usage error, 3: plugin error, 1: a run failure such
as bad data), no ``Traceback`` on stderr, and a message naming the file, key or line. A handful
run the installed ``grpoctl`` script as a subprocess, to prove the real entry point says the same.

The corpus: every case of issue 12 (items 10-12) by name, plus generated ones: wrong types for
every field of the schema (selected plugin blocks included), huge/negative/NaN/inf/unicode values,
random YAML garbage, binary files, deep nesting, duplicate keys, and bad JSONL data. By default a
fixed sample runs (well under a minute on 2 cores); ``GRPO_SDK_FAULTS=full`` runs all of it.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import types
import typing
from pathlib import Path
from typing import Any, Callable

import attrs
import pytest
import yaml

from grpo_sdk.cli.app import main
from grpo_sdk.cli.common import STATE
from grpo_sdk.config.loading import BUILTIN_RECIPE, load_config
from grpo_sdk.plugins.registry import Registry

pytestmark = pytest.mark.faults

FULL = os.environ.get("GRPO_SDK_FAULTS") == "full"
SAMPLE = 300  # generated cases in the default run; the curated ones always run
RECIPE = str(BUILTIN_RECIPE)
RUN_ARGS = ["grpo.max_num_steps=1", "checkpointing.enabled=false", "grpo.val_period=0", "grpo.val_at_end=false",
            "--no-progress"]
GOOD_ROW = {"prompt": "12345>", "target": "54321"}


@attrs.frozen
class Case:
    """``make(dir) -> argv`` builds the files of one case in ``dir``; the run must end with a code in
    ``codes`` and, unless it succeeds, name every one of ``names`` (``every``) or at least one of them
    (generated cases, whose message may name the key or the file). ``{dir}`` stands for the case's dir."""

    id: str
    make: Callable[[Path], list[str]]
    codes: frozenset[int]
    names: tuple[str, ...] = ()
    every: bool = True


def case(id: str, make: Callable[[Path], list[str]], codes: Any = 2, *names: str, every: bool = True) -> Case:
    return Case(id, make, frozenset([codes] if isinstance(codes, int) else codes), names, every)


def validate_file(text: str | bytes, *overrides: str, name: str = "cfg.yaml", layered: bool = True,
                  base: str | None = None):
    """`config validate [-c recipe] -c FILE overrides`; ``layered``: the built-in recipe below it;
    ``base``: the text of a base.yaml next to FILE."""
    def make(d: Path) -> list[str]:
        path = d / name
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
        if base is not None:
            (d / "base.yaml").write_text(base)
        return ["config", "validate", *(["-c", RECIPE] if layered else []), "-c", str(path), *overrides]
    return make


def validate(*overrides: str) -> Callable[[Path], list[str]]:
    return lambda d: ["config", "validate", *overrides]


def run_data(rows: str | bytes | Callable[[Path], Path], *overrides: str, key: str = "data.train_path",
             name: str = "data.jsonl") -> Callable[[Path], list[str]]:
    """`grpoctl run` of the built-in recipe for one step with ``key`` pointing at the data."""
    def make(d: Path) -> list[str]:
        if callable(rows):
            path = rows(d)
        else:
            path = d / name
            path.write_bytes(rows if isinstance(rows, bytes) else rows.encode())
        return ["run", "--run-dir", str(d / "run"), f"{key}={path}", *RUN_ARGS, *overrides]
    return make


def fifo(d: Path, name: str = "data.jsonl") -> Path:
    os.mkfifo(d / name)
    return d / name


def _file(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def symlink_loop(d: Path) -> Path:
    (d / "loop.yaml").symlink_to(d / "loop.yaml")
    return d / "loop.yaml"


def jsonl(*rows: Any) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def nested(path: str, value: Any) -> dict[str, Any]:
    out: Any = value
    for part in reversed(path.split(".")):
        out = {part: out}
    return out


def yaml_text(data: Any) -> str:
    return yaml.safe_dump(data, allow_unicode=True, sort_keys=False)


# --- curated: every case the issue names, and their neighbours ----------------------------------


def local_model(max_positions: int = 32, vocab: int = 50, **extra: Any) -> Callable[[Path], Path]:
    def make(d: Path) -> Path:
        (d / "model").mkdir()
        (d / "model" / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": vocab,
                                                             "max_position_embeddings": max_positions, **extra}))
        return d / "model"
    return make


def with_model(model: Callable[[Path], Path], *overrides: str) -> Callable[[Path], list[str]]:
    return lambda d: ["config", "validate", f"policy.model_name={model(d)}", *overrides]


DEEP = 100_000
CURATED: list[Case] = [
    # item 10: absurd sizes, refused before memory is spent
    case("rows-1e20", validate("grpo.num_prompts_per_step=100000000000000000000"), 2, "grpo.num_prompts_per_step"),
    case("rows-2e40", validate("grpo.num_prompts_per_step=2", f"grpo.num_generations_per_prompt={2**40}"), 2,
         "grpo.num_generations_per_prompt"),
    case("rows-product", validate("grpo.num_prompts_per_step=65536", "grpo.num_generations_per_prompt=65536"), 2,
         "grpo.num_prompts_per_step"),
    case("val-samples-1e9", validate("grpo.max_val_samples=1000000000"), 2, "grpo.max_val_samples"),
    case("val-rows", validate("grpo.max_val_samples=100000", "grpo.val_num_generations_per_prompt=100000"), 2,
         "grpo.val_num_generations_per_prompt"),
    case("stop-id-negative", validate("policy.generation.stop_token_ids=[-1]"), 2, "policy.generation.stop_token_ids"),
    case("stop-id-vocab-builtin", validate("policy.generation.stop_token_ids=[25]"), 2, "stop_token_ids", "25"),
    case("stop-id-vocab-local", with_model(local_model(), "policy.generation.stop_token_ids=[50]",
                                           "policy.generation.max_new_tokens=8", "policy.max_total_sequence_length=32"),
         2, "stop_token_ids", "vocab_size"),
    case("context-builtin", validate("policy.max_total_sequence_length=65"), 2, "policy.max_total_sequence_length"),
    case("context-local", with_model(local_model(), "policy.max_total_sequence_length=64"), 2,
         "policy.max_total_sequence_length", "max_position_embeddings"),
    case("max-new-tokens-huge", validate(f"policy.generation.max_new_tokens={2**62}",
                                         f"policy.max_total_sequence_length={2**62 + 1}"), 2,
         "policy.max_total_sequence_length"),
    case("int-too-large", validate("grpo.seed=100000000000000000000000000"), 2, "grpo.seed"),
    case("int-too-small", validate(f"grpo.seed={-2**64}"), 2, "grpo.seed"),
    case("int-huge-for-float", validate(f"policy.optimizer.lr={10**400}"), 2, "policy.optimizer.lr"),
    case("num-threads-huge", validate(f"cluster.num_threads={2**40}"), 2, "cluster.num_threads"),
    case("num-threads-zero", validate("cluster.num_threads=0"), 2, "cluster.num_threads"),
    case("data-workers-huge", validate("data.num_workers=1000000"), 2, "data.num_workers"),
    case("timeout-huge", validate("cluster.call_timeout_s=1e300"), 2, "cluster.call_timeout_s"),
    case("betas-high", validate("policy.optimizer.betas=[1.5, 0.99]"), 2, "policy.optimizer.betas"),
    case("betas-negative", validate("policy.optimizer.betas=[0.9, -0.1]"), 2, "policy.optimizer.betas"),
    case("betas-one", validate("policy.optimizer.betas=[0.9, 1.0]"), 2, "policy.optimizer.betas"),
    case("betas-short", validate("policy.optimizer.betas=[0.9]"), 2, "policy.optimizer.betas"),
    case("betas-nan", validate("policy.optimizer.betas=[.nan, 0.9]"), 2, "policy.optimizer.betas"),
    case("grad-norm-negative", validate("policy.max_grad_norm=-1"), 2, "policy.max_grad_norm"),
    case("float32-overflow", validate("grpo.advantage_clip_high=1e308"), 2, "grpo.advantage_clip_high", "32-bit"),
    case("path-name-too-long", validate("policy.model_name=" + "a" * 300), 2, "policy.model_name", "255"),
    case("template-brace", validate('data.prompt_template="{prompt"'), 2, "data.prompt_template", "{{"),
    case("template-positional", validate('data.prompt_template="{} {prompt}"'), 2, "data.prompt_template"),
    case("template-huge-pad", validate('data.prompt_template="{prompt:>99999999999}"'), 2, "data.prompt_template"),
    # item 11: configs that silently do nothing
    case("dup-top-key", validate_file("grpo:\n  seed: 1\ngrpo:\n  max_num_steps: 2\n"), 2, "cfg.yaml", "line 3",
         "grpo"),
    case("dup-nested-key", validate_file("grpo:\n  seed: 1\n  seed: 2\n"), 2, "cfg.yaml", "line 3", "seed"),
    case("dup-flow-key", validate_file("grpo: {seed: 1, seed: 2}\n"), 2, "cfg.yaml", "seed"),
    case("dup-in-base", validate_file("defaults: base.yaml\n", base="grpo: {seed: 1}\ngrpo: {seed: 2}\n"), 2,
         "base.yaml", "line 2"),
    case("dup-in-override", validate("grpo.adv_estimator={name: grpo, name: rloo}"), 2, "grpo.adv_estimator"),
    case("one-generation-group-baseline", validate("grpo.num_generations_per_prompt=1"), 2,
         "grpo.num_generations_per_prompt"),
    case("metric-typo", validate("checkpointing.metric_name=val:acuracy"), 2, "checkpointing.metric_name",
         "val:accuracy"),
    case("metric-train-typo", validate("checkpointing.metric_name=train:reward_mean"), 2,
         "checkpointing.metric_name", "train:reward/mean"),
    case("metric-no-prefix", validate("checkpointing.metric_name=accuracy"), 2, "checkpointing.metric_name"),
    case("stop-metric-typo", validate("grpo.stop_at_validation_metric=acuracy",
                                      "grpo.stop_at_validation_threshold=0.5"), 2, "grpo.stop_at_validation_metric",
         "'accuracy'"),
    case("stop-metric-prefixed", validate("grpo.stop_at_validation_metric=val:accuracy",
                                          "grpo.stop_at_validation_threshold=0.5"), 2,
         "grpo.stop_at_validation_metric", "'accuracy'"),
    case("stop-metric-env", validate("grpo.stop_at_validation_metric=exact_match",
                                     "grpo.stop_at_validation_threshold=0.5"), 0),
    case("empty-prompt-key", validate("data.prompt_key="), 2, "data.prompt_key"),
    case("empty-prompt-key-quoted", validate('data.prompt_key=""'), 2, "data.prompt_key"),
    case("empty-dataset-prompt-key", validate('data.datasets=[{path: a.jsonl, prompt_key: ""}]',
                                              "data.use_multiple_dataloader=true", "~data.train_path"), 2,
         "data.datasets[0].prompt_key"),
    # item 12: no tracebacks
    case("config-not-utf8", validate_file(b"grpo:\n  seed: 1\n  max_num_steps: \xff\xfe\n"), 2, "cfg.yaml", "line 3",
         "UTF-8"),
    case("config-latin1", validate_file("grpo:\n  # caf\u00e9\n  seed: 1\n".encode("latin-1")), 2, "cfg.yaml",
         "line 2"),
    case("config-utf16", validate_file("grpo: {seed: 1}\n".encode("utf-16")), 2, "cfg.yaml"),
    case("config-utf8-bom", validate_file("\ufeffgrpo: {seed: 1}\n"), 0),
    case("defaults-int", validate_file("defaults: 5\n"), 2, "cfg.yaml", "defaults"),
    case("defaults-null-item", validate_file("defaults: [null]\n"), 2, "cfg.yaml", "defaults"),
    case("defaults-mapping", validate_file("defaults: {a: b}\n"), 2, "cfg.yaml", "defaults"),
    case("defaults-empty-string", validate_file("defaults: ['']\n"), 2, "cfg.yaml", "defaults"),
    case("defaults-missing", validate_file("defaults: nowhere.yaml\n"), 2, "nowhere.yaml", "cfg.yaml"),
    case("defaults-self", validate_file("defaults: cfg.yaml\n"), 2, "cfg.yaml"),
    case("defaults-directory", validate_file("defaults: .\n"), 2, "cfg.yaml", "directory"),
    case("config-directory", lambda d: ["config", "validate", "-c", str(d)], 2, "{dir}", "directory"),
    case("config-fifo", lambda d: ["config", "validate", "-c", str(fifo(d, "cfg.yaml"))], 2, "cfg.yaml"),
    case("config-missing", lambda d: ["config", "validate", "-c", str(d / "nope.yaml")], 2, "nope.yaml"),
    case("config-dev-null", lambda d: ["config", "validate", "-c", os.devnull], 2, os.devnull),
    case("config-symlink-loop", lambda d: ["config", "validate", "-c", str(symlink_loop(d))], 2, "loop.yaml"),
    case("config-scalar", validate_file("5\n"), 2, "cfg.yaml"),
    case("config-list", validate_file("- a\n- b\n"), 2, "cfg.yaml"),
    case("config-bad-yaml", validate_file("grpo: {seed: 1\n"), 2, "cfg.yaml", "line"),
    case("config-tab-indent", validate_file("grpo:\n\tseed: 1\n"), 2, "cfg.yaml", "line 2"),
    case("config-python-tag", validate_file("grpo: !!python/object/apply:os.system [ls]\n"), 2, "cfg.yaml"),
    case("config-deep-list", validate_file("a: " + "[" * DEEP + "]" * DEEP + "\n"), 2, "cfg.yaml", "deep"),
    case("config-deep-map", validate_file("a: " + "{a: " * DEEP + "1" + "}" * DEEP + "\n"), 2, "cfg.yaml", "deep"),
    case("config-deep-block", validate_file("".join("  " * i + "a:\n" for i in range(3000)) + "  " * 3000 + "1\n"),
         2, "cfg.yaml"),
    case("config-billion-laughs", validate_file("env:\n  math:\n    a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"    {c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n"
        for p, c in zip("abcdefg", "bcdefgh"))), 2, "cfg.yaml", "aliases"),
    case("config-alias-cycle", validate_file("env:\n  math: &a {x: [*a]}\n"), 2, "cfg.yaml", "cycle"),
    case("config-nested-65", validate_file("env:\n  math: " + "[" * 70 + "]" * 70 + "\n"), 2, "cfg.yaml",
         "more than 64 levels"),
    case("config-empty", validate_file(""), 0),
    case("config-empty-alone", validate_file("", layered=False), 2, "policy.model_name"),
    case("override-deep", validate("grpo.seed=" + "[" * DEEP + "]" * DEEP), 2, "grpo.seed"),
    case("override-no-value", validate("grpo.seed"), 2, "grpo.seed"),
    case("override-empty-part", validate("grpo..seed=1"), 2, "grpo..seed"),
    case("override-bad-yaml", validate("grpo.seed=[1"), 2, "grpo.seed"),
    case("override-into-scalar", validate("grpo.seed.x=1"), 2, "grpo.seed"),
    case("override-nan", validate("policy.optimizer.lr=.nan"), 2, "policy.optimizer.lr"),
    case("override-inf", validate("grpo.batch_multiplier=.inf"), 2, "grpo.batch_multiplier"),
    case("override-1e999", validate("policy.optimizer.lr=1e999"), 2, "policy.optimizer.lr"),
    case("override-null-byte", validate("logger.log_dir=\"a\\0b\""), 2, "logger.log_dir"),
    case("unicode-key", validate_file("gr\u00f8po: {seed: 1}\n"), 2, "gr\u00f8po"),
    # validate's preflight knows run would fail on it: neither a directory, builtin:, nor ORG/NAME
    case("unicode-model-name", validate("policy.model_name=\U0001f4a5"), 2, "policy.model_name"),
    # data at run time: exit 1 naming the file and line
    case("data-not-utf8", run_data(jsonl(GOOD_ROW).encode() * 2 + b'{"prompt": "\xff\xfe"}\n'), 1, "data.jsonl line 3",
         "UTF-8"),
    case("data-binary", run_data(bytes(range(256)) * 4), 1, "data.jsonl line 1"),
    case("data-fifo", run_data(fifo), 1, "data.jsonl", "FIFO"),
    case("data-fifo-validation", run_data(fifo, key="data.validation_path"), 1, "data.jsonl", "FIFO"),
    case("data-directory", run_data(lambda d: d), 1, "{dir}"),
    case("data-missing", run_data(lambda d: d / "nope.jsonl"), 1, "nope.jsonl"),
    case("data-bad-json", run_data(jsonl(GOOD_ROW) + '{"prompt": \n'), 1, "data.jsonl line 2"),
    case("data-deep-json", run_data(jsonl(GOOD_ROW) + "[" * DEEP + "]" * DEEP + "\n"), 1, "data.jsonl line 2"),
    case("data-row-list", run_data(jsonl(GOOD_ROW, [1, 2])), 1, "data.jsonl line 2"),
    case("data-row-string", run_data(jsonl("12345>")), 1, "data.jsonl line 1"),
    case("data-no-prompt-key", run_data(jsonl(GOOD_ROW, {"question": "1>"})), 1, "data.jsonl line 2"),
    case("data-empty-prompt", run_data(jsonl(GOOD_ROW, {"prompt": ""})), 1, "data.jsonl line 2"),
    case("data-prompt-not-string", run_data(jsonl({"prompt": 5})), 1, "data.jsonl line 1"),
    case("data-empty", run_data(""), 1, "data.jsonl"),
    case("data-blank-lines", run_data("\n\n  \n"), 1, "data.jsonl"),
    case("data-too-long", run_data(jsonl({"prompt": "1" * 100 + ">", "target": "1"}) * 8), 1, "data.jsonl line 1"),
    case("data-fewer-rows-than-step", run_data(jsonl(GOOD_ROW) * 3), 1, "data.jsonl", "grpo.num_prompts_per_step"),
    case("data-unknown-suffix", run_data(jsonl(GOOD_ROW), name="data.txt"), 1, "data.txt"),
    case("data-bad-parquet", run_data(b"PAR1 not really", name="data.parquet"), 1, "data.parquet"),
    case("data-utf16", run_data(jsonl(GOOD_ROW).encode("utf-16")), 1, "data.jsonl line 1"),
    case("data-nan-metadata", run_data(jsonl(GOOD_ROW).replace("}", ', "x": NaN}') * 8), {0, 1}, "data.jsonl"),
    case("data-template-type", run_data(jsonl({**GOOD_ROW, "n": "x"}) * 8, 'data.prompt_template="{n:d}{prompt}"'), 1,
         "data.jsonl line 1", "data.prompt_template"),
    case("data-valid", run_data(jsonl(GOOD_ROW) * 8), 0),
    case("show-nested-60", lambda d: ["config", "show", "--format", "json", "-c", RECIPE, "-c", str(
        _file(d / "cfg.yaml", "env:\n  math:\n    a: " + "[" * 60 + "]" * 60 + "\n"))], 0),
]


# --- generated: the schema, garbage, binary --------------------------------------------------------


def schema_leaves() -> list[tuple[str, Any]]:
    """(dotted path, declared type) of every user key of the built-in recipe's config, the
    selected plugin blocks included (unselected blocks are not validated, by design)."""
    cfg = load_config(None, [], Registry.discover())
    out: list[tuple[str, Any]] = []

    def walk(obj: Any, prefix: str) -> None:
        attrs.resolve_types(type(obj))
        for field in attrs.fields(type(obj)):
            if field.metadata.get("internal"):
                continue
            out.append((prefix + field.name, field.type))
            value = getattr(obj, field.name)
            if attrs.has(type(value)):
                walk(value, f"{prefix}{field.name}.")
        if getattr(type(obj), "__plugin__", None) is not None:
            for name, block in obj.structured_blocks.items():
                if block is not None:
                    out.append((prefix + name, type(block)))
                    walk(block, f"{prefix}{name}.")

    walk(cfg, "")
    return out


def wrong_values(type_: Any) -> list[Any]:
    """Values of the wrong type for ``type_``: each must be a config error."""
    origin, args = typing.get_origin(type_), typing.get_args(type_)
    optional = origin in (typing.Union, types.UnionType) and type(None) in args
    if optional:
        rest = [a for a in args if a is not type(None)]
        type_ = rest[0] if len(rest) == 1 else Any
        origin, args = typing.get_origin(type_), typing.get_args(type_)
    if type_ is Any:
        return []
    extra = [] if optional else [None]
    if attrs.has(type_):
        return [5, "text", [1, 2], True]
    if type_ is bool:
        return ["true", "yes", 1, [True], *extra]
    if type_ is int:
        return ["12", 3.5, True, [1], {"a": 1}, *extra]
    if type_ is float:
        return ["abc", True, [1.0], {"a": 1}, float("nan"), float("inf"), -float("inf"), "1e999", *extra]
    if type_ is str:
        return [5, 2.5, True, ["a"], {"a": "b"}, *extra]
    if origin is typing.Literal:
        return ["no-such-choice", 5, [args[0]], *extra]
    if origin is list:
        item = args[0] if args else Any
        items = [[v] for v in wrong_values(item)[:2] if v is not None] if item is not Any else []
        return ["abc", {"a": 1}, 5, *items, *extra]
    if origin is tuple:
        return ["abc", [0.5], [0.5, 0.5, 0.5], ["a", "b"], 0.5, *extra]
    if origin is dict:
        return ["abc", [1], 5]
    return []


def edge_values(type_: Any) -> list[Any]:
    """Right-typed but extreme values: accepted or a config error naming the key, never a crash."""
    args = [a for a in typing.get_args(type_) if a is not type(None)] or [type_]
    base = args[0]
    if base is int:
        return [0, -1, 2**31, 2**63, -2**63 - 1, 10**20, 10**400]
    if base is float:
        return [0.0, -1.0, 1e-320, 1e308, -1e308, 10**400]
    if base is str:
        return ["", "\x00", "\U0001f4a5" * 4, "a" * 5000, "\u202e", "../../../../etc/passwd"]
    if typing.get_origin(base) is list:
        return [[], [None], [[[]]], [10**400]]
    return []


def field_cases() -> list[Case]:
    cases = []
    for path, type_ in schema_leaves():
        leaf = path.rsplit(".", 1)[-1]
        # A selector that names no plugin is a plugin error (3); anything else about a key is 2.
        for i, value in enumerate(wrong_values(type_)):
            cases.append(case(f"type-{path}-{i}", validate_file(yaml_text(nested(path, value))), {2, 3}, leaf))
        for i, value in enumerate(edge_values(type_)):
            cases.append(case(f"edge-{path}-{i}", validate_file(yaml_text(nested(path, value))), {0, 2, 3}, leaf,
                              "cfg.yaml", every=False))
    return cases


YAML_TOKENS = [":", ": ", "- ", "{", "}", "[", "]", ",", "&a ", "*a", "!!python/name:os.system ", "!!binary ",
               "? ", "|", ">", "'", '"', "#", "%YAML 1.1\n", "---\n", "...\n", "\t", "\n", "  ", "grpo", "seed",
               "policy", "model_name", "1", "null", "~", "yes", "0x1F", "1e5", ".nan", "<<: *a", "\\", "\u00e9",
               "\U0001f4a5", "\x00", "\x1b", "\ufeff", "\r"]


def garbage_cases(count: int) -> list[Case]:
    cases = []
    for i in range(count):
        rng = random.Random(f"garbage:{i}")
        text = "".join(rng.choice(YAML_TOKENS) for _ in range(rng.randint(1, 60)))
        cases.append(case(f"garbage-{i}", validate_file(text), {0, 2}, "cfg.yaml", "config problem", every=False))
    for i in range(count // 3):
        blob = random.Random(f"binary:{i}").randbytes(1 + i * 37)
        cases.append(case(f"binary-{i}", validate_file(blob), 2, "cfg.yaml"))
    for i in range(count // 3):
        rng = random.Random(f"data:{i}")
        blob = rng.randbytes(1 + i * 11) if i % 2 else "".join(rng.choice(YAML_TOKENS) for _ in range(30)).encode()
        cases.append(case(f"data-garbage-{i}", run_data(jsonl(GOOD_ROW) * 8 + blob.decode("latin-1")
                                                         if i % 4 == 1 else blob), 1, "data.jsonl"))
    return cases


def all_cases() -> list[Case]:
    generated = field_cases() + garbage_cases(90)
    if not FULL:
        generated = random.Random(12).sample(generated, min(SAMPLE, len(generated)))
    return CURATED + generated


# --- running them ---------------------------------------------------------------------------------


@pytest.fixture
def grpoctl(capfd):
    """`grpoctl ARGV` in-process: (exit code, stderr); the shared CLI state is restored after. File
    descriptors are captured, not just sys.stderr: a run may hand stderr's fd to faulthandler."""
    saved = (STATE.host, STATE.registry)

    def run(argv: list[str]) -> tuple[int, str]:
        code = main(argv)
        return code, capfd.readouterr().err

    yield run
    STATE.host, STATE.registry = saved


def check(c: Case, code: int, err: str, d: Path) -> None:
    assert "Traceback" not in err, f"TRACEBACK in case {c.id}:\n{err[-3000:]}"
    assert code in c.codes, f"exit code {code}, expected {sorted(c.codes)} in case {c.id}:\n{err[-2000:]}"
    if code != 0:
        assert err.startswith("error: ") or "\nerror: " in err, err
        names = [n.replace("{dir}", str(d)) for n in c.names]
        missing = [n for n in names if n not in err]
        assert not (missing if c.every else names and len(missing) == len(names)), \
            f"case {c.id}: {missing} not in:\n{err}"


@pytest.mark.parametrize("c", all_cases(), ids=lambda c: c.id)
def test_fault_is_a_clean_error(c: Case, grpoctl, tmp_path):
    argv = c.make(tmp_path)
    code, err = grpoctl(argv)
    check(c, code, err, tmp_path)


ENTRY_POINT = ["config-not-utf8", "dup-top-key", "config-directory", "defaults-int", "rows-1e20", "data-fifo",
               "data-not-utf8"]


@pytest.mark.parametrize("name", ENTRY_POINT)
def test_the_installed_script_says_the_same(name, tmp_path):
    c = next(c for c in CURATED if c.id == name)
    script = shutil.which("grpoctl", path=str(Path(sys.executable).parent)) or shutil.which("grpoctl")
    command = [script] if script else [sys.executable, "-m", "grpo_sdk.cli.app"]
    proc = subprocess.run([*command, *c.make(tmp_path)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    check(c, proc.returncode, proc.stderr, tmp_path)


def test_the_corpus_is_counted():
    """The figures the issue asks for: how many cases, and how many run by default."""
    total = len(CURATED) + len(field_cases()) + len(garbage_cases(90))
    assert total > 1000 and len(all_cases()) == (total if FULL else len(CURATED) + SAMPLE)
