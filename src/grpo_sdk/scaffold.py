"""`grpoctl plugins new`: a plugin project for any component kind, ready to install and test.

The project is what docs/plugins.md describes, filled in: ``pyproject.toml`` with the entry
point, a light ``spec.py`` (the ``ComponentSpec`` and a documented config class), an
implementation that satisfies the kind's protocol and trains as is, and ``tests/`` running
grpo-sdk's contract kit (``grpo_sdk.testing``)::

    files = render(plugin_names("acme"), "estimator")   # {"pyproject.toml": "...", ...}
    write_project(Path("grpo-acme"), files)

Templates are ``string.Template`` text (``$package``, ``$Impl``, ...): the files they render
are Python, TOML and Markdown full of braces, and ``$`` appears in none of them. The shared
files are below, then one ``KindTemplate`` per kind: its config options, its implementation
and how a run config selects it.
"""

from __future__ import annotations

import re
from pathlib import Path
from string import Template

import attrs

from grpo_sdk.plugins.registry import KIND_LABELS
from grpo_sdk.plugins.specs import KINDS, PLUGIN_API_VERSION

_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_\-]*$")  # the ComponentSpec name rule


@attrs.frozen
class PluginNames:
    """The names one plugin goes by, all derived from what the user typed."""

    name: str  # the component: what users write in config, e.g. "acme-gen"
    dist: str  # the distribution: "grpo-acme-gen"
    package: str  # the import package: "grpo_acme_gen"
    classes: str  # the class-name prefix: "AcmeGen"


def plugin_names(text: str) -> PluginNames:
    """``"Acme Gen"`` or ``"grpo-acme-gen"`` -> component ``acme-gen``, ``grpo-acme-gen``, ``grpo_acme_gen``.

    Lower case; anything outside ``[a-z0-9_-]`` becomes ``-``; a leading ``grpo-`` is dropped
    (the distribution gets it back). Raises ValueError when nothing usable is left.
    """
    name = re.sub(r"[^a-z0-9_-]+", "-", text.strip().lower())
    name = re.sub(r"^grpo[-_]+", "", name).strip("-_")
    if not name or not _NAME_RE.match(name):
        raise ValueError(f"{text!r} is not a usable plugin name: use letters, digits, - and _, e.g. 'acme'")
    classes = "".join(part.capitalize() for part in re.split(r"[-_]+", name))
    if classes[0].isdigit():
        classes = "Grpo" + classes
    return PluginNames(name=name, dist="grpo-" + name.replace("_", "-"), package="grpo_" + name.replace("-", "_"),
                       classes=classes)


def sdk_requirement() -> str:
    """``grpo-sdk>=X.Y,<X+1`` for the installed grpo-sdk: the plugin API is stable within a major."""
    from packaging.version import Version

    from grpo_sdk import __version__

    version = Version(__version__)
    return f"grpo-sdk>={version.major}.{version.minor},<{version.major + 1}"


# --- shared files -------------------------------------------------------------------------------

PYPROJECT = """\
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "$dist"
version = "0.1.0"
description = "$summary (a grpo-sdk $label)."
readme = "README.md"
requires-python = ">=3.11"
dependencies = [$dependencies]

# grpo-sdk discovers the $label through this entry point; its name is what a run config selects.
[project.entry-points."$group"]
$name = "$package.spec:SPEC"

[tool.setuptools.packages.find]
where = ["src"]

[tool.pytest.ini_options]
testpaths = ["tests"]
# What tests/test_contract.py checks: "kind:name", then optional config overrides for its training run.
grpo_components = ["$kind:$name"]
"""

README = """\
# $dist

$summary: $a_label for grpo-sdk, selected as `$name`.

## Install

```bash
pip install -e .
grpoctl plugins list --kind $kind  # $name  ok  $dist 0.1.0
grpoctl plugins show $name  # its options
```

## Use

In a run config:

```yaml
$usage
```

or on the command line: `grpoctl run $cli`.

## Develop

- `src/$package/spec.py`: the entry point, `SPEC`, and the options, `$Config`.
  Keep it light: every `grpoctl` command imports it, so it must not import torch.
- `src/$package/$module.py`: the implementation, `$Impl`.
  It is imported only when a run selects the $label.
- `tests/test_contract.py`: grpo-sdk's contract tests (`grpo_sdk.testing`).
  They check that the spec loads without torch, that the options structure from their defaults,
  that `$Impl` has every method of the `$protocol` protocol, and that a two-step CPU training
  run of the built-in recipe succeeds with it.

```bash
pip install -e . pytest
pytest
```
"""

INIT = '''\
"""$summary: $a_label for grpo-sdk (see spec.py)."""
'''

SPEC = '''\
"""The entry point of $dist: light, so `grpoctl plugins list` never imports torch for it."""

import attrs

from grpo_sdk.plugins import ComponentSpec, option


@attrs.frozen(kw_only=True)
class $Config:
    """Options of the $name $label: the `$block` block of a run config."""

$options


SPEC = ComponentSpec(
    name="$name",
    kind="$kind",
    impl="$package.$module:$Impl",
    config="$package.spec:$Config",
    api=$api,  # the plugin API this is written against: another grpo-sdk lists it as incompatible-api
$capabilities    summary="$summary.",
)
'''

CONFTEST = '''\
# grpo-sdk's contract kit: the `grpo_component` fixture that tests/test_contract.py runs on.
pytest_plugins = ["grpo_sdk.testing"]
'''

TEST_CONTRACT = '''\
"""grpo-sdk's contract tests, once for each component in `grpo_components` (pyproject.toml).

The spec loads without torch, the options structure from their defaults, the implementation has
every method of its protocol, and a two-step CPU training run succeeds with it selected.
"""

from grpo_sdk.testing import ContractTests


class TestContract(ContractTests):
    pass
'''

GITIGNORE = """\
__pycache__/
*.egg-info/
build/
dist/
.pytest_cache/
"""


# --- one template per kind ----------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class KindTemplate:
    module: str  # the implementation module, src/<package>/<module>.py
    suffix: str  # the implementation class is <Classes><suffix>
    protocol: str  # the protocol it satisfies (grpo_sdk.plugins)
    summary: str
    options: str  # the config class body
    impl: str  # the implementation module
    usage: str  # a run config selecting it (YAML)
    dependencies: tuple[str, ...] = ()
    capabilities: str = ""  # a ComponentSpec line, e.g. 'capabilities={"generates_prompts"},'


GENERATION = KindTemplate(
    module="generation",
    suffix="Generation",
    protocol="Generation",
    summary="Sampling with transformers' model.generate",
    dependencies=("torch>=2.4", "transformers>=4.50"),
    options='''\
    use_cache: bool = option(True, "Reuse attention keys and values between decoding steps (model.generate's "
                             "use_cache); false recomputes them: slower, less memory.")''',
    usage="""\
policy:
  generation:
    backend: $name
    $name:
      use_cache: true""",
    impl='''\
"""The $name generation backend: samples responses with transformers' `model.generate`.

A working starting point: put your inference engine behind `generate` and `update_weights`.
What the training loop needs from `generate`, for left-padded prompts: right-padded response
ids, how many tokens each row generated (its stop token included), the logprob of each sampled
token under the distribution it was sampled from (temperature, top-k and top-p applied), and
which rows reached max_new_tokens without a stop token.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo_sdk.plugins import GenerationInput, GenerationOutput, RunContext, SamplingParams

from $package.spec import $Config


class $Impl:
    def __init__(self, config: $Config | None, context: RunContext):
        self.config = config or $Config()
        self.device = context.device
        self.model = AutoModelForCausalLM.from_pretrained(context.model_path).to(self.device).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(context.tokenizer_path)
        self.weight_version = 0
        torch.manual_seed(context.seed)

    @torch.inference_mode()
    def generate(self, prompts: GenerationInput, sampling: SamplingParams) -> GenerationOutput:
        pad = self.tokenizer.pad_token_id
        stop_ids = [self.tokenizer.eos_token_id, *sampling.stop_token_ids]
        out = self.model.generate(
            input_ids=prompts.input_ids.to(self.device), attention_mask=prompts.attention_mask.to(self.device),
            do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k or 0,
            max_new_tokens=sampling.max_new_tokens, eos_token_id=stop_ids, pad_token_id=pad,
            use_cache=self.config.use_cache, output_scores=True, return_dict_in_generate=True)
        tokens = out.sequences[:, prompts.input_ids.shape[1]:]
        # `scores` are the logits each token was sampled from: temperature, top-k and top-p applied.
        scores = torch.stack(out.scores, dim=1).float()
        logprobs = torch.log_softmax(scores, dim=-1).gather(-1, tokens[..., None]).squeeze(-1)
        # A row ends at its first stop token, which it keeps; everything after it is padding.
        is_stop = torch.isin(tokens, torch.tensor(stop_ids, device=tokens.device))
        after_stop = (is_stop.cumsum(1) - is_stop.long()) > 0
        return GenerationOutput(
            response_ids=tokens.masked_fill(after_stop, pad).cpu(),
            response_lengths=(~after_stop).sum(1).cpu(),
            logprobs=logprobs.masked_fill(after_stop, 0.0).cpu(),
            truncated=(~is_stop.any(1)).cpu(),
            weight_version=self.weight_version,
        )

    @torch.no_grad()
    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, version: int) -> None:
        """Copy in the policy's new weights (named as in its `named_weights`)."""
        own = self.model.state_dict()
        for name, tensor in weights:
            own[name].copy_(tensor)
        self.weight_version = version  # reported with every sample from now on

    def prepare_for_generation(self) -> None:
        """Called before each round of generation: wake the engine, onload weights and caches."""

    def finish_generation(self) -> None:
        """Called after it: free what a colocated policy needs for training (KV cache, weights)."""

    def shutdown(self) -> None:
        self.model = None
''',
)

POLICY = KindTemplate(
    module="policy",
    suffix="Policy",
    protocol="Policy",
    summary="The trained model, its optimizer and its checkpoints",
    dependencies=("torch>=2.4",),
    options='''\
    gradient_checkpointing: bool = option(False, "Recompute activations in the backward pass: less memory, "
                                          "about a third more compute.")''',
    usage="""\
policy:
  backend: $name
  $name:
    gradient_checkpointing: false""",
    impl='''\
"""The $name policy backend: the trained model, its optimizer and its checkpoints.

A starting point that trains from the first `pip install`: every method delegates to grpo-sdk's
built-in `hf` policy (transformers model, AdamW over micro-batches, gradient clipping,
safetensors checkpoints). Replace the methods one at a time with calls into your training
engine; `pytest` (grpo-sdk's contract tests) checks after each change that the backend still
fits the Policy protocol and still trains.

`grpo_sdk.backends.hf` is not part of grpo-sdk's public plugin API (`grpo_sdk.plugins`) and may
change in any release: pin grpo-sdk to the minor version you test with for as long as this
delegates to it.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from grpo_sdk.backends.hf.config import HFPolicyConfig
from grpo_sdk.backends.hf.policy import HFPolicy
from grpo_sdk.plugins import LossFunction, RunContext, TrainBatch

from $package.spec import $Config


class $Impl:
    def __init__(self, config: $Config | None, context: RunContext):
        self.config = config or $Config()
        # Settings every policy backend shares (optimizer, precision, batch sizes) are in context.config.policy.
        self.engine = HFPolicy(HFPolicyConfig(gradient_checkpointing=self.config.gradient_checkpointing), context)

    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """Input-aligned [B, S] logprobs of batch.input_ids under the current weights; column 0 is 0."""
        return self.engine.logprobs(batch)

    def reference_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """The same under the initial weights (runs with a KL penalty need them)."""
        return self.engine.reference_logprobs(batch)

    def train(self, batch: TrainBatch, loss_fn: LossFunction) -> dict[str, float]:
        """Optimizer steps on the batch; returns metrics (loss, grad_norm, lr, ...)."""
        return self.engine.train(batch, loss_fn)

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The (name, tensor) pairs weight sync sends to the generation backend."""
        return self.engine.named_weights()

    def save_checkpoint(self, path: str) -> None:
        """A Hugging Face model directory at path, with the optimizer state next to the weights."""
        self.engine.save_checkpoint(path)

    def load_checkpoint(self, path: str) -> None:
        self.engine.load_checkpoint(path)

    def offload(self) -> None:
        """Move training state off the accelerator while a colocated backend generates."""
        self.engine.offload()

    def onload(self) -> None:
        self.engine.onload()

    def shutdown(self) -> None:
        self.engine.shutdown()
''',
)

ESTIMATOR = KindTemplate(
    module="estimator",
    suffix="Estimator",
    protocol="AdvantageEstimator",
    summary="Advantages against the mean reward of each prompt's group",
    dependencies=("torch>=2.4",),
    options='''\
    normalize_by_std: bool = option(False, "Also divide by the group's reward standard deviation where it is "
                                    "above 0 (GRPO); false keeps the plain difference (Dr. GRPO).")''',
    usage="""\
grpo:
  adv_estimator:
    name: $name
    $name:
      normalize_by_std: false""",
    impl='''\
"""The $name advantage estimator: each reward minus the mean reward of its group.

`rewards` is [B], `group_ids` [B] (the rows sampled from one prompt share an id) and `mask`
[B, S] (1 on the generated tokens of rows in the loss). `extras` carries what other estimators
need (reward_components, valid_mask, prev_logprobs, reference_logprobs, teacher_logprobs,
metadata): take what you need, ignore the rest.
"""

from __future__ import annotations

from typing import Any

import torch

from grpo_sdk.plugins import RunContext

from $package.spec import $Config


class $Impl:
    def __init__(self, config: $Config | None, context: RunContext | None):
        self.config = config or $Config()

    def compute_advantages(self, rewards: torch.Tensor, group_ids: torch.Tensor, mask: torch.Tensor,
                           **extras: Any) -> torch.Tensor:
        advantages = torch.zeros_like(rewards)
        for group in group_ids.unique():
            rows = group_ids == group
            centred = rewards[rows] - rewards[rows].mean()
            if self.config.normalize_by_std and int(rows.sum()) > 1:
                std = rewards[rows].std()
                if std > 0:
                    centred = centred / std
            advantages[rows] = centred
        # One advantage per row, on each of its generated tokens: [B, S].
        return advantages[:, None] * mask
''',
)

ENVIRONMENT = KindTemplate(
    module="environment",
    suffix="Environment",
    protocol="Environment",
    summary="Adding two numbers, with prompts like '3+4='",
    capabilities='    capabilities={"generates_prompts"},  # it makes its own prompts: no dataset needed\n',
    options='''\
    max_operand: int = option(9, "Largest number in a sum: 9 gives one-digit sums like '3+4='.",
                              validator=attrs.validators.ge(0))''',
    usage="""\
env:
  name: $name
  $name:
    max_operand: 9""",
    impl='''\
"""The $name environment: add two numbers. The prompt is "3+4=", the answer "7".

It makes its own prompts (`sample_prompts`, declared by the generates_prompts capability in
spec.py), so a run needs no dataset. To score a dataset instead, drop both and set
data.train_path: each row's keys besides the prompt reach `step` as its metadata. The prompts
use only characters the built-in recipe's tiny tokenizer knows (digits, + and =), so
`grpoctl run env.name=$name` trains on it as is.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from grpo_sdk.plugins import EnvironmentReturn, MessageLog, RunContext

from $package.spec import $Config


def score(answer: str, target: str) -> float:
    """The fraction of positions where the answer has the target's character: 1 only when exact."""
    matches = sum(a == b for a, b in zip(answer, target))
    return matches / max(len(answer), len(target))


class $Impl:
    def __init__(self, config: $Config | None, context: RunContext | None):
        self.config = config or $Config()

    def sample_prompts(self, num_prompts: int, rng: random.Random) -> list[tuple[str, dict[str, Any]]]:
        """(prompt, metadata) pairs; `step` gets each response with its prompt's metadata."""
        prompts = []
        for _ in range(num_prompts):
            a, b = rng.randint(0, self.config.max_operand), rng.randint(0, self.config.max_operand)
            prompts.append((f"{a}+{b}=", {"target": str(a + b)}))
        return prompts

    def step(self, message_logs: Sequence[MessageLog], metadata: Sequence[dict[str, Any]]) -> EnvironmentReturn:
        """Score the last message of each conversation (the response) against its target."""
        rewards = [score(log[-1].content, meta["target"]) for log, meta in zip(message_logs, metadata)]
        exact = sum(reward == 1.0 for reward in rewards) / max(1, len(rewards))
        return EnvironmentReturn(rewards={"correct": rewards}, metrics={"exact_match": exact})
''',
)

WEIGHT_SYNC = KindTemplate(
    module="weight_sync",
    suffix="WeightSync",
    protocol="WeightSync",
    summary="Streams the policy's weights into the generation backend",
    options='''\
    check_finite: bool = option(False, "Check every tensor for NaN and infinity before sending it, and stop the "
                                "run at the first bad one instead of sampling from broken weights.")''',
    usage="""\
weight_sync:
  backend: $name
  $name:
    check_finite: false""",
    impl='''\
"""The $name weight-sync transport: moves the policy's weights into the generation backend.

In one process (cluster.runtime: local) both are plain objects, so this streams
`policy.named_weights()` into `generation.update_weights`. A transport between processes or
machines sends the tensors here (shared memory, sockets, a collective) and loads them on the
other side.
"""

from __future__ import annotations

import time

from grpo_sdk.plugins import Generation, NonFiniteError, Policy, RunContext, SyncStats

from $package.spec import $Config


class $Impl:
    def __init__(self, config: $Config | None, context: RunContext):
        self.config = config or $Config()

    def sync_weights(self, policy: Policy, generation: Generation, *, version: int) -> SyncStats:
        start = time.perf_counter()
        sent = {"tensors": 0, "bytes": 0}

        def stream():
            for name, tensor in policy.named_weights():
                if self.config.check_finite and not tensor.isfinite().all():
                    raise NonFiniteError(f"weight {name} of version {version} is not finite")
                sent["tensors"] += 1
                sent["bytes"] += tensor.numel() * tensor.element_size()
                yield name, tensor

        # From now on the backend reports `version` as the weight_version of its samples.
        generation.update_weights(stream(), version=version)
        return SyncStats(version=version, num_tensors=sent["tensors"], num_bytes=sent["bytes"],
                         seconds=time.perf_counter() - start)
''',
)

LOGGER = KindTemplate(
    module="logger",
    suffix="Logger",
    protocol="Logger",
    summary="Every step's metrics as a line of text in the run directory",
    options='''\
    filename: str = option("metrics.txt", "File in the run directory that each step's metrics are appended to.")
    digits: int = option(6, "Significant digits of each value.", validator=attrs.validators.gt(0))''',
    usage="""\
logger:
  loggers: [jsonl, $name]
  $name:
    filename: metrics.txt""",
    impl='''\
"""The $name logger: every step's metrics as one line of text in the run directory."""

from __future__ import annotations

from grpo_sdk.plugins import RunContext

from $package.spec import $Config


class $Impl:
    def __init__(self, config: $Config | None, context: RunContext):
        self.config = config or $Config()
        self.file = open(context.run_dir / self.config.filename, "a", encoding="utf-8")

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        values = " ".join(f"{key}={value:.{self.config.digits}g}" for key, value in sorted(metrics.items()))
        self.file.write(f"step {step}: {values}\\n")
        self.file.flush()  # a crash loses nothing already logged

    def close(self) -> None:
        self.file.close()
''',
)

TEMPLATES: dict[str, KindTemplate] = {
    "generation": GENERATION,
    "policy": POLICY,
    "estimator": ESTIMATOR,
    "environment": ENVIRONMENT,
    "weight_sync": WEIGHT_SYNC,
    "logger": LOGGER,
}

# Where each kind's block lives in a run config, and how `grpoctl run` selects it.
_BLOCKS = {"generation": "policy.generation", "policy": "policy", "estimator": "grpo.adv_estimator",
           "environment": "env", "weight_sync": "weight_sync", "logger": "logger"}
_CLI = {"generation": "policy.generation.backend=$name", "policy": "policy.backend=$name",
        "estimator": "grpo.adv_estimator.name=$name", "environment": "env.name=$name",
        "weight_sync": "weight_sync.backend=$name", "logger": "'logger.loggers=[jsonl,$name]'"}


def cli_selection(kind: str, name: str) -> str:
    """The `grpoctl run` override that selects component ``name`` of ``kind``."""
    return Template(_CLI[kind]).substitute(name=name)


def render(names: PluginNames, kind: str, sdk: str | None = None) -> dict[str, str]:
    """The project's files, path -> text; ``sdk`` is the grpo-sdk requirement (default: this major)."""
    if kind not in TEMPLATES:
        raise ValueError(f"unknown kind {kind!r}; kinds: {', '.join(TEMPLATES)}")
    t, label = TEMPLATES[kind], KIND_LABELS[kind]
    values = {"name": names.name, "dist": names.dist, "package": names.package, "kind": kind,
              "group": KINDS[kind], "label": label, "a_label": ("an " if label[0] in "aeiou" else "a ") + label,
              "summary": t.summary, "module": t.module, "protocol": t.protocol, "Impl": names.classes + t.suffix, "Config": names.classes + "Config",
              "block": f"{_BLOCKS[kind]}.{names.name}", "capabilities": t.capabilities, "options": t.options,
              "api": PLUGIN_API_VERSION}
    values["usage"] = Template(t.usage).substitute(values)
    values["cli"] = cli_selection(kind, names.name)
    values["dependencies"] = ", ".join(f'"{d}"' for d in (sdk or sdk_requirement(), *t.dependencies))
    files = {
        "pyproject.toml": PYPROJECT,
        "README.md": README,
        ".gitignore": GITIGNORE,
        f"src/{names.package}/__init__.py": INIT,
        f"src/{names.package}/spec.py": SPEC,
        f"src/{names.package}/{t.module}.py": t.impl,
        "tests/conftest.py": CONFTEST,
        "tests/test_contract.py": TEST_CONTRACT,
    }
    return {path: Template(text).substitute(values) for path, text in files.items()}


def write_project(directory: Path, files: dict[str, str]) -> list[Path]:
    """Write ``files`` under ``directory``, which must be absent or empty (nothing is overwritten)."""
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        raise FileExistsError(f"{directory} already exists and is not an empty directory")
    written = []
    for relative, text in files.items():
        path = directory / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written
