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
        env = {k: v for k, v in os.environ.items() if k != STRICT_ENV}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(self.root), os.environ.get("PYTHONPATH")]))
        env["OMP_NUM_THREADS"] = "1"
        if strict:
            env[STRICT_ENV] = "1"
        return subprocess.run([sys.executable, "-m", "grpo_sdk.cli.app", *args], env=env, cwd=self.root,
                              capture_output=True, text=True, timeout=timeout)


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
    from grpo_sdk.core.config_loader import load_config
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
    from grpo_sdk.trainer.rollout import left_pad

    ids, mask = left_pad(tokenizer(texts)["input_ids"], tokenizer.pad_token_id)
    return GenerationInput(input_ids=ids, attention_mask=mask)


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
    from grpo_sdk.core.config_loader import load_config
    from grpo_sdk.trainer.trainer import GRPOTrainer

    cfg = load_config(None, [f"policy.model_name={model_dir}", "grpo.num_prompts_per_step=4",
                             "grpo.num_generations_per_prompt=4", "grpo.max_num_steps=2", *overrides], registry)
    trainer = GRPOTrainer(cfg, run_dir=run_dir, registry=registry)
    trainer.setup()
    return trainer
