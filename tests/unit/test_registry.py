"""The component registry: every plugin status, the errors of ``Registry.get``, and the CLI around them.

Plugins are fake distributions written as real dist-info folders (see ``FakeSite`` in tests/helpers),
found by the real ``importlib.metadata``. Statuses: ok, missing-requirements, broken,
incompatible-api, conflict. ``Registry.get`` turns each bad status (and an unknown name) into a
``PluginError`` that says what is wrong; the CLI lists broken plugins instead of crashing, exits 3
when one is selected, and fails on them under ``GRPO_SDK_STRICT_PLUGINS=1``.
"""

from __future__ import annotations

import importlib.metadata as md
import json

import pytest

from grpo_sdk.core.errors import PluginError
from grpo_sdk.plugins.registry import Registry
from grpo_sdk.plugins.specs import KINDS

MISSING = "some-package-that-does-not-exist"


def spec_source(**fields) -> str:
    """A light spec module: ``SPEC = ComponentSpec(**fields)``."""
    return f"from grpo_sdk.plugins import ComponentSpec\n\nSPEC = ComponentSpec(**{fields!r})\n"


def add_backend(site, dist: str, name: str, *, version: str = "0.1", spec: str | None = None,
                impl: str = "class Engine:\n    pass\n", **fields) -> str:
    """Install ``dist`` declaring generation backend ``name``; returns its package name.

    The spec module is ``spec`` verbatim if given, else a ComponentSpec built from ``fields``.
    """
    pkg = dist.replace("-", "_")
    fields = {"name": name, "kind": "generation", "impl": f"{pkg}.engine:Engine", **fields}
    site.add(dist, version=version, entry_points={"grpo_sdk.generation": {name: f"{pkg}.spec:SPEC"}},
             files={f"{pkg}/__init__.py": "", f"{pkg}/spec.py": spec if spec is not None else spec_source(**fields),
                    f"{pkg}/engine.py": impl})
    return pkg


def discover(name: str, kind: str = "generation"):
    registry = Registry.discover()
    info = registry.info(kind, name)
    assert info is not None, f"{kind} {name!r} not discovered; found {registry.names(kind)}"
    return registry, info


def get_error(registry: Registry, name: str, kind: str = "generation") -> str:
    with pytest.raises(PluginError) as excinfo:
        registry.get(kind, name)
    return str(excinfo.value)


# --- the built-in components ------------------------------------------------------------------


def test_builtin_components_come_from_the_grpo_sdk_distribution():
    declared = {(kind, ep.name) for ep in md.distribution("grpo-sdk").entry_points
                for kind, group in KINDS.items() if ep.group == group}
    assert declared >= {("generation", "hf"), ("policy", "hf"), ("estimator", "grpo"),
                        ("environment", "reverse_digits"), ("weight_sync", "inprocess"), ("logger", "jsonl")}
    registry = Registry.discover()
    builtin = {(i.kind, i.name): i for i in registry.list() if i.dist == "grpo-sdk"}
    assert set(builtin) == declared
    assert all(i.version == md.version("grpo-sdk") for i in builtin.values())
    assert builtin[("generation", "hf")].status == builtin[("estimator", "grpo")].status == "ok"
    assert registry.problems() == []


# --- ok ---------------------------------------------------------------------------------------


def test_third_party_backend_is_ok_with_its_dist_and_version(fake_site):
    pkg = add_backend(fake_site, "acme-gen", "acme", version="1.2.3", summary="ACME engine.")
    registry, info = discover("acme")
    assert (info.status, info.dist, info.version) == ("ok", "acme-gen", "1.2.3")
    assert info.entry_point == f"{pkg}.spec:SPEC" and info.problem is None
    assert registry.get("generation", "acme").summary == "ACME engine."
    assert registry.load_impl("generation", "acme").__module__ == f"{pkg}.engine"
    assert registry.info("generation", "hf").status == "ok"  # the built-in one is still there


def test_listing_does_not_import_the_implementation(fake_site):
    pkg = add_backend(fake_site, "acme-lazy", "lazy", impl="raise RuntimeError('heavy import')\n")
    registry, info = discover("lazy")
    assert info.status == "ok"
    assert registry.get("generation", "lazy").impl == f"{pkg}.engine:Engine"


# --- missing-requirements ---------------------------------------------------------------------


def test_missing_requirement_gives_the_pip_install_hint_of_the_extra(fake_site):
    add_backend(fake_site, "acme-vllm", "fastgen", requires=(f"{MISSING}>=1",), extra="vllm")
    registry, info = discover("fastgen")
    assert info.status == "missing-requirements"
    assert info.problem == f"{MISSING} is not installed (needs {MISSING}>=1)"
    assert info.hint == "pip install 'grpo-sdk[vllm]'"
    assert info not in registry.problems()  # an uninstalled extra is not a plugin failure
    message = get_error(registry, "fastgen")
    assert "generation backend 'fastgen' (acme-vllm 0.1) cannot be used" in message
    assert message.endswith(f"{info.problem}: pip install 'grpo-sdk[vllm]'")


def test_too_old_requirement_names_the_installed_version(fake_site):
    add_backend(fake_site, "acme-old", "oldgen", requires=("pluggy>=999",))
    registry, info = discover("oldgen")
    assert info.status == "missing-requirements"
    assert info.problem == f"pluggy {md.version('pluggy')} is installed, needs pluggy>=999"
    assert info.hint == "pip install 'pluggy>=999'"  # no extra: the requirement itself
    assert info.problem in get_error(registry, "oldgen")


def test_requirement_whose_marker_does_not_apply_is_skipped(fake_site):
    add_backend(fake_site, "acme-marker", "markergen", requires=(f'{MISSING}; python_version < "3"', "pluggy>=1"))
    _, info = discover("markergen")
    assert info.status == "ok"


# --- broken -----------------------------------------------------------------------------------


BROKEN_SPECS = {
    "import-error": ("raise ImportError('acme needs libacme.so.3')\n", "ImportError: acme needs libacme.so.3"),
    "syntax-error": ("SPEC = (\n", "SyntaxError"),
    "invalid-spec": (spec_source(name="Not A Name", kind="generation", impl="x:Y"), "ValueError: component name"),
    "not-a-spec": ("SPEC = {'name': 'acme'}\n", "is a dict, not a ComponentSpec"),
    "other-name": (spec_source(name="other", kind="generation", impl="x:Y"),
                   "entry point 'acme' in group grpo_sdk.generation names a spec for generation 'other'"),
    "other-kind": (spec_source(name="acme", kind="policy", impl="x:Y"),
                   "entry point 'acme' in group grpo_sdk.generation names a spec for policy 'acme'"),
}


@pytest.mark.parametrize("case", BROKEN_SPECS)
def test_a_spec_that_cannot_be_used_is_broken_with_the_reason(fake_site, case):
    source, expected = BROKEN_SPECS[case]
    pkg = add_backend(fake_site, f"acme-{case}", "acme", spec=source)
    registry, info = discover("acme")
    assert (info.status, info.dist, info.entry_point) == ("broken", f"acme-{case}", f"{pkg}.spec:SPEC")
    assert expected in info.problem
    assert info in registry.problems()
    message = get_error(registry, "acme")
    assert message.startswith(f"generation backend 'acme' (acme-{case} 0.1) is installed but failed to load: ")
    assert expected in message


def test_an_entry_point_naming_a_missing_module_is_broken(fake_site):
    fake_site.add("acme-ghost", entry_points={"grpo_sdk.generation": {"ghost": "acme_ghost_gone.spec:SPEC"}},
                  files={})
    _, info = discover("ghost")
    assert info.status == "broken"
    assert info.problem == "ModuleNotFoundError: No module named 'acme_ghost_gone'"


def test_one_broken_plugin_does_not_hide_the_others(fake_site):
    add_backend(fake_site, "acme-bad", "bad", spec="raise ImportError('nope')\n")
    add_backend(fake_site, "acme-good", "good")
    registry = Registry.discover()
    assert registry.info("generation", "bad").status == "broken"
    assert registry.info("generation", "good").status == "ok"
    assert registry.get("generation", "hf").name == "hf"


# --- incompatible-api -------------------------------------------------------------------------


def test_spec_for_another_plugin_api_is_incompatible(fake_site):
    add_backend(fake_site, "acme-future", "future", version="3.0", api=2)
    registry, info = discover("future")
    assert info.status == "incompatible-api"
    assert info.problem == "acme-future 3.0 targets plugin API 2; this grpo-sdk supports 1"
    assert info in registry.problems()
    message = get_error(registry, "future")
    assert "generation backend 'future' (acme-future 3.0) targets another plugin API" in message
    assert "this grpo-sdk supports 1" in message


# --- conflict ---------------------------------------------------------------------------------


def test_two_distributions_claiming_one_name_conflict(fake_site):
    add_backend(fake_site, "acme-one", "twin")
    add_backend(fake_site, "acme-two", "twin")
    registry, info = discover("twin")
    assert info.status == "conflict"
    assert info.problem == "generation backend 'twin' is claimed by acme-one and acme-two"
    assert info in registry.problems()
    message = get_error(registry, "twin")
    assert message.startswith("generation backend 'twin' is ambiguous: ")
    assert "acme-one and acme-two" in message and "uninstall one of them" in message


def test_a_plugin_claiming_a_builtin_name_conflicts_with_grpo_sdk(fake_site):
    add_backend(fake_site, "acme-hf", "hf")
    registry, info = discover("hf")
    assert info.status == "conflict"
    assert info.problem == "generation backend 'hf' is claimed by acme-hf and grpo-sdk"
    assert "acme-hf and grpo-sdk" in get_error(registry, "hf")
    assert registry.info("policy", "hf").status == "ok"  # the same name in another kind is fine


# --- unknown names and failing imports --------------------------------------------------------


def test_unknown_name_suggests_the_closest_installed_one():
    registry = Registry.discover()
    assert get_error(registry, "hff") == ("no generation backend named 'hff' (did you mean 'hf'?); known: dynamo, hf, "
                                          "megatron, sglang, trtllm, vllm "
                                          "(grpoctl plugins list shows which are usable)")
    assert get_error(registry, "zzz", kind="estimator") == ("no advantage estimator named 'zzz'; known: gdpo, grpo, opd, "
                                                            "reinforce_plus_plus, rloo (grpoctl plugins list shows which "
                                                            "are usable)")


def test_load_impl_names_an_implementation_that_fails_to_import(fake_site):
    pkg = add_backend(fake_site, "acme-heavy", "heavy", impl="raise ImportError('libcuda.so.1 not found')\n")
    registry, info = discover("heavy")
    assert info.status == "ok"  # the spec is fine; only the heavy module is not
    with pytest.raises(PluginError) as excinfo:
        registry.load_impl("generation", "heavy")
    assert str(excinfo.value) == (f"generation backend 'heavy' failed to import its implementation "
                                  f"{pkg}.engine:Engine: ImportError: libcuda.so.1 not found")


def test_load_impl_names_a_missing_attribute(fake_site):
    add_backend(fake_site, "acme-typo", "typo", impl="class Engin:\n    pass\n")
    registry, _ = discover("typo")
    with pytest.raises(PluginError, match="failed to import its implementation acme_typo.engine:Engine: "
                                          "AttributeError"):
        registry.load_impl("generation", "typo")


def test_load_impl_of_a_bad_component_raises_the_get_error(fake_site):
    add_backend(fake_site, "acme-old2", "old2", requires=("pluggy>=999",))
    registry, _ = discover("old2")
    with pytest.raises(PluginError, match="cannot be used: pluggy .* is installed, needs pluggy>=999"):
        registry.load_impl("generation", "old2")


# --- strict mode, in process ------------------------------------------------------------------


def test_strict_mode_turns_a_broken_plugin_into_an_error(fake_site, monkeypatch):
    add_backend(fake_site, "acme-strict", "strict", spec="raise ImportError('nope')\n")
    monkeypatch.setenv("GRPO_SDK_STRICT_PLUGINS", "1")
    with pytest.raises(PluginError, match=r"generation backend 'strict': ImportError: nope "
                                          r"\(GRPO_SDK_STRICT_PLUGINS is set\)"):
        Registry.discover()


def test_strict_mode_turns_a_conflict_into_an_error(fake_site, monkeypatch):
    add_backend(fake_site, "acme-hf2", "hf")
    monkeypatch.setenv("GRPO_SDK_STRICT_PLUGINS", "1")
    with pytest.raises(PluginError, match="claimed by acme-hf2 and grpo-sdk"):
        Registry.discover()


def test_strict_mode_tolerates_an_uninstalled_extra(fake_site, monkeypatch):
    add_backend(fake_site, "acme-extra", "extra", requires=(f"{MISSING}>=1",), extra="vllm")
    monkeypatch.setenv("GRPO_SDK_STRICT_PLUGINS", "1")
    assert Registry.discover().info("generation", "extra").status == "missing-requirements"


# --- the CLI with broken plugins installed (subprocesses) -------------------------------------


@pytest.fixture(scope="module")
def cli_site(make_site):
    """One site for the CLI tests: a broken, a missing-requirements and an ok backend."""
    site = make_site()
    add_backend(site, "acme-broken", "acme-broken", spec="raise ImportError('acme needs libacme.so.3')\n")
    add_backend(site, "acme-vllm", "acme-vllm", requires=(f"{MISSING}>=1",), extra="vllm")
    add_backend(site, "acme-ok", "acme-ok", version="2.0", summary="A fine backend.")
    return site


def test_help_works_with_a_broken_plugin_installed(cli_site):
    result = cli_site.grpoctl("--help")
    assert result.returncode == 0, result.stderr
    assert "plugins" in result.stdout and "Traceback" not in result.stderr


def test_plugins_list_shows_the_broken_row(cli_site):
    result = cli_site.grpoctl("plugins", "list")
    assert result.returncode == 0, result.stderr
    rows = {line.split()[1]: line for line in result.stdout.splitlines()}
    assert rows["acme-broken"].split()[:3] == ["generation", "acme-broken", "broken"]
    assert "ImportError: acme needs libacme.so.3" in rows["acme-broken"]
    assert "missing-requirements" in rows["acme-vllm"] and "pip install 'grpo-sdk[vllm]'" in rows["acme-vllm"]
    assert rows["acme-ok"].split()[2:5] == ["ok", "acme-ok", "2.0"]
    assert "warning: generation 'acme-broken' (acme-broken): broken" in result.stderr


def test_plugins_list_json_has_status_dist_version_and_problem(cli_site):
    result = cli_site.grpoctl("plugins", "list", "--json")
    assert result.returncode == 0, result.stderr
    rows = {(c["kind"], c["name"]): c for c in json.loads(result.stdout)["components"]}
    broken = rows[("generation", "acme-broken")]
    assert (broken["status"], broken["dist"], broken["version"]) == ("broken", "acme-broken", "0.1")
    assert broken["problem"] == "ImportError: acme needs libacme.so.3"
    missing = rows[("generation", "acme-vllm")]
    assert (missing["status"], missing["hint"], missing["extra"]) == (
        "missing-requirements", "pip install 'grpo-sdk[vllm]'", "vllm")
    ok = rows[("generation", "acme-ok")]
    assert (ok["status"], ok["version"], ok["problem"], ok["summary"]) == ("ok", "2.0", None, "A fine backend.")
    assert rows[("generation", "hf")]["status"] == "ok"


def test_selecting_a_broken_backend_exits_3_saying_why(cli_site):
    result = cli_site.grpoctl("config", "validate", "policy.generation.backend=acme-broken")
    assert result.returncode == 3
    assert "generation backend 'acme-broken' (acme-broken 0.1) is installed but failed to load" in result.stderr
    assert "ImportError: acme needs libacme.so.3" in result.stderr
    assert "Traceback" not in result.stderr


def test_selecting_a_backend_with_missing_requirements_exits_3_with_the_pip_hint(cli_site):
    result = cli_site.grpoctl("config", "validate", "policy.generation.backend=acme-vllm")
    assert result.returncode == 3
    assert f"{MISSING} is not installed" in result.stderr
    assert "pip install 'grpo-sdk[vllm]'" in result.stderr


def test_selecting_an_unknown_backend_exits_3_with_did_you_mean(cli_site):
    result = cli_site.grpoctl("config", "validate", "policy.generation.backend=hff")
    assert result.returncode == 3
    assert "no generation backend named 'hff' (did you mean 'hf'?)" in result.stderr


def test_selecting_the_ok_third_party_backend_validates(cli_site):
    result = cli_site.grpoctl("config", "validate", "policy.generation.backend=acme-ok")
    assert result.returncode == 0, result.stderr
    assert "generation acme-ok" in result.stdout


def test_strict_mode_makes_plugins_list_fail_on_the_broken_plugin(cli_site):
    result = cli_site.grpoctl("plugins", "list", strict=True)
    assert result.returncode == 3
    assert "generation backend 'acme-broken': ImportError: acme needs libacme.so.3" in result.stderr
    assert "GRPO_SDK_STRICT_PLUGINS" in result.stderr
