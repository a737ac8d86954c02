"""A third-party plugin, installed with pip into a fresh virtual environment, as a user installs one.

The fixture project ``tests/fixtures/plugins/grpo-acme-estimator`` is an ordinary setuptools
package that grpo-sdk does not ship: the ``acme_median`` advantage estimator (a component in the
``grpo_sdk.estimators`` group, with a ``scale`` option) and the ``acme-observer`` hook plugin
(``grpo_sdk.hooks``), which writes ``acme_observer.jsonl`` into each run directory.

One virtual environment serves the module (``tests/helpers/venvs.py``: it shares this environment's
packages, so ``pip install --no-deps`` installs only the plugin, in seconds). ``Acme.use``
installs a variant of the project: ``ok`` as written, or a copy whose spec module is broken
(imports a missing package), targets plugin API 2, or requires a package that is not
installed. Each variant is a fresh copy of the project (pip caches the wheels it builds from a
local directory by path), built into a wheel with this environment's setuptools and installed
with ``pip install --no-deps --no-index``: what ``pip install ./project`` does, minus the
download of an isolated build environment, so the test needs no network.

In that environment the real ``grpoctl`` lists the plugin with its distribution and version,
trains with it when config selects it, and reports clearly (exit 3) when it is uninstalled,
broken or written for another plugin API.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from helpers import run_grpoctl
from helpers.venvs import make_venv, pip_install, venv_env

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "plugins" / "grpo-acme-estimator"
DIST, VERSION = "grpo-acme-estimator", "0.3.1"
NAME = "acme_median"
SELECT = f"grpo.adv_estimator.name={NAME}"
SMALL = ("grpo.max_num_steps=3", "grpo.num_prompts_per_step=4", "grpo.val_period=0")

# Each variant edits the spec module of a copy of the project: (anchor, replacement).
VARIANTS = {
    "ok": None,
    "broken": ("import attrs\n", "import attrs\nimport acme_engine_sdk  # a dependency that is not installed\n"),
    "api2": ("    api=1,", "    api=2,"),
    "missing": ("    summary=", "    requires=(\"some-missing-package>=1\",),\n    summary="),
}


class Acme:
    """The venv, which variant of the plugin is installed in it, and ``grpoctl`` run inside it."""

    def __init__(self, root: Path):
        self.root = root
        self.python = make_venv(root / "venv")
        self.installed: str | None = None
        self.copies = 0

    def use(self, variant: str) -> None:
        """Install ``variant`` of the fixture project (no-op when it is the installed one)."""
        if self.installed == variant:
            return
        self.copies += 1
        project = self.root / f"project-{self.copies}-{variant}"
        shutil.copytree(FIXTURE, project, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
        if VARIANTS[variant] is not None:
            spec = project / "src" / "grpo_acme_estimator" / "spec.py"
            anchor, replacement = VARIANTS[variant]
            text = spec.read_text()
            assert text.count(anchor) == 1, f"variant {variant}: anchor {anchor!r} not found once in spec.py"
            spec.write_text(text.replace(anchor, replacement))
        # `pip install ./project` is these two steps; building the wheel with this environment's
        # setuptools (no build isolation) needs no index, so the test runs offline.
        wheels = self.root / f"wheels-{self.copies}"
        built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                                "--no-index", "-w", str(wheels), str(project)], env=venv_env(),
                               capture_output=True, text=True, timeout=300)
        assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-3000:]
        (wheel,) = wheels.glob("grpo_acme_estimator-*.whl")
        result = pip_install(self.python, "--no-index", "--force-reinstall", str(wheel))
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
        self.installed = variant

    def uninstall(self) -> None:
        result = subprocess.run([str(self.python), "-m", "pip", "uninstall", "-y", DIST], env=venv_env(),
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        self.installed = None

    def grpoctl(self, *args: str, strict: bool = False, timeout: float = 120) -> subprocess.CompletedProcess:
        """The real CLI (``grpoctl``'s own ``main``) run by the venv's python, in ``self.root``."""
        return run_grpoctl(*args, cwd=self.root, python=self.python, env=venv_env(), strict=strict, timeout=timeout)

    def listing(self, *args: str) -> tuple[dict, dict]:
        """``plugins list --json``: (the acme_median row or None, the acme-observer hook row or None)."""
        result = self.grpoctl("plugins", "list", "--json", *args)
        assert result.returncode == 0, result.stderr
        data = json.loads(result.stdout)
        rows = {(r["kind"], r["name"]): r for r in data["components"]}
        hooks = {h["name"]: h for h in data["hooks"]}
        return rows.get(("estimator", NAME)), hooks.get("acme-observer")


@pytest.fixture(scope="module")
def acme(tmp_path_factory) -> Acme:
    return Acme(tmp_path_factory.mktemp("acme"))


@pytest.fixture(scope="module")
def trained(acme: Acme) -> tuple[subprocess.CompletedProcess, Path]:
    """A real 3-step CPU run of the built-in recipe with the plugin's estimator and a scale."""
    acme.use("ok")
    result = acme.grpoctl("run", "--run-dir", "run", SELECT, f"grpo.adv_estimator.{NAME}.scale=0.5", *SMALL,
                          timeout=300)
    return result, acme.root / "run"


# --- installed and working ---------------------------------------------------------------------


def test_plugins_list_shows_the_component_and_the_hook_plugin_with_their_distribution(acme):
    acme.use("ok")
    row, hook = acme.listing()
    assert row is not None, "acme_median is not listed after pip install"
    assert (row["status"], row["dist"], row["version"]) == ("ok", DIST, VERSION)
    assert row["entry_point"] == "grpo_acme_estimator.spec:SPEC"
    assert row["impl"] == "grpo_acme_estimator.estimator:AcmeMedianEstimator"
    assert row["config"] == "grpo_acme_estimator.spec:AcmeMedianConfig"
    assert row["api"] == 1 and row["problem"] is None and "median" in row["summary"]
    assert hook is not None, "the acme-observer hook plugin is not listed"
    assert (hook["status"], hook["dist"], hook["version"]) == ("ok", DIST, VERSION)
    assert hook["module"] == "grpo_acme_estimator.observer"
    assert hook["hooks"] == ["grpo_run_end", "grpo_step_end"]

    text = acme.grpoctl("plugins", "list", "--kind", "estimator")
    assert text.returncode == 0, text.stderr
    line = next(ln for ln in text.stdout.splitlines() if f" {NAME} " in ln)
    assert line.split()[:5] == ["estimator", NAME, "ok", DIST, VERSION]


def test_listing_imports_only_the_light_spec_module(acme):
    """Discovery reads the spec; the estimator (and torch) is imported only when a run selects it."""
    acme.use("ok")
    snippet = ("import sys\nfrom grpo_sdk.cli.app import main\nrc = main(['plugins', 'list'])\n"
               "print(sorted(m for m in sys.modules if m.startswith('grpo_acme_estimator') or m == 'torch'))\n")
    result = subprocess.run([str(acme.python), "-c", snippet], cwd=acme.root, env=venv_env(), capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    loaded = result.stdout.strip().splitlines()[-1]
    assert loaded == repr(["grpo_acme_estimator", "grpo_acme_estimator.observer", "grpo_acme_estimator.spec"])


def test_plugins_show_documents_the_option(acme):
    acme.use("ok")
    result = acme.grpoctl("plugins", "show", NAME)
    assert result.returncode == 0, result.stderr
    assert f"dist: {DIST}" in result.stdout and f"version: {VERSION}" in result.stdout
    assert "option: scale (float, default 1.0): Multiply every advantage" in result.stdout

    shown = json.loads(acme.grpoctl("plugins", "show", NAME, "--json").stdout)
    assert [(f["name"], f["type"], f["default"]) for f in shown["config_fields"]] == [("scale", "float", "1.0")]
    assert "must be > 0" in shown["config_fields"][0]["help"]


def test_the_estimator_satisfies_the_protocol_and_uses_the_group_median(acme):
    """The docstring example of the plugin's estimator, run where it is installed."""
    acme.use("ok")
    snippet = (
        "import torch\n"
        "from grpo_sdk.plugins import AdvantageEstimator\n"
        "from grpo_sdk.plugins.registry import Registry\n"
        "registry = Registry.discover()\n"
        f"Impl, Config = registry.load_impl('estimator', {NAME!r}), registry.load_config_class('estimator', {NAME!r})\n"
        "est = Impl(Config(scale=2.0), None)\n"
        "assert isinstance(est, AdvantageEstimator)\n"
        "rewards, groups = torch.tensor([0., 1., 5., 1., 1., 3., 2., 4.]), torch.tensor([0, 0, 0, 1, 1, 1, 2, 2])\n"
        "valid = torch.tensor([True] * 7 + [False])\n"
        "adv = est.compute_advantages(rewards, groups, torch.ones(8, 2), valid_mask=valid)\n"
        "assert adv.shape == (8, 2) and torch.equal(adv[:, 0], adv[:, 1])\n"
        "print(adv[:, 0].tolist())\n")
    result = subprocess.run([str(acme.python), "-c", snippet], cwd=acme.root, env=venv_env(), capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    # medians 1, 1 and (one valid row) 2: the lone valid row and the invalid row get 0
    assert json.loads(result.stdout.strip().splitlines()[-1]) == [-2.0, 0.0, 8.0, 0.0, 0.0, 4.0, 0.0, 0.0]


def test_a_run_selected_by_config_trains_with_the_plugin_and_the_hook_observes_it(acme, trained):
    result, run = trained
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert f"| {NAME} |" in result.stdout

    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(math.isfinite(v) for r in rows for v in r.values() if isinstance(v, float))
    assert all("acme/baseline_mean" in r for r in rows), "the plugin's estimator did not compute the advantages"

    marker = [json.loads(line) for line in (run / "acme_observer.jsonl").read_text().splitlines()]
    assert [m["step"] for m in marker if m["event"] == "step_end"] == [1, 2, 3]
    assert {m["estimator"] for m in marker if m["event"] == "step_end"} == {NAME}
    assert [m["reward/mean"] for m in marker if m["event"] == "step_end"] == [r["reward/mean"] for r in rows]
    assert marker[-1] == {"event": "run_end", "status": "completed"}

    resolved = yaml.safe_load((run / "config.resolved.yaml").read_text())
    assert resolved["grpo"]["adv_estimator"]["name"] == NAME
    assert resolved["grpo"]["adv_estimator"][NAME] == {"scale": 0.5}

    plugins = json.loads((run / "plugins.json").read_text())
    used = next(c for c in plugins["components"] if (c["kind"], c["name"]) == ("estimator", NAME))
    assert (used["status"], used["dist"], used["version"]) == ("ok", DIST, VERSION)
    observer = next(h for h in plugins["hooks"] if h["name"] == "acme-observer")
    assert (observer["dist"], observer["version"]) == (DIST, VERSION)


def test_bad_option_values_are_config_errors_naming_the_key(acme):
    acme.use("ok")
    result = acme.grpoctl("run", "--run-dir", "bad", SELECT, f"grpo.adv_estimator.{NAME}.scale=-1", *SMALL)
    assert result.returncode == 2, result.stderr
    assert f"grpo.adv_estimator.{NAME}.scale" in result.stderr
    assert not (acme.root / "bad" / "metrics.jsonl").exists()

    result = acme.grpoctl("config", "validate", SELECT, f"grpo.adv_estimator.{NAME}.sclae=1")
    assert result.returncode == 2, result.stderr
    assert f"grpo.adv_estimator.{NAME}.sclae" in result.stderr


def test_a_misspelled_name_suggests_the_installed_plugin(acme):
    acme.use("ok")
    result = acme.grpoctl("config", "validate", "grpo.adv_estimator.name=acme_medain")
    assert result.returncode == 3, result.stderr
    assert "no advantage estimator named 'acme_medain' (did you mean 'acme_median'?)" in result.stderr


# --- uninstalled --------------------------------------------------------------------------------


def test_after_pip_uninstall_selecting_it_is_a_plugin_error(acme, trained):
    _, run = trained
    acme.use("ok")
    saved = str(run / "config.resolved.yaml")
    before = acme.grpoctl("config", "validate", "-c", saved)
    assert before.returncode == 0, before.stderr
    assert f"estimator {NAME}" in before.stdout

    acme.uninstall()
    assert acme.listing() == (None, None)
    result = acme.grpoctl("run", "--run-dir", "again", SELECT, *SMALL)
    assert result.returncode == 3, result.stderr
    assert f"no advantage estimator named '{NAME}'; known: " in result.stderr  # nothing close: no did-you-mean
    known = result.stderr.split("known: ", 1)[1].split(" (grpoctl plugins list", 1)[0].split(", ")
    assert "grpo" in known and NAME not in known
    assert not (acme.root / "again").exists()

    # The saved config also carries the plugin's option block: it belongs to the selected (missing)
    # plugin, so the one problem reported is the plugin (exit 3), not also an unknown key.
    result = acme.grpoctl("config", "validate", "-c", saved)
    assert result.returncode == 3, result.stderr
    assert f"no advantage estimator named '{NAME}'" in result.stderr
    assert "unknown key" not in result.stderr


# --- installed but unusable ---------------------------------------------------------------------


def test_a_broken_spec_is_listed_and_selecting_it_says_it_failed_to_load(acme):
    acme.use("broken")
    row, hook = acme.listing()
    assert (row["status"], row["dist"], row["version"]) == ("broken", DIST, VERSION)
    assert row["problem"] == "ModuleNotFoundError: No module named 'acme_engine_sdk'"
    assert row["impl"] is None  # the spec itself could not be read
    assert hook["status"] == "ok"  # the hook module does not import the spec

    text = acme.grpoctl("plugins", "list")
    assert text.returncode == 0
    assert f"estimator {NAME!r} ({DIST}): broken: ModuleNotFoundError" in text.stderr

    result = acme.grpoctl("run", "--run-dir", "broken", SELECT, *SMALL)
    assert result.returncode == 3, result.stderr
    assert (f"advantage estimator '{NAME}' ({DIST} {VERSION}) is installed but failed to load: "
            "ModuleNotFoundError: No module named 'acme_engine_sdk'") in result.stderr

    strict = acme.grpoctl("plugins", "list", strict=True)
    assert strict.returncode == 3
    assert "GRPO_SDK_STRICT_PLUGINS" in strict.stderr and NAME in strict.stderr


def test_a_spec_for_another_plugin_api_is_incompatible(acme):
    acme.use("api2")
    row, _ = acme.listing()
    assert (row["status"], row["api"]) == ("incompatible-api", 2)
    assert row["problem"] == f"{DIST} {VERSION} targets plugin API 2; this grpo-sdk supports 1"

    result = acme.grpoctl("config", "validate", SELECT)
    assert result.returncode == 3, result.stderr
    message = result.stderr
    assert f"advantage estimator '{NAME}' ({DIST} {VERSION}) targets another plugin API" in message
    assert "this grpo-sdk supports 1" in message
    assert "upgrade grpo-sdk, or pin the plugin to a release for this API" in message

    assert acme.grpoctl("plugins", "list", strict=True).returncode == 3


def test_a_missing_requirement_prints_the_pip_command(acme):
    acme.use("missing")
    row, _ = acme.listing()
    assert row["status"] == "missing-requirements"
    assert row["requires"] == ["some-missing-package>=1"]
    assert row["hint"] == "pip install 'some-missing-package>=1'"

    result = acme.grpoctl("run", "--run-dir", "missing", SELECT, *SMALL)
    assert result.returncode == 3, result.stderr
    assert f"advantage estimator '{NAME}' ({DIST} {VERSION}) cannot be used" in result.stderr
    assert "some-missing-package is not installed" in result.stderr
    assert "pip install 'some-missing-package>=1'" in result.stderr

    # not installing an optional requirement is not a load failure: strict mode still lists
    assert acme.grpoctl("plugins", "list", strict=True).returncode == 0
