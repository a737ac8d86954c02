"""`grpoctl plugins new`: a project for every component kind that installs with pip and passes its own tests.

The end-to-end check renders one project per kind with the real CLI (and one of the generation
``server`` template), builds each into a wheel and installs them all into one fresh virtual
environment (``tests/helpers/venvs.py``), as a user's ``pip install ./grpo-acme-...`` would. There,
``grpoctl plugins list --json`` lists each with its distribution and version, and each project's
generated tests (grpo-sdk's contract kit, with a two-step CPU training run and the weight-sync
probe) pass. The unit tests below cover naming, the files rendered, the templates in grpo-sdk's
own wheel and the CLI's refusals.
"""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from grpo_sdk.plugins.specs import KINDS
from grpo_sdk.cli.scaffold import load_template, plugin_names, render, sdk_requirement, template_root, templates
from helpers import run_grpoctl
from helpers.venvs import make_venv, pip_install, venv_env


def grpoctl(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return run_grpoctl(*args, cwd=cwd, env=venv_env(), timeout=120)  # the environment the venv tests use


# --- names and files -------------------------------------------------------------------------------


@pytest.mark.parametrize("typed, name, dist, package, classes", [
    ("acme", "acme", "grpo-acme", "grpo_acme", "Acme"),
    ("Acme Gen", "acme-gen", "grpo-acme-gen", "grpo_acme_gen", "AcmeGen"),
    ("grpo-acme_gen", "acme_gen", "grpo-acme-gen", "grpo_acme_gen", "AcmeGen"),
    ("2fast", "2fast", "grpo-2fast", "grpo_2fast", "Grpo2fast"),
    # A run of separators is one: the component, package and class name agree on the words.
    ("acme - gen", "acme-gen", "grpo-acme-gen", "grpo_acme_gen", "AcmeGen"),
    ("acme--gen", "acme-gen", "grpo-acme-gen", "grpo_acme_gen", "AcmeGen"),
    ("acme__gen", "acme_gen", "grpo-acme-gen", "grpo_acme_gen", "AcmeGen"),
    ("Acme Server", "acme-server", "grpo-acme-server", "grpo_acme_server", "AcmeServer"),
])
def test_plugin_names_derive_every_name_from_what_was_typed(typed, name, dist, package, classes):
    names = plugin_names(typed)
    assert (names.name, names.dist, names.package, names.classes) == (name, dist, package, classes)


@pytest.mark.parametrize("typed", ["", "  ", "grpo-", "!!!"])
def test_plugin_names_refuse_what_leaves_no_name(typed):
    with pytest.raises(ValueError, match="not a usable plugin name"):
        plugin_names(typed)


@pytest.mark.parametrize("typed", ["sdk", "grpo-sdk", "grpo_sdk"])
def test_plugin_names_refuse_to_make_grpo_sdk_itself(typed):
    with pytest.raises(ValueError, match="would make the distribution grpo-sdk"):
        plugin_names(typed)


def test_a_hyphenated_name_is_one_component_everywhere_in_the_project():
    files = render(plugin_names("acme-gen"), "generation", template="server")
    project = tomllib.loads(files["pyproject.toml"])
    assert project["project"]["entry-points"]["grpo_sdk.generation"] == {"acme-gen": "grpo_acme_gen.spec:SPEC"}
    assert project["tool"]["pytest"]["ini_options"]["grpo_components"] == [
        "generation:acme-gen", "generation:acme-gen weight_sync.backend=disk"]
    spec = files["src/grpo_acme_gen/spec.py"]
    assert 'name="acme-gen"' in spec and 'impl="grpo_acme_gen.generation:AcmeGenGeneration"' in spec
    assert "`policy.generation.acme-gen` block" in spec
    assert "policy.generation.acme-gen.url=" in files["tests/test_contract.py"]
    assert "backend: acme-gen\n    acme-gen:\n      url:" in files["README.md"]


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


def test_the_server_template_renders_a_client_its_stand_in_server_and_tests_that_start_it():
    assert templates("generation") == ["default", "server"] and templates("estimator") == ["default"]
    files = render(plugin_names("acme"), "generation", template="server")
    assert list(files) == ["pyproject.toml", "README.md", ".gitignore", "src/grpo_acme/__init__.py",
                           "src/grpo_acme/spec.py", "src/grpo_acme/generation.py", "tests/conftest.py",
                           "tests/server.py", "tests/test_contract.py"]
    for path, text in files.items():
        if path.endswith(".py"):
            ast.parse(text, filename=path)
    client = files["src/grpo_acme/generation.py"]
    assert "import urllib.request" in client and "def load_weights(self, path: str, *, version: int)" in client
    assert "transformers" not in client  # the client needs no model: the server has it
    assert 'HTTPServer(("127.0.0.1", 0), Handler)' in files["tests/server.py"]
    assert "capabilities=" not in files["src/grpo_acme/spec.py"]  # its load_weights says what it supports
    with pytest.raises(ValueError, match="no template 'server' for --kind estimator; templates: default"):
        load_template("estimator", "server")


def test_grpo_sdks_own_wheel_carries_every_template(tmp_path):
    """The templates are package data: a wheel built from grpo-sdk's sources (a copy, so the shared
    checkout gets no build/ directory) holds each file `plugins new` reads."""
    source = Path(str(template_root())).parents[2]  # src/grpo_sdk/cli/templates -> src
    copy = tmp_path / "grpo-sdk"
    shutil.copytree(source / "grpo_sdk", copy / "src" / "grpo_sdk", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(source.parent / name, copy / name)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                            "-q", "-w", str(tmp_path / "dist"), str(copy)], env=venv_env(), capture_output=True,
                           text=True, timeout=300)
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-3000:]
    [wheel] = (tmp_path / "dist").glob("grpo_sdk-*.whl")
    in_wheel = set(zipfile.ZipFile(wheel).namelist())
    expected = {f"grpo_sdk/cli/templates/{p.relative_to(source / 'grpo_sdk/cli/templates').as_posix()}"
                for p in (source / "grpo_sdk/cli/templates").rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    assert len(expected) > 20 and expected <= in_wheel, sorted(expected - in_wheel)


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


def test_plugins_new_refuses_a_template_the_kind_does_not_have(tmp_path):
    result = grpoctl("plugins", "new", "acme", "--kind", "estimator", "--template", "server", cwd=tmp_path)
    assert result.returncode == 2
    assert "no template 'server' for --kind estimator; templates: default" in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_plugins_new_warns_when_the_name_is_taken_by_an_installed_component(tmp_path):
    result = grpoctl("plugins", "new", "rloo", "--kind", "estimator", cwd=tmp_path)
    assert result.returncode == 0
    assert "already named 'rloo' (grpo-sdk)" in result.stderr


# --- every kind, installed with pip, passing its own tests -----------------------------------------


# What is scaffolded end to end: one project per kind, plus the generation server template.
# case -> (kind, template, component name)
CASES = {kind: (kind, "default", f"acme-{kind.replace('_', '-')}") for kind in KINDS}
CASES["generation-server"] = ("generation", "server", "acme-server")


class Installed:
    """One project per case rendered by ``grpoctl plugins new``, all installed into one venv."""

    def __init__(self, root: Path):
        self.root = root
        self.python = make_venv(root / "venv")
        self.projects: dict[str, Path] = {}
        for case, (kind, template, name) in CASES.items():
            project = root / f"grpo-{name}"
            result = grpoctl("plugins", "new", name, "--kind", kind, "--template", template, str(project), cwd=root)
            assert result.returncode == 0, result.stderr
            # `pip install ./project`, as two steps: this environment's setuptools builds the wheel
            # (no build isolation, so no download), then pip installs it into the fresh venv.
            built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                                    "--no-index", "-w", str(root / "wheels"), str(project)], env=venv_env(),
                                   capture_output=True, text=True, timeout=300)
            assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-3000:]
            self.projects[case] = project
        wheels = sorted(str(w) for w in (root / "wheels").glob("*.whl"))
        assert len(wheels) == len(CASES)
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
    for kind, _, name in CASES.values():
        row = rows.get((kind, name))
        assert row is not None, f"{kind} {name} is not listed after pip install"
        assert (row["status"], row["dist"], row["version"], row["api"]) == ("ok", f"grpo-{name}", "0.1.0", 1)


@pytest.mark.parametrize("case", list(CASES))
def test_the_generated_tests_pass_where_the_plugin_is_installed(installed, case):
    result = installed.run("-m", "pytest", "-q", "-p", "no:cacheprovider", cwd=installed.projects[case])
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    # The five contract tests ran for each grpo_components entry: none skipped, none deselected.
    # The server template has two (the weights uploaded, and read from a file).
    assert f"{10 if case == 'generation-server' else 5} passed" in result.stdout and "skipped" not in result.stdout
