"""`grpoctl plugins new`: a project for every component kind that installs with pip and passes its own tests.

The end-to-end check renders one project per kind with the real CLI, builds each into a wheel
and installs all six into one fresh virtual environment (``tests/venvs.py``), as a user's
``pip install ./grpo-acme-...`` would. There, ``grpoctl plugins list --json`` lists each with its
distribution and version, and each project's generated tests (grpo-sdk's contract kit, with a
two-step CPU training run) pass. The unit tests below cover naming, the files rendered and the
CLI's refusals.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from grpo_sdk.plugins.specs import KINDS
from grpo_sdk.scaffold import plugin_names, render, sdk_requirement
from venvs import make_venv, pip_install, venv_env


def grpoctl(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "grpo_sdk.cli.app", *args], cwd=cwd, env=venv_env(),
                          capture_output=True, text=True, timeout=120)


# --- names and files -------------------------------------------------------------------------------


@pytest.mark.parametrize("typed, name, dist, package, classes", [
    ("acme", "acme", "grpo-acme", "grpo_acme", "Acme"),
    ("Acme Gen", "acme-gen", "grpo-acme-gen", "grpo_acme_gen", "AcmeGen"),
    ("grpo-acme_gen", "acme_gen", "grpo-acme-gen", "grpo_acme_gen", "AcmeGen"),
    ("2fast", "2fast", "grpo-2fast", "grpo_2fast", "Grpo2fast"),
])
def test_plugin_names_derive_every_name_from_what_was_typed(typed, name, dist, package, classes):
    names = plugin_names(typed)
    assert (names.name, names.dist, names.package, names.classes) == (name, dist, package, classes)


@pytest.mark.parametrize("typed", ["", "  ", "grpo-", "!!!"])
def test_plugin_names_refuse_what_leaves_no_name(typed):
    with pytest.raises(ValueError, match="not a usable plugin name"):
        plugin_names(typed)


@pytest.mark.parametrize("kind", list(KINDS))
def test_render_gives_a_package_with_the_entry_point_and_the_contract_tests(kind):
    names = plugin_names("acme")
    files = render(names, kind)
    project = tomllib.loads(files["pyproject.toml"])
    assert project["project"]["name"] == "grpo-acme"
    assert project["project"]["entry-points"][KINDS[kind]] == {"acme": "grpo_acme.spec:SPEC"}
    assert project["project"]["dependencies"][0] == sdk_requirement()
    assert project["tool"]["pytest"]["ini_options"]["grpo_components"] == [f"{kind}:acme"]
    for path, text in files.items():
        if path.endswith(".py"):
            ast.parse(text, filename=path)  # every template renders to valid Python
    spec = files["src/grpo_acme/spec.py"]
    assert f'kind="{kind}"' in spec and 'impl="grpo_acme.' in spec and "import torch" not in spec
    assert "    api=1," in spec  # stated, so another plugin API reports incompatible-api
    assert 'pytest_plugins = ["grpo_sdk.testing"]' in files["tests/conftest.py"]
    assert "class TestContract(ContractTests)" in files["tests/test_contract.py"]


def test_sdk_requirement_is_this_major_version():
    from packaging.specifiers import SpecifierSet

    import grpo_sdk

    spec = SpecifierSet(sdk_requirement().removeprefix("grpo-sdk"))
    major = int(grpo_sdk.__version__.split(".")[0])
    assert grpo_sdk.__version__ in spec and f"{major + 1}.0" not in spec


# --- the CLI ----------------------------------------------------------------------------------------


def test_plugins_new_writes_the_project_and_says_what_next(tmp_path):
    result = grpoctl("plugins", "new", "Acme", "--kind", "environment", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    project = tmp_path / "grpo-acme"  # the default directory is the distribution's name
    assert (project / "src/grpo_acme/environment.py").is_file()
    assert "pip install -e ." in result.stdout and "grpoctl run env.name=acme" in result.stdout


def test_plugins_new_refuses_to_overwrite_a_directory(tmp_path):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    result = grpoctl("plugins", "new", "acme", "--kind", "estimator", "taken", cwd=tmp_path)
    assert result.returncode == 2
    assert "refusing to overwrite" in result.stderr
    assert sorted(p.name for p in (tmp_path / "taken").iterdir()) == ["notes.txt"]


@pytest.mark.parametrize("args, message", [
    (["acme", "--kind", "sampler"], "unknown kind 'sampler'"),
    (["!!", "--kind", "estimator"], "not a usable plugin name"),
])
def test_plugins_new_rejects_bad_input_with_exit_2(tmp_path, args, message):
    result = grpoctl("plugins", "new", *args, cwd=tmp_path)
    assert result.returncode == 2 and message in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_plugins_new_warns_when_the_name_is_taken_by_an_installed_component(tmp_path):
    result = grpoctl("plugins", "new", "rloo", "--kind", "estimator", cwd=tmp_path)
    assert result.returncode == 0
    assert "already named 'rloo' (grpo-sdk)" in result.stderr


# --- every kind, installed with pip, passing its own tests -----------------------------------------


class Installed:
    """One project per kind rendered by ``grpoctl plugins new``, all installed into one venv."""

    def __init__(self, root: Path):
        self.root = root
        self.python = make_venv(root / "venv")
        self.projects: dict[str, Path] = {}
        for kind in KINDS:
            name = f"acme-{kind.replace('_', '-')}"
            project = root / f"grpo-{name}"
            result = grpoctl("plugins", "new", name, "--kind", kind, str(project), cwd=root)
            assert result.returncode == 0, result.stderr
            # `pip install ./project`, as two steps: this environment's setuptools builds the wheel
            # (no build isolation, so no download), then pip installs it into the fresh venv.
            built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                                    "--no-index", "-w", str(root / "wheels"), str(project)], env=venv_env(),
                                   capture_output=True, text=True, timeout=300)
            assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-3000:]
            self.projects[kind] = project
        wheels = sorted(str(w) for w in (root / "wheels").glob("*.whl"))
        assert len(wheels) == len(KINDS)
        result = pip_install(self.python, "--no-index", *wheels)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]

    def run(self, *args: str, cwd: Path) -> subprocess.CompletedProcess:
        return subprocess.run([str(self.python), *args], cwd=cwd, env=venv_env(), capture_output=True, text=True,
                              timeout=600)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Installed:
    return Installed(tmp_path_factory.mktemp("scaffolded"))


def test_plugins_list_shows_every_scaffolded_plugin_with_its_distribution(installed):
    result = installed.run("-m", "grpo_sdk.cli.app", "plugins", "list", "--json", cwd=installed.root)
    assert result.returncode == 0, result.stderr
    rows = {(r["kind"], r["name"]): r for r in json.loads(result.stdout)["components"]}
    for kind in KINDS:
        name = f"acme-{kind.replace('_', '-')}"
        row = rows.get((kind, name))
        assert row is not None, f"{kind} {name} is not listed after pip install"
        assert (row["status"], row["dist"], row["version"], row["api"]) == ("ok", f"grpo-{name}", "0.1.0", 1)


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_generated_tests_pass_where_the_plugin_is_installed(installed, kind):
    result = installed.run("-m", "pytest", "-q", "-p", "no:cacheprovider", cwd=installed.projects[kind])
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    # The five contract tests ran for this project's component: none skipped, none deselected.
    assert "5 passed" in result.stdout and "skipped" not in result.stdout
