"""`grpo_sdk.testing`, the contract kit: passes components that fit, and says why one does not.

The components under test are fake installed distributions (``FakeSite`` in tests/helpers): an
estimator ``kit`` whose spec, config class or implementation each variant breaks in one way, a
generation backend that forgets the weight version of its last sync, and one that ignores the
weights it is sent. Every check runs against
``Registry.discover()``, as a plugin package's own tests do. The built-in components pass the
static checks; the last tests run the pytest plugin itself in a plugin-like project.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from grpo_sdk.plugins.registry import Registry
from grpo_sdk.testing import (
    ContractError,
    check_config,
    check_light,
    check_protocol,
    check_spec,
    parse_component,
    run_training,
)

SPEC = '''\
import attrs
{spec_imports}
from grpo_sdk.plugins import ComponentSpec, option


@attrs.frozen(kw_only=True)
class KitConfig:
    scale: float = option(1.0, "Multiply every advantage.")
{extra_field}

SPEC = ComponentSpec(name="kit", kind="estimator", impl="kit_est.impl:KitEstimator",
                     config="kit_est.spec:KitConfig", summary="Group-mean baseline, for the kit's tests.")
'''

IMPL = '''\
import torch


class KitEstimator:
    def __init__(self, config, context):
        self.config = config

    {signature}
        advantages = torch.zeros_like(rewards)
        for group in group_ids.unique():
            rows = group_ids == group
            advantages[rows] = rewards[rows] - rewards[rows].mean()
        return {result}
'''

GOOD_SIGNATURE = "def compute_advantages(self, rewards, group_ids, mask, **extras):"
GOOD_RESULT = "self.config.scale * advantages[:, None] * mask"


def install_kit(site, *, spec_imports="", extra_field="", signature=GOOD_SIGNATURE, result=GOOD_RESULT):
    site.add("kit-est", entry_points={"grpo_sdk.estimators": {"kit": "kit_est.spec:SPEC"}}, files={
        "kit_est/__init__.py": "",
        "kit_est/spec.py": SPEC.format(spec_imports=spec_imports, extra_field=extra_field),
        "kit_est/impl.py": IMPL.format(signature=signature, result=result),
    })
    return Registry.discover()


# --- a component that fits --------------------------------------------------------------------------


def test_a_fitting_component_passes_every_check(fake_site, tiny_model_dir, tmp_path):
    registry = install_kit(fake_site)
    assert check_spec("estimator", "kit", registry=registry).name == "kit"
    assert check_light("estimator", "kit", registry=registry) == ["kit_est.spec"]
    assert repr(check_config("estimator", "kit", ["grpo.adv_estimator.kit.scale=0.5"], registry=registry)) \
        == "KitConfig(scale=0.5)"
    assert check_protocol("estimator", "kit", registry=registry).__name__ == "KitEstimator"
    rows = run_training("estimator", "kit", steps=2, registry=registry, model_dir=tiny_model_dir,
                        run_dir=tmp_path / "run")
    assert [row["step"] for row in rows] == [1, 2]
    assert rows[1]["generation/weight_version"] == 1
    assert abs(rows[1]["token_mult_prob_error"] - 1) < 0.01


TYPED_SIGNATURE = ("def compute_advantages(self, batch):\n"
                   "        rewards, group_ids, mask = batch.rewards, batch.group_ids, batch.mask")


def test_an_estimator_taking_the_typed_input_passes_without_a_deprecation(fake_site, tiny_model_dir, tmp_path):
    import warnings

    registry = install_kit(fake_site, signature=TYPED_SIGNATURE)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # only API 1's form is adapted, with a warning
        impl = check_protocol("estimator", "kit", registry=registry)
    assert impl.__name__ == "KitEstimator" and "api1_estimator" not in impl.__dict__
    rows = run_training("estimator", "kit", steps=2, registry=registry, model_dir=tiny_model_dir,
                        run_dir=tmp_path / "run")
    assert [row["step"] for row in rows] == [1, 2]


def test_an_estimator_that_takes_nothing_is_explained(fake_site):
    registry = install_kit(fake_site, signature="def compute_advantages(self):\n        rewards = group_ids = None")
    with pytest.raises(ContractError, match=r"compute_advantages\(\) does not fit compute_advantages\(batch\)"):
        check_protocol("estimator", "kit", registry=registry)


def kit_reward(completions, **columns):
    """A reward function the reward_functions environment's config check can import (its folder is on sys.path)."""
    return [0.0] * len(completions)


# What some built-ins need besides their own block: the run config's cross-field checks hold them
# to it, as they would a third-party plugin (whose grpo_components entry carries the overrides).
BUILTIN_OVERRIDES = {
    ("estimator", "opd"): ["on_policy_distillation.teacher_model=teacher"],
    ("environment", "math"): ["data.train_path=train.jsonl", "grpo.val_period=0", "grpo.val_at_end=false"],
    ("estimator", "gdpo"): ["env.reverse_digits.format_weight=0.1"],  # two reward components
    ("environment", "reward_functions"): ["data.train_path=train.jsonl", "grpo.val_period=0", "grpo.val_at_end=false",
                                          "env.reward_functions.functions=[test_testing_kit:kit_reward]"],
    # A hub name: the config check reads a local model's config.json, and leaves a hub model to its load.
    ("environment", "reward_model"): ["data.train_path=train.jsonl", "grpo.val_period=0", "grpo.val_at_end=false",
                                      "env.reward_model.model_name=acme/tiny-reward-model"],
    ("environment", "code"): ["data.train_path=train.jsonl", "grpo.val_period=0", "grpo.val_at_end=false"],
    ("environment", "agent"): ["data.train_path=train.jsonl", "grpo.val_period=0", "grpo.val_at_end=false",
                               "env.agent.agent=http://127.0.0.1:9/agent"],
    # A stand-in for NeMo-Gym's venv (absent from the main lane): it answers the config check's probe.
    ("environment", "nemo_gym"): ["data.train_path=train.jsonl", "grpo.val_period=0", "grpo.val_at_end=false",
                                  "env.nemo_gym.python=" + os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures",
                                                                        "nemo_gym", "fake-python")],
    # Clients of servers: a URL is required (nothing answers there; the static checks do not connect).
    ("generation", "sglang"): ["policy.generation.sglang.url=http://127.0.0.1:9"],
    ("generation", "trtllm"): ["policy.generation.trtllm.mode=server", "policy.generation.trtllm.url=http://127.0.0.1:9"],
    ("generation", "dynamo"): ["policy.generation.dynamo.frontend_url=http://127.0.0.1:9/v1",
                               "policy.generation.dynamo.worker_urls=[http://127.0.0.1:9]",
                               "policy.generation.colocated.enabled=false", "weight_sync.backend=collective"],
    ("weight_sync", "collective"): ["cluster.runtime=ray"],
    ("weight_sync", "cuda_ipc"): ["cluster.runtime=ray", "cluster.device=cuda", "cluster.gpus_per_node=1"],
}


@pytest.mark.parametrize("kind", ["generation", "policy", "estimator", "environment", "weight_sync", "logger"])
def test_every_builtin_component_passes_the_static_checks(kind):
    registry = Registry.discover()
    names = [info.name for info in registry.list(kind) if info.dist == "grpo-sdk" and info.status == "ok"]
    assert names, f"no built-in {kind} installed"
    for name in names:
        check_spec(kind, name, registry=registry)
        check_protocol(kind, name, registry=registry)
        check_config(kind, name, BUILTIN_OVERRIDES.get((kind, name), []), registry=registry)


# --- and components that do not ---------------------------------------------------------------------


def test_a_missing_component_names_what_is_installed(fake_site):
    with pytest.raises(ContractError, match=r"no advantage estimator 'nope' is installed \(known: .*grpo"):
        check_spec("estimator", "nope", registry=Registry.discover())


def test_a_spec_that_fails_to_import_reports_the_error(fake_site):
    registry = install_kit(fake_site, spec_imports="import kit_engine_sdk")
    with pytest.raises(ContractError, match="kit_engine_sdk"):
        check_spec("estimator", "kit", registry=registry)


def test_a_heavy_spec_module_is_caught(fake_site):
    registry = install_kit(fake_site, spec_imports="import torch")
    with pytest.raises(ContractError, match=r"imports torch: discovery .* imports every installed spec"):
        check_light("estimator", "kit", registry=registry)


def test_an_option_without_help_is_named(fake_site):
    registry = install_kit(fake_site, extra_field="    offset: float = attrs.field(default=0.0)")
    with pytest.raises(ContractError, match=r"options of advantage estimator 'kit' without help text: offset"):
        check_config("estimator", "kit", registry=registry)


def test_a_bad_override_reports_the_key(fake_site):
    registry = install_kit(fake_site)
    with pytest.raises(ContractError, match=r"grpo\.adv_estimator\.kit\.scael"):
        check_config("estimator", "kit", ["grpo.adv_estimator.kit.scael=2"], registry=registry)


@pytest.mark.parametrize("signature, message", [
    ("def compute_advantages(self, rewards, group_ids, mask):", "does not accept **extras"),
    ("def compute_advantages(self, rewards, group_ids):", "missing: mask"),
    ("def compute_advantages(self, rewards, group_ids, mask, baseline, **extras):",
     "requires the argument baseline, which the loop never passes"),
    ("async def compute_advantages(self, rewards, group_ids, mask, **extras):", "is async"),
    ("def advantages(self, rewards, group_ids, mask, **extras):", "has no method compute_advantages"),
])
def test_a_method_the_loop_cannot_call_is_explained(fake_site, signature, message):
    registry = install_kit(fake_site, signature=signature)
    with pytest.raises(ContractError, match="does not satisfy the AdvantageEstimator protocol") as caught:
        check_protocol("estimator", "kit", registry=registry)
    assert message in str(caught.value)


def test_non_finite_advantages_fail_the_training_run(fake_site, tiny_model_dir):
    registry = install_kit(fake_site, result="advantages[:, None] * mask * float('nan')")
    with pytest.raises(ContractError, match="advantage estimator 'kit'"):
        run_training("estimator", "kit", steps=2, registry=registry, model_dir=tiny_model_dir)


STALE_GENERATION = '''\
from grpo_sdk.backends.hf.generation import HFGeneration


class StaleGeneration(HFGeneration):
    """Loads the new weights but keeps reporting version 0."""

    def update_weights(self, weights, *, version):
        super().update_weights(weights, version=version)
        self.weight_version = 0
'''


def test_a_generation_backend_that_misreports_its_weight_version_fails(fake_site, tiny_model_dir):
    spec = ('from grpo_sdk.plugins import ComponentSpec\n'
            'SPEC = ComponentSpec(name="stale", kind="generation", impl="stale_gen.impl:StaleGeneration",\n'
            '                     config="grpo_sdk.backends.hf.config:HFGenerationConfig", summary="Stale.")\n')
    fake_site.add("stale-gen", entry_points={"grpo_sdk.generation": {"stale": "stale_gen.spec:SPEC"}},
                  files={"stale_gen/__init__.py": "", "stale_gen/spec.py": spec,
                         "stale_gen/impl.py": STALE_GENERATION})
    registry = Registry.discover()
    check_protocol("generation", "stale", registry=registry)  # the methods fit; the behaviour does not
    with pytest.raises(ContractError, match="step 2 sampled with weight version 0, but version 1 was synced"):
        run_training("generation", "stale", steps=2, registry=registry, model_dir=tiny_model_dir)


FAKE_IGNORING_GENERATION = '''\
from grpo_sdk.backends.hf.generation import HFGeneration


class FakeIgnoringGeneration(HFGeneration):
    """A fake: takes every sync's weights, loads none of them, and reports the new version."""

    def update_weights(self, weights, *, version):
        for _ in weights:  # drained, as a transport expects, and dropped
            pass
        self.weight_version = version
'''


def install_fake_ignoring_generation(site):
    spec = ('from grpo_sdk.plugins import ComponentSpec\n'
            'SPEC = ComponentSpec(name="ignoring", kind="generation", impl="ignoring_gen.impl:FakeIgnoringGeneration",\n'
            '                     config="grpo_sdk.backends.hf.config:HFGenerationConfig", summary="A fake.")\n')
    site.add("ignoring-gen", entry_points={"grpo_sdk.generation": {"ignoring": "ignoring_gen.spec:SPEC"}},
             files={"ignoring_gen/__init__.py": "", "ignoring_gen/spec.py": spec,
                    "ignoring_gen/impl.py": FAKE_IGNORING_GENERATION})
    return Registry.discover()


# On the recipe, the run's own step 1 moves the weights and step 2 shows the stale backend. At
# temperature 0.05 each group's samples are identical, every advantage of the run is 0 and no step
# moves the weights: the kit without the weight-sync probe passed this fake there.
def test_a_generation_backend_that_ignores_new_weights_fails(fake_site, tiny_model_dir):
    registry = install_fake_ignoring_generation(fake_site)
    check_protocol("generation", "ignoring", registry=registry)  # the methods fit; the behaviour does not
    with pytest.raises(ContractError, match=r"token_mult_prob_error is 1\.1\d+ in step 2"):
        run_training("generation", "ignoring", steps=2, registry=registry, model_dir=tiny_model_dir)
    with pytest.raises(ContractError, match="generation does not sample with the synced weights") as caught:
        run_training("generation", "ignoring", ["policy.generation.temperature=0.05"], steps=2, registry=registry,
                     model_dir=tiny_model_dir)
    message = str(caught.value)
    assert "generation backend 'ignoring'" in message and "though it reports version 3" in message
    assert "update_weights(weights, version=) must load every (name, tensor)" in message


def test_the_probe_passes_the_builtin_backend_where_the_run_never_moves_the_weights(tiny_model_dir):
    rows = run_training("generation", "hf", ["policy.generation.temperature=0.05"], steps=2,
                        registry=Registry.discover(), model_dir=tiny_model_dir)
    assert all(row["advantages/mean"] == 0 for row in rows)  # the run itself gave the probe nothing to see


@pytest.mark.parametrize("text, error", [
    ("estimator", "expected 'kind:name'"),
    ("sampler:acme", "unknown kind 'sampler'"),
])
def test_parse_component_rejects_malformed_entries(text, error):
    with pytest.raises(ValueError, match=error):
        parse_component(text)


def test_parse_component_keeps_quoted_overrides():
    component = parse_component("estimator:kit 'logger.loggers=[jsonl, console]' grpo.max_num_steps=3")
    assert (component.kind, component.name) == ("estimator", "kit")
    assert component.overrides == ("logger.loggers=[jsonl, console]", "grpo.max_num_steps=3")


# --- the pytest plugin, in a plugin-like project ---------------------------------------------------


def run_pytest(project, site, *args):
    env = {k: v for k, v in os.environ.items() if k != "GRPO_SDK_STRICT_PLUGINS"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site.root), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], cwd=project,
                          env=env, capture_output=True, text=True, timeout=300)


def make_project(tmp_path, components):
    project = tmp_path / "project"
    (project / "tests").mkdir(parents=True)
    (project / "pyproject.toml").write_text(textwrap.dedent(f"""\
        [tool.pytest.ini_options]
        testpaths = ["tests"]
        grpo_components = {components!r}
        """).replace("'", '"'))
    (project / "tests" / "conftest.py").write_text('pytest_plugins = ["grpo_sdk.testing"]\n')
    (project / "tests" / "test_contract.py").write_text(
        "from grpo_sdk.testing import ContractTests\n\n\nclass TestContract(ContractTests):\n    pass\n")
    return project


def test_the_pytest_plugin_reports_the_contract_failure(fake_site, tmp_path):
    install_kit(fake_site, signature="def compute_advantages(self, rewards, group_ids, mask):")
    project = make_project(tmp_path, ["estimator:kit"])
    result = run_pytest(project, fake_site, "-k", "spec or config or protocol")
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-2000:]
    assert "1 failed, 3 passed, 1 deselected" in result.stdout
    assert "test_protocol[estimator:kit]" in result.stdout and "does not accept **extras" in result.stdout


def test_the_pytest_plugin_needs_components_to_check(fake_site, tmp_path):
    project = make_project(tmp_path, [])
    result = run_pytest(project, fake_site)
    assert result.returncode == 2  # a collection error: nothing ran
    assert "lists none: add grpo_components" in result.stdout


def test_overrides_known_at_test_time_reach_the_kit_and_each_case_has_a_readable_id(fake_site, tmp_path):
    install_kit(fake_site)
    project = make_project(tmp_path, ["estimator:kit", "estimator:kit grpo.adv_estimator.kit.scale=0.5"])
    (project / "tests" / "test_contract.py").write_text(textwrap.dedent("""\
        import pytest

        from grpo_sdk.testing import ContractTests


        class TestContract(ContractTests):
            @pytest.fixture
            def grpo_overrides(self, grpo_component):  # e.g. a server's port; here a typo to show it arrives
                return ["grpo.adv_estimator.kit.scael=2"] if grpo_component.overrides else []
        """))
    result = run_pytest(project, fake_site, "-vv", "-k", "test_config")  # -vv: past run_pytest's -q
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-2000:]
    assert "test_config[estimator:kit] PASSED" in result.stdout
    assert "test_config[estimator:kit grpo.adv_estimator.kit.scale=0.5] FAILED" in result.stdout
    assert "grpo.adv_estimator.kit.scael" in result.stdout
