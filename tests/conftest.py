"""Shared fixtures and hooks; the helper functions are in tests/helpers (``from helpers import ...``).

Tests pin torch to one thread: on a 2-core machine torch's default of two threads collapses
(50x slower) as soon as anything else uses a core. Nothing can be downloaded from a hub here,
so ``tiny_model_dir`` builds the built-in recipe's model locally.

Every module shares the ``registry`` fixture (the installed plugins, plus a module's own test
components when it marks itself ``pytestmark = pytest.mark.hook_plugin(Components())``).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from helpers import STRICT_ENV, FakeSite, tiny_run_context
# The Ray clusters, defined once for every module (helpers/ray_fixtures.py says why).
from helpers.ray_fixtures import ray_cluster, two_nodes  # noqa: F401 - fixtures

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no hub here; fail fast instead of retrying


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



@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    """The tiny model's tokenizer, loaded as a run loads it."""
    from grpo_sdk.core.models import load_tokenizer

    return load_tokenizer(str(tiny_model_dir))


@pytest.fixture(scope="module")
def context(tiny_model_dir, registry):
    """The ``RunContext`` a backend gets for the tiny model (``tiny_run_context``: CPU, seed 0, no token ids)."""
    return tiny_run_context(tiny_model_dir, registry)
