"""The contract kit: checks a plugin package runs to prove its component fits grpo-sdk.

Four checks, each raising an ``AssertionError`` that says what is wrong and how to fix it:

* ``check_spec(kind, name)``: the component is discovered through its entry point, its status
  is ok, and the entry-point name is the spec's name; ``check_light`` adds that importing the
  spec and config modules imports no torch (``grpoctl plugins list`` imports them all);
* ``check_config(kind, name)``: its config class is an attrs class whose every option has help
  text, and it structures from ``{}`` through the real config loader with the component selected
  (strict keys and types, the cross-field checks), and back from its resolved YAML;
* ``check_protocol(kind, name)``: the implementation class is constructed as
  ``Impl(config, context)`` and has every method of its kind's protocol, with signatures the
  training loop can call;
* ``run_training(kind, name)``: a short CPU run of the built-in recipe (tiny GPT-2, reverse
  digits, 4 prompts x 4 generations) through the real ``GRPOTrainer`` with the component
  selected; every metric of every step must be finite, and the generation backend must sample
  with the weights of the last sync. Then the weight-sync probe: optimizer steps with a fixed
  advantage move the policy's weights for certain (a run's own first steps may not
  move them: rewards all 0 give advantages all 0), one more sync, and the generation backend's
  logprobs of what it samples must match the policy's (``token_mult_prob_error`` close to 1).
  A backend whose ``update_weights`` ignores the weights fails here.

In a plugin package's tests they run as pytest tests: ``tests/conftest.py`` loads the kit as
a pytest plugin (opt-in, like ``tox.pytest``)::

    pytest_plugins = ["grpo_sdk.testing"]

``pyproject.toml`` names the components to check, ``"kind:name"`` plus optional config
overrides for the training run::

    [tool.pytest.ini_options]
    grpo_components = ["generation:acme"]

and a test module subclasses ``ContractTests``::

    from grpo_sdk.testing import ContractTests

    class TestContract(ContractTests):
        pass

Overrides known only when the tests run (the port of a server a fixture started) come from the
``grpo_overrides`` fixture: override it in the class or in ``conftest.py``::

    class TestContract(ContractTests):
        @pytest.fixture
        def grpo_overrides(self, acme_server):
            return [f"policy.generation.acme.url={acme_server.url}"]

Every helper takes ``registry=``: by default components are discovered from the installed
entry points (``Registry.discover()``), as ``grpoctl`` does; pass a registry to check components
registered in-process through the ``grpo_components`` hook.

Importing this module does not import torch; the pytest plugin needs pytest.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

# The kit lives in two modules (the static checks, the training check); its public names are
# importable from here, as plugin packages do.
from grpo_sdk.testing.checks import (  # noqa: F401 - PROTOCOLS, undocumented_options: not in __all__, used by tests
    PROTOCOLS,
    SELECTORS,
    Component,
    ContractError,
    check_config,
    check_light,
    check_protocol,
    check_spec,
    parse_component,
    undocumented_options,
)
from grpo_sdk.testing.training import run_training

__all__ = [
    "SELECTORS",
    "Component",
    "ContractError",
    "ContractTests",
    "check_config",
    "check_light",
    "check_protocol",
    "check_spec",
    "parse_component",
    "run_training",
]


# --- the pytest suite -----------------------------------------------------------------------------


class ContractTests:
    """grpo-sdk's contract as pytest tests, once per component in the ``grpo_components`` ini option.

    Subclass it in a test module (the subclass's name must start with ``Test``)::

        from grpo_sdk.testing import ContractTests

        class TestContract(ContractTests):
            steps = 3                  # training steps of test_trains
            logprob_tolerance = 0.05   # e.g. a bf16 inference engine; None skips the check

    Needs ``pytest_plugins = ["grpo_sdk.testing"]`` in ``conftest.py`` (the ``grpo_component``,
    ``grpo_overrides`` and ``grpo_tiny_model`` fixtures). Config overrides known only when the
    tests run (a server's port) come from the ``grpo_overrides`` fixture; override it::

        class TestContract(ContractTests):
            @pytest.fixture
            def grpo_overrides(self, acme_server):   # a fixture of the plugin's own conftest.py
                return [f"policy.generation.acme.url={acme_server.url}"]

    They follow the component's own overrides (``grpo_components``) in ``test_config`` and
    ``test_trains``. Override a test to skip or extend it.
    """

    steps: int = 2
    logprob_tolerance: float | None = 0.01

    def test_spec(self, grpo_component: Component) -> None:
        check_spec(grpo_component.kind, grpo_component.name)

    def test_spec_is_light(self, grpo_component: Component) -> None:
        check_light(grpo_component.kind, grpo_component.name)

    def test_config(self, grpo_component: Component, grpo_overrides: Sequence[str]) -> None:
        check_config(grpo_component.kind, grpo_component.name, [*grpo_component.overrides, *grpo_overrides])

    def test_protocol(self, grpo_component: Component) -> None:
        check_protocol(grpo_component.kind, grpo_component.name)

    def test_trains(self, grpo_component: Component, grpo_overrides: Sequence[str], grpo_tiny_model: Path,
                    tmp_path: Path) -> None:
        run_training(grpo_component.kind, grpo_component.name, [*grpo_component.overrides, *grpo_overrides],
                     steps=self.steps, run_dir=tmp_path / "run", model_dir=grpo_tiny_model,
                     logprob_tolerance=self.logprob_tolerance)


# The pytest plugin: `pytest_plugins = ["grpo_sdk.testing"]` registers this module, so its hooks
# and fixtures must be names here. Imported last because it uses the helpers above; without
# pytest the check_* helpers still work (e.g. in a release script).
try:
    from grpo_sdk.testing.pytest_plugin import (  # noqa: E402
        grpo_component,
        grpo_overrides,
        grpo_tiny_model,
        pytest_addoption,
        pytest_generate_tests,
    )
except ModuleNotFoundError as exc:
    if exc.name != "pytest":
        raise
else:
    __all__ += ["grpo_component", "grpo_overrides", "grpo_tiny_model", "pytest_addoption", "pytest_generate_tests"]
