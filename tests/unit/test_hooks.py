"""Hook plugins: modules in the ``grpo_sdk.hooks`` entry-point group, driven through ``PluginHost``.

Covers loading (ok, broken on import, unknown hook names), how they are listed by
``grpoctl plugins list``, observer isolation in ``PluginHost.notify`` (and strict mode), and each
extension hook: ``grpo_components`` (in-process components), ``grpo_cli_commands`` (extra
``grpoctl`` subcommands) and ``grpo_config_sections`` (extra top-level config sections). Plugins
are fake distributions on ``sys.path`` (``FakeSite`` in tests/helpers).
"""

from __future__ import annotations

import json
import re
import sys

import pytest

from grpo_sdk.config.loading import load_config
from grpo_sdk.core.errors import ConfigError, PluginError
from grpo_sdk.plugins import ComponentSpec, hookimpl
from grpo_sdk.plugins.host import PluginHost
from grpo_sdk.plugins.registry import Registry

HEADER = "from grpo_sdk.plugins import ComponentSpec, ConfigSection, hookimpl\n\n"

OBSERVER = HEADER + """CALLS = []

@hookimpl
def grpo_step_end(step, metrics):  # opts out of `run`
    CALLS.append((step, metrics["reward/mean"]))
"""
CRASHES_ON_IMPORT = "raise RuntimeError('acme observer needs ACME_TOKEN')\n"
UNKNOWN_HOOK = HEADER + "@hookimpl\ndef grpo_not_a_hook():\n    pass\n"
CLI_COMMAND = HEADER + """@hookimpl
def grpo_cli_commands(app):
    @app.command("acme-hello")
    def hello(name: str = "world"):
        \"\"\"Say hello from a plugin.\"\"\"
        print(f"hello {name} from acme")
"""
CLI_COMMAND_RAISES = HEADER + "@hookimpl\ndef grpo_cli_commands(app):\n    raise RuntimeError('no commands today')\n"
CONFIG_SECTION = HEADER + """@hookimpl
def grpo_config_sections():
    return [ConfigSection(name="acme_uploader", config="acme_up.config:UploaderConfig")]
"""
UPLOADER_CONFIG = """import attrs

@attrs.frozen(kw_only=True)
class UploaderConfig:
    bucket: str = "s3://default"
    every: int = 10
"""
COMPONENTS = HEADER + """@hookimpl
def grpo_components():
    return [ComponentSpec(name="acme-env", kind="environment", impl="acme_components.env:Env")]
"""
COMPONENTS_RAISE = HEADER + "@hookimpl\ndef grpo_components():\n    raise RuntimeError('registry offline')\n"
SECTIONS_RAISE = HEADER + "@hookimpl\ndef grpo_config_sections():\n    raise KeyError('no such section')\n"
COMPONENTS_WRONG_TYPE = HEADER + "@hookimpl\ndef grpo_components():\n    return ['acme-env']\n"


def add_hooks(site, dist: str, modules: dict[str, str], *, files: dict[str, str] | None = None) -> dict[str, str]:
    """Install ``dist`` with one hook module per entry (entry-point name -> source); returns name -> module."""
    pkg = dist.replace("-", "_")
    targets = {name: f"{pkg}.{name.replace('-', '_')}" for name in modules}
    site.add(dist, entry_points={"grpo_sdk.hooks": targets},
             files={f"{pkg}/__init__.py": "", **(files or {}),
                    **{f"{pkg}/{name.replace('-', '_')}.py": source for name, source in modules.items()}})
    return targets


def loaded_host() -> PluginHost:
    host = PluginHost()
    host.load_entry_points()
    return host


def plugin(host: PluginHost, name: str):
    (info,) = [p for p in host.plugins if p.name == name]
    return info


class Recorder:
    """An in-process observer."""

    def __init__(self):
        self.steps = []

    @hookimpl
    def grpo_step_end(self, step):
        self.steps.append(step)


class Raiser:
    @hookimpl
    def grpo_step_end(self, step):
        raise RuntimeError(f"upload failed at step {step}")


# --- loading hook modules ---------------------------------------------------------------------


def test_hook_module_of_a_distribution_is_loaded_listed_and_called(fake_site):
    targets = add_hooks(fake_site, "acme-obs", {"observer": OBSERVER})
    host = loaded_host()
    info = plugin(host, "observer")
    assert (info.status, info.dist, info.version, info.module) == ("ok", "acme-obs", "0.1", targets["observer"])
    assert info.hooks == ("grpo_step_end",)
    host.step_end(run=object(), step=3, metrics={"reward/mean": 0.5})
    assert sys.modules[targets["observer"]].CALLS == [(3, 0.5)]


def test_hook_module_that_raises_on_import_is_broken(fake_site):
    add_hooks(fake_site, "acme-crash", {"crash": CRASHES_ON_IMPORT, "observer": OBSERVER})
    host = loaded_host()
    crash = plugin(host, "crash")
    assert (crash.status, crash.problem) == ("broken", "RuntimeError: acme observer needs ACME_TOKEN")
    assert crash.dist == "acme-crash" and crash.hooks == ()
    assert plugin(host, "observer").status == "ok"


def test_unknown_hook_name_is_rejected_and_does_not_poison_later_plugins(fake_site):
    targets = add_hooks(fake_site, "acme-typo", {"a-typo": UNKNOWN_HOOK, "b-observer": OBSERVER})
    host = loaded_host()
    typo = plugin(host, "a-typo")
    assert typo.status == "broken"
    assert typo.problem.startswith("PluginValidationError: unknown hook 'grpo_not_a_hook'")
    assert plugin(host, "b-observer").status == "ok"  # loaded after the rejected one
    host.pm.check_pending()  # the rejected module was unregistered
    host.step_end(run=None, step=1, metrics={"reward/mean": 1.0})
    assert sys.modules[targets["b-observer"]].CALLS == [(1, 1.0)]


def test_strict_mode_turns_a_broken_hook_module_into_an_error(fake_site, monkeypatch):
    add_hooks(fake_site, "acme-crash2", {"crash": CRASHES_ON_IMPORT})
    monkeypatch.setenv("GRPO_SDK_STRICT_PLUGINS", "1")
    with pytest.raises(PluginError, match="hook plugin 'crash' failed to load: RuntimeError: acme observer"):
        loaded_host()


def test_loading_an_installed_hook_module_again_keeps_it_working(fake_site):
    # `grpoctl run -p acme_obs2.observer` with acme-obs2 installed loads the module a second time.
    targets = add_hooks(fake_site, "acme-obs2", {"observer": OBSERVER})
    host = loaded_host()
    host.load_module(targets["observer"])
    host.step_end(run=None, step=7, metrics={"reward/mean": 0.25})
    assert sys.modules[targets["observer"]].CALLS == [(7, 0.25)]


# --- observers: PluginHost.notify -------------------------------------------------------------


def test_a_raising_observer_is_reported_and_the_others_still_run(monkeypatch, capsys):
    monkeypatch.delenv("GRPO_SDK_STRICT_PLUGINS", raising=False)
    host, recorder = PluginHost(), Recorder()
    host.register(Raiser(), name="uploader")
    host.register(recorder, name="recorder")
    host.step_end(run=None, step=4, metrics={})
    assert recorder.steps == [4]
    assert ("grpo-sdk: hook grpo_step_end of plugin 'uploader' raised RuntimeError: upload failed at step 4"
            in capsys.readouterr().err)


def test_strict_mode_lets_a_raising_observer_raise(monkeypatch):
    monkeypatch.setenv("GRPO_SDK_STRICT_PLUGINS", "1")
    host = PluginHost()
    host.register(Raiser(), name="uploader")
    with pytest.raises(RuntimeError, match="upload failed at step 4"):
        host.step_end(run=None, step=4, metrics={})


def test_registering_an_object_with_an_unknown_hook_raises():
    class Typo:
        @hookimpl
        def grpo_not_a_hook(self):
            pass

    with pytest.raises(Exception, match="unknown hook 'grpo_not_a_hook'"):
        PluginHost().register(Typo(), name="typo")


def test_a_rejected_in_process_plugin_does_not_poison_the_host():
    class Typo:
        @hookimpl
        def grpo_not_a_hook(self):
            pass

    host, recorder = PluginHost(), Recorder()
    with pytest.raises(Exception, match="unknown hook"):
        host.register(Typo(), name="typo")
    host.register(recorder, name="recorder")
    host.step_end(run=None, step=2, metrics={})
    assert recorder.steps == [2]


# --- grpo_components: in-process components ----------------------------------------------------


def components_plugin(*specs: ComponentSpec):
    class Notebook:
        @hookimpl
        def grpo_components(self):
            return list(specs)

    return Notebook()


def test_grpo_components_adds_an_in_process_component(monkeypatch):
    monkeypatch.delenv("GRPO_SDK_STRICT_PLUGINS", raising=False)
    spec = ComponentSpec(name="notebook-env", kind="environment", impl="my_notebook:Env", summary="From a notebook.")
    host = PluginHost()
    host.register(components_plugin(spec), name="notebook")
    registry = Registry.discover(host=host)
    info = registry.info("environment", "notebook-env")
    assert (info.status, info.dist) == ("ok", "hook:notebook")
    assert registry.get("environment", "notebook-env") is spec
    assert "notebook-env" in registry.names("environment")


def test_grpo_components_claiming_a_builtin_name_conflicts(monkeypatch):
    monkeypatch.delenv("GRPO_SDK_STRICT_PLUGINS", raising=False)
    host = PluginHost()
    host.register(components_plugin(ComponentSpec(name="hf", kind="generation", impl="mine:Gen")), name="notebook")
    registry = Registry.discover(host=host)
    info = registry.info("generation", "hf")
    assert info.status == "conflict"
    assert info.problem == "generation backend 'hf' is claimed by grpo-sdk and hook:notebook"


def test_grpo_components_checks_requirements_like_entry_points(monkeypatch):
    monkeypatch.delenv("GRPO_SDK_STRICT_PLUGINS", raising=False)
    host = PluginHost()
    host.register(components_plugin(ComponentSpec(name="nb-missing", kind="logger", impl="mine:Logger",
                                                  requires=("some-package-that-does-not-exist",), extra="wandb")),
                  name="notebook")
    info = Registry.discover(host=host).info("logger", "nb-missing")
    assert (info.status, info.hint) == ("missing-requirements", "pip install 'grpo-sdk[wandb]'")


def test_in_process_component_for_another_api_names_its_plugin_cleanly(monkeypatch):
    monkeypatch.delenv("GRPO_SDK_STRICT_PLUGINS", raising=False)
    host = PluginHost()
    host.register(components_plugin(ComponentSpec(name="nb-future", kind="logger", impl="mine:Logger", api=2)),
                  name="notebook")
    info = Registry.discover(host=host).info("logger", "nb-future")
    assert info.status == "incompatible-api"
    assert info.problem == "hook:notebook targets plugin API 2; this grpo-sdk supports 1"


def test_component_of_an_unnamed_in_process_plugin_names_the_listed_plugin(monkeypatch):
    monkeypatch.delenv("GRPO_SDK_STRICT_PLUGINS", raising=False)
    host = PluginHost()
    host.register(components_plugin(ComponentSpec(name="nb-anon", kind="logger", impl="mine:Logger")))
    registry = Registry.discover(host=host)
    (listed,) = registry.hook_plugins
    assert registry.info("logger", "nb-anon").dist == f"hook:{listed.name}"


# --- grpo_config_sections, in process ---------------------------------------------------------


def test_a_config_section_is_structured_into_its_class(fake_site):
    add_hooks(fake_site, "acme-up", {"uploader": CONFIG_SECTION},
              files={"acme_up/config.py": UPLOADER_CONFIG})
    registry = Registry.discover(host=loaded_host())
    cfg = load_config(None, ["acme_uploader.bucket=s3://runs", "acme_uploader.every=5"], registry)
    section = cfg.extra_sections["acme_uploader"]
    assert (type(section).__name__, section.bucket, section.every) == ("UploaderConfig", "s3://runs", 5)


def test_without_the_plugin_the_section_is_an_unknown_key(monkeypatch):
    monkeypatch.delenv("GRPO_SDK_STRICT_PLUGINS", raising=False)
    with pytest.raises(ConfigError, match="acme_uploader: unknown key 'acme_uploader'"):
        load_config(None, ["acme_uploader.bucket=s3://runs"], Registry.discover(host=PluginHost()))


# --- the CLI with hook plugins installed (subprocesses) ---------------------------------------


@pytest.fixture(scope="module")
def hook_site(make_site):
    """One site with an observer, broken hook modules, a CLI command, a config section and a component."""
    site = make_site()
    add_hooks(site, "acme-obs", {"acme-observer": OBSERVER}, files={})
    add_hooks(site, "acme-crash", {"acme-crash": CRASHES_ON_IMPORT})
    add_hooks(site, "acme-typo", {"acme-typo": UNKNOWN_HOOK})
    add_hooks(site, "acme-cli", {"acme-cli": CLI_COMMAND, "acme-badcli": CLI_COMMAND_RAISES})
    add_hooks(site, "acme-up", {"uploader": CONFIG_SECTION}, files={"acme_up/config.py": UPLOADER_CONFIG})
    add_hooks(site, "acme-components", {"acme-components": COMPONENTS})
    return site


def test_help_works_with_broken_hook_plugins(hook_site):
    result = hook_site.grpoctl("--help")
    assert result.returncode == 0, result.stderr
    assert "grpo-sdk: warning: hook plugin 'acme-crash' failed to load: RuntimeError: acme observer needs " \
           "ACME_TOKEN" in result.stderr
    assert "hook plugin 'acme-typo' failed to load: PluginValidationError: unknown hook 'grpo_not_a_hook'" \
           in result.stderr
    assert "Traceback" not in result.stderr


def test_plugins_list_json_lists_hook_plugins_with_their_status(hook_site):
    result = hook_site.grpoctl("plugins", "list", "--json")
    assert result.returncode == 0, result.stderr
    listing = json.loads(result.stdout)
    hooks = {h["name"]: h for h in listing["hooks"]}
    observer = hooks["acme-observer"]
    assert (observer["status"], observer["dist"], observer["version"]) == ("ok", "acme-obs", "0.1")
    assert observer["hooks"] == ["grpo_step_end"] and observer["problem"] is None
    assert hooks["acme-cli"]["hooks"] == ["grpo_cli_commands"]
    assert hooks["uploader"]["hooks"] == ["grpo_config_sections"]
    assert hooks["acme-crash"]["status"] == "broken"
    assert hooks["acme-crash"]["problem"] == "RuntimeError: acme observer needs ACME_TOKEN"
    assert hooks["acme-typo"]["status"] == "broken"
    components = {(c["kind"], c["name"]): c for c in listing["components"]}
    component = components[("environment", "acme-env")]
    assert (component["status"], component["dist"]) == ("ok", "hook:acme-components")


def test_plugins_list_text_shows_the_hook_rows(hook_site):
    result = hook_site.grpoctl("plugins", "list")
    assert result.returncode == 0, result.stderr
    rows = {line.split()[1]: line.split(None, 3) for line in result.stdout.splitlines() if line.startswith("hooks")}
    assert rows["acme-observer"][2] == "ok" and rows["acme-observer"][3].endswith("grpo_step_end")
    assert rows["acme-crash"][2] == "broken"


def test_strict_mode_makes_the_cli_fail_on_a_broken_hook_plugin(hook_site):
    result = hook_site.grpoctl("plugins", "list", strict=True)
    assert result.returncode == 3
    # The first broken module found stops the CLI (entry-point order follows the directory listing).
    assert re.match(r"error: hook plugin '(acme-crash|acme-typo)' failed to load: (RuntimeError|PluginValidationError)",
                    result.stderr), result.stderr


def test_grpo_cli_commands_adds_a_working_subcommand(hook_site):
    result = hook_site.grpoctl("acme-hello", "--name", "tests")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "hello tests from acme\n"
    # The plugin whose hook raised is reported; it does not stop the others.
    assert "hook grpo_cli_commands of plugin 'acme-badcli' raised RuntimeError: no commands today" in result.stderr


def test_the_plugin_subcommand_is_in_help(hook_site):
    result = hook_site.grpoctl("--help")
    assert "acme-hello" in result.stdout and "Say hello from a plugin." in result.stdout
    # in typer's order: the built-in commands, the plugin's, then the groups (built-ins load lazily)
    listed = [line.split()[0] for line in result.stdout.split("Commands:\n")[1].split("\n\n")[0].splitlines()]
    assert listed == ["run", "doctor", "report", "export", "serve", "acme-hello", "config", "plugins"], listed


def test_grpo_config_sections_adds_a_section_config_validate_accepts(hook_site):
    result = hook_site.grpoctl("config", "validate", "acme_uploader.bucket=s3://runs", "acme_uploader.every=5")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("config OK")


@pytest.mark.parametrize("override, problem", [
    ("acme_uploader.buckit=s3://runs", "acme_uploader.buckit: unknown key 'buckit' (did you mean 'bucket'?)"),
    ("acme_uploader.every=often", "acme_uploader.every: expected an integer, got 'often'"),
])
def test_config_validate_rejects_a_bad_key_in_a_plugin_section(hook_site, override, problem):
    result = hook_site.grpoctl("config", "validate", override)
    assert result.returncode == 2
    assert problem in result.stderr


# --- every hook implementation is guarded, and called in pluggy's order -------------------------


@pytest.fixture(scope="module")
def broken_hooks_site(make_site):
    """A working component plugin beside hook plugins whose registration hooks raise or return junk."""
    site = make_site()
    add_hooks(site, "acme-components", {"acme-components": COMPONENTS})
    add_hooks(site, "acme-raise", {"acme-raise": COMPONENTS_RAISE, "acme-sections": SECTIONS_RAISE})
    add_hooks(site, "acme-junk", {"acme-junk": COMPONENTS_WRONG_TYPE})
    return site


@pytest.mark.parametrize("argv", [["plugins", "list"], ["config", "validate"], ["doctor"]])
def test_a_hook_plugin_whose_hooks_raise_never_breaks_the_host(broken_hooks_site, argv):
    result = broken_hooks_site.grpoctl(*argv)
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.returncode in ((0, 4) if argv == ["doctor"] else (0,)), result.stderr[-2000:]
    assert "hook grpo_components of plugin 'acme-raise' raised RuntimeError: registry offline" in result.stderr
    assert "hook grpo_config_sections of plugin 'acme-sections' raised KeyError" in result.stderr
    assert "plugin 'acme-junk': returned str, not a list of ComponentSpec" in result.stderr


def test_broken_hook_plugins_are_listed_with_their_error_and_the_others_work(broken_hooks_site):
    result = broken_hooks_site.grpoctl("plugins", "list", "--json")
    assert result.returncode == 0, result.stderr
    listed = json.loads(result.stdout)
    hooks = {h["name"]: h for h in listed["hooks"]}
    assert hooks["acme-raise"]["status"] == "broken"
    assert hooks["acme-raise"]["problem"] == "grpo_components: RuntimeError: registry offline"
    assert hooks["acme-junk"]["problem"] == "grpo_components: returned str, not a list of ComponentSpec"
    assert hooks["acme-components"]["status"] == "ok"
    assert any(c["name"] == "acme-env" for c in listed["components"])  # the working plugin's component


def test_strict_mode_makes_a_raising_registration_hook_an_error(broken_hooks_site):
    result = broken_hooks_site.grpoctl("plugins", "list", strict=True)
    assert result.returncode == 3
    assert "Traceback" not in result.stderr
    assert re.search(r"error: hook grpo_(components|config_sections) of plugin 'acme-\w+' failed: ", result.stderr)


def test_hooks_run_in_pluggy_order_with_tryfirst_and_trylast(monkeypatch):
    monkeypatch.delenv("GRPO_SDK_STRICT_PLUGINS", raising=False)
    calls = []

    def observer(label, **marks):
        class Observer:
            @hookimpl(**marks)
            def grpo_step_end(self, step):
                calls.append(label)

        return Observer()

    host = PluginHost()
    host.register(observer("last", trylast=True), name="last")
    host.register(observer("plain-1"), name="plain-1")
    host.register(observer("first", tryfirst=True), name="first")
    host.register(observer("plain-2"), name="plain-2")
    host.step_end(run=None, step=1, metrics={})
    assert calls == ["first", "plain-2", "plain-1", "last"]  # pluggy: tryfirst, then last registered first


def test_a_wrapper_implementation_wraps_the_others(monkeypatch):
    monkeypatch.delenv("GRPO_SDK_STRICT_PLUGINS", raising=False)
    extra = ComponentSpec(name="wrapped-env", kind="environment", impl="mine:Env")

    class Adds:
        @hookimpl(wrapper=True)
        def grpo_components(self):
            results = yield
            return [*results, [extra]]

    host = PluginHost()
    host.register(components_plugin(ComponentSpec(name="plain-env", kind="environment", impl="mine:Env")),
                  name="plain")
    host.register(Adds(), name="adds")
    assert sorted(spec.name for _, spec in host.components()) == ["plain-env", "wrapped-env"]


@pytest.mark.parametrize("where", ["before its yield", "after its yield"])
def test_a_failing_wrapper_is_reported_and_the_result_is_as_without_it(monkeypatch, capsys, where):
    monkeypatch.delenv("GRPO_SDK_STRICT_PLUGINS", raising=False)

    class Breaks:
        @hookimpl(wrapper=True)
        def grpo_components(self):
            if where == "before its yield":
                raise RuntimeError("wrapper broke early")
            yield
            raise RuntimeError("wrapper broke late")

    host = PluginHost()
    host.register(components_plugin(ComponentSpec(name="plain-env", kind="environment", impl="mine:Env")),
                  name="plain")
    host.register(Breaks(), name="breaks")
    assert [spec.name for _, spec in host.components()] == ["plain-env"]
    assert "hook grpo_components of plugin 'breaks' raised RuntimeError: wrapper broke" in capsys.readouterr().err
    assert plugin(host, "breaks").status == "broken" and plugin(host, "plain").status == "ok"


def test_a_component_keeps_the_name_of_the_plugin_that_returned_it(monkeypatch):
    monkeypatch.delenv("GRPO_SDK_STRICT_PLUGINS", raising=False)
    host = PluginHost()
    host.register(components_plugin(ComponentSpec(name="a-env", kind="environment", impl="m:A")), name="first")
    host.register(components_plugin(ComponentSpec(name="b-env", kind="environment", impl="m:B")), name="second")
    assert sorted((p, s.name) for p, s in host.components()) == [("first", "a-env"), ("second", "b-env")]
