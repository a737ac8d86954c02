"""Helpers every test folder shares (fixtures live in tests/conftest.py; tests/README.md).

``run_grpoctl`` runs the real CLI in a fresh interpreter::

    from helpers import run_grpoctl
    proc = run_grpoctl("config", "validate", cwd=tmp_path)

``importlib.metadata`` finds a distribution wherever a ``<name>-<version>.dist-info`` folder with
``METADATA`` and ``entry_points.txt`` sits on ``sys.path``, so a plugin is "installed" by writing
that folder and its package next to it: no pip, no network. ``FakeSite`` writes them::

    site.add("acme-gen", entry_points={"grpo_sdk.generation": {"acme": "acme_gen.spec:SPEC"}},
             files={"acme_gen/__init__.py": "", "acme_gen/spec.py": "..."})
    site.grpoctl("plugins", "list")   # the real CLI in a subprocess that sees the fake site

The rest build what the backend and trainer tests feed their components (a ``RunContext`` for the
tiny model, prompt and train batches, set-up or bare trainers), run and compare whole runs (``train``,
``assert_same_results``, ``run_and_kill_after``) and compare replay-buffer groups. The submodules hold
the heavier helpers: ``ray_fixtures`` (the shared Ray clusters), ``serve`` (`grpoctl serve` in a
subprocess), ``venvs`` (a fresh virtual environment for pip installs), ``gguf_files`` (a tiny GGUF
file) and ``two_node_cluster`` (a script).
"""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

STRICT_ENV = "GRPO_SDK_STRICT_PLUGINS"


def _megatron_installed() -> bool:
    import importlib.util

    return all(importlib.util.find_spec(name) is not None for name in ("megatron", "mbridge")) and \
        importlib.util.find_spec("megatron.core") is not None


# ``pytestmark = MEGATRON_LANE`` in a test module: the megatron lane's tests, which need megatron-core and
# mbridge (in their own venv) and are skipped, with this reason, in the main one.
MEGATRON_LANE = [pytest.mark.megatron,
                 pytest.mark.skipif(not _megatron_installed(),
                                    reason="needs megatron-core and mbridge (the megatron lane's venv: .ci/megatron-lane)")]


def grpoctl_env(env: dict[str, str] | None = None, *, strict: bool = False, **extra: str) -> dict[str, str]:
    """The environment ``run_grpoctl`` gives the CLI: ``env`` (default: this process's) with one torch
    thread, no hub, unbuffered output and strict plugin mode off (``strict=True`` turns it on)."""
    out = {k: v for k, v in (os.environ if env is None else env).items() if k != STRICT_ENV}
    out.update({"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **extra})
    if strict:
        out[STRICT_ENV] = "1"
    return out


def run_grpoctl(*args: object, cwd: str | Path | None = None, python: str | Path = sys.executable,
                env: dict[str, str] | None = None, strict: bool = False, timeout: float = 600,
                **extra_env: str) -> subprocess.CompletedProcess:
    """``grpoctl ARGS`` as a user runs it: ``python -m grpo_sdk.cli.entry`` (what the script runs) in a fresh interpreter (another
    venv's python too), in ``cwd``, with ``grpoctl_env(env, strict=strict, **extra_env)``; output captured."""
    return subprocess.run([str(python), "-m", "grpo_sdk.cli.entry", *map(str, args)], cwd=cwd,
                          env=grpoctl_env(env, strict=strict, **extra_env), capture_output=True, text=True,
                          timeout=timeout)


class FakeSite:
    """A folder of fake distributions; ``add`` installs one, ``grpoctl`` runs the CLI against them."""

    def __init__(self, root: Path):
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)
        self.packages: set[str] = set()

    def add(self, dist: str, *, version: str = "0.1", entry_points: dict[str, dict[str, str]],
            files: dict[str, str]) -> None:
        """Install distribution ``dist``: its dist-info folder plus ``files`` (path -> source)."""
        info = self.root / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        (info / "entry_points.txt").write_text("".join(
            f"[{group}]\n" + "".join(f"{name} = {target}\n" for name, target in eps.items()) + "\n"
            for group, eps in entry_points.items()))
        for rel, source in files.items():
            path = self.root / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(source)
            self.packages.add(Path(rel).parts[0].removesuffix(".py"))
        importlib.invalidate_caches()  # metadata and import finders cache directory listings

    def forget_modules(self) -> None:
        """Drop the fake packages from ``sys.modules`` so no later test sees them."""
        for name in list(sys.modules):
            if name.split(".")[0] in self.packages:
                del sys.modules[name]

    def grpoctl(self, *args: str, strict: bool = False, timeout: float = 60) -> subprocess.CompletedProcess:
        """Run the real ``grpoctl`` in a subprocess that has this site on its path."""
        path = os.pathsep.join(filter(None, [str(self.root), os.environ.get("PYTHONPATH")]))
        return run_grpoctl(*args, cwd=self.root, strict=strict, timeout=timeout, PYTHONPATH=path)


def config_problems(registry, *overrides: str) -> dict[str, str]:
    """Key -> every message a config load reports about it, joined (the load must fail)."""
    from grpo_sdk.config.loading import load_config
    from grpo_sdk.core.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        load_config(None, list(overrides), registry)
    found: dict[str, str] = {}
    for key, message in info.value.problems:
        found[key] = f"{found[key]} | {message}" if key in found else message
    return found


def prompt_batch(tokenizer, texts):
    """Left-padded ``GenerationInput`` of ``texts``, as the loop builds it."""
    from grpo_sdk.core.records import GenerationInput
    from grpo_sdk.plugins.tensors import left_pad

    ids, mask = left_pad(tokenizer(texts)["input_ids"], tokenizer.pad_token_id)
    return GenerationInput(input_ids=ids, attention_mask=mask)


def token_rows(rows, pad_token_id=0):
    """Left-padded ``GenerationInput`` of token-id lists (the engine tests' prompts)."""
    import torch

    from grpo_sdk.core.records import GenerationInput

    width = max(len(r) for r in rows)
    return GenerationInput(input_ids=torch.tensor([[pad_token_id] * (width - len(r)) + list(r) for r in rows]),
                           attention_mask=torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows]))


def response_rows(out):
    """``(tokens, logprobs, truncated)`` of each row of a ``GenerationOutput``, padding removed."""
    return [(out.response_ids[i, :n].tolist(), out.logprobs[i, :n].tolist(), bool(out.truncated[i]))
            for i, n in enumerate(out.response_lengths.tolist())]


def tiny_run_context(model_dir, registry, **fields):
    """The ``RunContext`` a backend gets for the tiny model, on the CPU, seed 0 (``fields`` override)."""
    from grpo_sdk.config.loading import load_config
    from grpo_sdk.config.context import RunContext

    cfg = load_config(None, [f"policy.model_name={model_dir}"], registry)
    return RunContext(**{"config": cfg, "run_dir": model_dir, "model_path": str(model_dir),
                         "tokenizer_path": str(model_dir), "device": "cpu", "seed": 0, "needs_reference": False,
                         **fields})


def perturbed_policy(context, seed, scale):
    """An hf policy on ``context``'s model with seeded Gaussian noise of std ``scale`` added to every
    parameter: new weights for a sync to carry."""
    import torch

    from grpo_sdk.backends.hf.policy import HFPolicy

    policy = HFPolicy(None, context)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in policy.model.named_parameters():
            param.add_(torch.randn(param.shape, generator=generator) * scale)
    return policy


def train_batch(inputs, out):
    """A ``TrainBatch`` of prompts + sampled responses (loss on the response tokens only)."""
    import torch

    from grpo_sdk.core.records import TrainBatch

    width = out.response_ids.shape[1]
    response_mask = (torch.arange(width)[None] < out.response_lengths[:, None]).long()
    rows = inputs.input_ids.shape[0]
    return TrainBatch(
        input_ids=torch.cat([inputs.input_ids, out.response_ids], 1),
        attention_mask=torch.cat([inputs.attention_mask, response_mask], 1),
        token_mask=torch.cat([torch.zeros_like(inputs.input_ids), response_mask], 1).float(),
        sample_mask=torch.ones(rows), generation_logprobs=torch.cat([torch.zeros(inputs.input_ids.shape), out.logprobs], 1),
        group_ids=torch.zeros(rows, dtype=torch.long), rewards=torch.zeros(rows))


def small_trainer(registry, run_dir, model_dir, *overrides):
    """A set-up GRPOTrainer on the built-in recipe with a local model and 4 x 4 rollouts."""
    from grpo_sdk.config.loading import load_config
    from grpo_sdk.trainer.trainer import GRPOTrainer

    cfg = load_config(None, [f"policy.model_name={model_dir}", "grpo.num_prompts_per_step=4",
                             "grpo.num_generations_per_prompt=4", "grpo.max_num_steps=2", *overrides], registry)
    trainer = GRPOTrainer(cfg, run_dir=run_dir, registry=registry)
    trainer.setup()
    return trainer


def trainer_for(registry, tmp_path, model_dir, *overrides):
    """``small_trainer`` (set up, 4 x 4 rollouts on ``model_dir``) with its run in ``tmp_path / "run"``."""
    return small_trainer(registry, tmp_path / "run", model_dir, *overrides)


def bare_trainer(tmp_path, name, *overrides, registry=None, resume=False):
    """A GRPOTrainer of ``overrides`` alone on the built-in recipe, in ``tmp_path / name``, NOT set up;
    ``registry`` defaults to the installed plugins."""
    from grpo_sdk.config.loading import load_config
    from grpo_sdk.plugins.registry import Registry
    from grpo_sdk.trainer.trainer import GRPOTrainer

    registry = registry or Registry.discover()
    cfg = load_config(None, list(overrides), registry)
    trainer = GRPOTrainer(cfg, run_dir=tmp_path / name, registry=registry, resume=resume)
    return trainer


def train(trainer, on_step=None):
    """Set up, train, shut down; the per-step metrics."""
    steps = []

    def record(step, metrics):
        steps.append(dict(metrics))
        if on_step is not None:
            on_step(step, metrics)

    try:
        trainer.setup()
        trainer.train(on_step=record)
    finally:
        trainer.shutdown()
    return steps


SAME_RESULTS_TOLERANCE = 1e-5  # in-process and on Ray: the same numbers up to float reordering


def assert_same_results(a, b):
    """Two runs' per-step metrics (``train``'s) agree on loss, reward, grad norm and advantages."""
    assert len(a) == len(b)
    for step, (x, y) in enumerate(zip(a, b), start=1):
        for key in ("loss", "reward/mean", "grad_norm", "advantages/max"):
            assert abs(x[key] - y[key]) <= SAME_RESULTS_TOLERANCE, (step, key, x[key], y[key])


def run_and_kill_after(args, cwd, step: int, **extra_env: str) -> None:
    """Start `grpoctl run` (with ``extra_env`` in its environment), SIGKILL it as soon as it reports `step`."""
    proc = subprocess.Popen([sys.executable, "-m", "grpo_sdk.cli.entry", *args], cwd=cwd, env=grpoctl_env(**extra_env),
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        for line in proc.stdout:
            if line.startswith(f"step {step}/"):
                proc.send_signal(signal.SIGKILL)
                break
        proc.wait(timeout=60)
    finally:
        proc.kill()


def assert_same_tensor(a, b, what):
    """Both None, or equal in dtype, shape and every element; ``what`` names it in the failure."""
    import torch

    assert (a is None) == (b is None), what
    if a is not None:
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), what


def assert_same_group(a, b):
    """Two replay-buffer groups (``BufferedGroup``) are the same, field by field and tensor by tensor."""
    import attrs
    import torch

    for name in ("ordinal", "target_step", "weight_version", "last_weight_version", "epoch", "generation_seconds",
                 "attempts"):
        assert getattr(a, name) == getattr(b, name), name
    assert_same_tensor(a.token_weight_versions, b.token_weight_versions, "token_weight_versions")
    x, y = a.rollouts, b.rollouts
    for f in attrs.fields(type(x)):  # a RolloutBatch
        value = getattr(x, f.name)
        if isinstance(value, torch.Tensor) or value is None and f.name in ("rewards", "unshaped_rewards"):
            assert_same_tensor(value, getattr(y, f.name), f.name)
    assert list(x.reward_components) == list(y.reward_components)
    for name in x.reward_components:
        assert_same_tensor(x.reward_components[name], y.reward_components[name], name)
    assert x.message_logs == y.message_logs
    assert x.metadata == y.metadata
    assert (x.pad_token_id, x.weight_version) == (y.pad_token_id, y.weight_version)


def no_eos_model(path, seed):
    """A tiny GPT-2 (head_dim 32, as vLLM's CPU attention needs) whose EOS logit is about -64.

    ln_f's bias of 1 adds sum(w_j) to the logit of token j; an EOS embedding of -1 everywhere makes
    that -64 while every other token keeps a random, seed-dependent logit. So sampling at
    temperature 1 gives varied responses that run to max_new_tokens.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from grpo_sdk.recipes.tiny_model import build_tiny_gpt2

    out = build_tiny_gpt2(path, seed=seed, n_head=2, n_positions=512)
    model = AutoModelForCausalLM.from_pretrained(out)
    with torch.no_grad():
        model.transformer.ln_f.bias.fill_(1.0)
        model.transformer.wte.weight[model.config.eos_token_id] = -1.0
    model.save_pretrained(out)
    return out
