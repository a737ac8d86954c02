"""Shared fixtures: a tiny local model, and fake installed distributions.

Tests pin torch to one thread: on a 2-core machine torch's default of two threads collapses
(50x slower) as soon as anything else uses a core. Nothing can be downloaded from a hub here,
so ``tiny_model_dir`` builds the built-in recipe's model locally.

``importlib.metadata`` finds a distribution wherever a ``<name>-<version>.dist-info`` folder with
``METADATA`` and ``entry_points.txt`` sits on ``sys.path``, so a plugin is "installed" by writing
that folder and its package next to it: no pip, no network. ``FakeSite`` writes them::

    site.add("acme-gen", entry_points={"grpo_sdk.generation": {"acme": "acme_gen.spec:SPEC"}},
             files={"acme_gen/__init__.py": "", "acme_gen/spec.py": "..."})
    site.grpoctl("plugins", "list")   # the real CLI in a subprocess that sees the fake site

Two helpers every module shares: the ``registry`` fixture (the installed plugins, plus a module's
own test components when it marks itself ``pytestmark = pytest.mark.hook_plugin(Components())``)
and ``run_grpoctl`` (the real CLI in a fresh interpreter)::

    from conftest import run_grpoctl
    proc = run_grpoctl("config", "validate", cwd=tmp_path)
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no hub here; fail fast instead of retrying

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


@pytest.fixture(scope="module")
def megatron_world():
    """For a megatron lane module: the first megatron component builds a gloo world of one, Megatron's
    model-parallel state and the CPU shims when none exist; this tears down what they built, after the
    module."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    existed = dist.is_initialized()
    yield
    if not existed:
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "hook_plugin(*plugins): hook plugins (objects with hookimpls) the module's "
                                       "`registry` fixture registers, for test components")


@pytest.fixture(scope="module")
def registry(request: pytest.FixtureRequest):
    """The registry of the installed plugins, discovered once per module; with the module's
    ``hook_plugin`` mark, of those plugins instead of the installed hook plugins."""
    from grpo_sdk.plugins.host import PluginHost
    from grpo_sdk.plugins.registry import Registry

    mark = request.node.get_closest_marker("hook_plugin")
    if mark is None:
        return Registry.discover()
    host = PluginHost()
    for i, plugin in enumerate(mark.args):
        host.register(plugin, name=f"{request.module.__name__}-{i}")
    return Registry.discover(host=host)


@pytest.fixture
def cli(capsys):
    """Run `grpoctl ARGS` in-process, through the entry point's main: (exit code, stdout, stderr).
    Faster than ``run_grpoctl``; the invocation's shared plugin state is put back afterwards."""
    from grpo_sdk.cli.app import main
    from grpo_sdk.cli.common import STATE

    saved = (STATE.host, STATE.registry)

    def run(*args: str) -> tuple[int, str, str]:
        code = main(list(args))
        out, err = capsys.readouterr()
        return code, out, err

    yield run
    STATE.host, STATE.registry = saved


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


@pytest.fixture
def fake_site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """An empty FakeSite that is on ``sys.path`` for this test (for in-process discovery)."""
    monkeypatch.delenv(STRICT_ENV, raising=False)
    site = FakeSite(tmp_path / "site")
    monkeypatch.syspath_prepend(str(site.root))
    yield site
    site.forget_modules()


@pytest.fixture(scope="module")
def make_site(tmp_path_factory: pytest.TempPathFactory):
    """Build FakeSites shared by a module's subprocess tests; never put on this process's path."""
    return lambda: FakeSite(tmp_path_factory.mktemp("site"))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A randomly initialised 2-layer GPT-2 + character tokenizer, as the built-in recipe builds it."""
    import torch

    from grpo_sdk.recipes.tiny_model import build_tiny_gpt2

    torch.set_num_threads(1)
    return build_tiny_gpt2(tmp_path_factory.mktemp("tiny_gpt2"), seed=0)


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
    from grpo_sdk.rollouts.episodes import left_pad

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
