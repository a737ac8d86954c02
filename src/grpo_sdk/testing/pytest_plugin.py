"""The contract kit's pytest plugin: the ``grpo_components`` ini option and its fixtures.

Opt-in, like ``tox.pytest``: a plugin package's ``conftest.py`` says
``pytest_plugins = ["grpo_sdk.testing"]`` (grpo-sdk does not register it through a ``pytest11``
entry point, so installing grpo-sdk changes no other project's test run).

``grpo_components`` (``[tool.pytest.ini_options]``) lists the components the package provides,
``"kind:name"`` optionally followed by config overrides for their training run::

    grpo_components = [
        "estimator:acme",
        "estimator:acme-multi env.name=acme_two_rewards grpo.adv_estimator.acme-multi.weights=[1,2]",
    ]

Every test that takes the ``grpo_component`` fixture runs once per entry, and its id is the
entry as written (``test_trains[estimator:acme]``, ``test_trains[estimator:acme-multi env.name=...]``);
``grpo_sdk.testing.ContractTests`` is the ready-made suite.

Overrides that only exist once the tests run (the port of a server a fixture started) come from
the ``grpo_overrides`` fixture, empty here: a plugin's ``conftest.py`` or its ``ContractTests``
subclass overrides it, and may take ``grpo_component`` to give each entry its own.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from grpo_sdk.testing.checks import Component, parse_component

INI_HELP = ('grpo-sdk components to run the contract tests for: "kind:name" plus optional config overrides '
            'for the training run, e.g. "generation:acme".')


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini("grpo_components", INI_HELP, type="linelist", default=[])


def configured_components(config: pytest.Config) -> list[Component]:
    components = []
    for line in config.getini("grpo_components"):
        try:
            components.append(parse_component(line))
        except ValueError as exc:
            raise pytest.UsageError(f"grpo_components: {exc}") from None
    return components


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "grpo_component" not in metafunc.fixturenames:
        return
    components = configured_components(metafunc.config)
    if not components:
        raise pytest.UsageError(
            f"{metafunc.definition.nodeid} checks the components listed in the grpo_components ini option, "
            'and it lists none: add grpo_components = ["kind:name"] to [tool.pytest.ini_options] in '
            "pyproject.toml")
    metafunc.parametrize("grpo_component", components, ids=case_id, indirect=True)


def case_id(component: Component) -> str:
    """The test id of a ``grpo_components`` entry: the entry itself, quoted as shlex would."""
    return shlex.join([str(component), *component.overrides])


@pytest.fixture
def grpo_component(request: pytest.FixtureRequest) -> Component:
    """One entry of the ``grpo_components`` ini option: ``.kind``, ``.name``, ``.overrides``."""
    return request.param


@pytest.fixture
def grpo_overrides() -> list[str]:
    """Config overrides for ``test_config`` and ``test_trains`` known only at test time; none here.

    Override it where they are known, e.g. in the ``ContractTests`` subclass::

        @pytest.fixture
        def grpo_overrides(self, acme_server):
            return [f"policy.generation.acme.url={acme_server.url}"]
    """
    return []


@pytest.fixture(scope="session")
def grpo_tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in recipe's tiny GPT-2 and character tokenizer, built once per session."""
    from grpo_sdk.recipes.tiny_model import build_tiny_gpt2

    return build_tiny_gpt2(tmp_path_factory.mktemp("grpo_tiny_gpt2"), seed=0)
