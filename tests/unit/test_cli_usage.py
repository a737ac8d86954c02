"""How `grpoctl` takes its arguments: ``-p MODULE`` on the config and plugin commands, and what a
mistyped flag or command answers (a did-you-mean, exit code 2, no traceback).

In-process through ``grpo_sdk.cli.app.main`` where that is enough (the ``cli`` fixture restores
the shared ``STATE``); through the real entry (``run_grpoctl``) for the usage errors a user sees.
"""

from __future__ import annotations

import sys

import pytest
import yaml

from helpers import run_grpoctl

# A quick-hack hook module, as `grpoctl run -p acme_task` loads it from the current directory: an
# environment with options, and a top-level config section.
ACME_TASK = '''
import attrs
from grpo_sdk.plugins import ComponentSpec, ConfigSection, EnvironmentReturn, hookimpl


@attrs.frozen(kw_only=True)
class TaskConfig:
    level: int = attrs.field(default=1, metadata={"help": "How hard the acme task is."})


@attrs.frozen(kw_only=True)
class UploaderConfig:
    bucket: str = "s3://default"


class Env:
    def __init__(self, config, context):
        self.config = config or TaskConfig()

    def sample_prompts(self, num_prompts, rng):
        return [(f"{rng.randrange(10)}>", {}) for _ in range(num_prompts)]

    def step(self, message_logs, metadata):
        return EnvironmentReturn(rewards={"score": [0.0] * len(message_logs)})


@hookimpl
def grpo_components():
    return [ComponentSpec(name="acme_task", kind="environment", impl="acme_task:Env", config="acme_task:TaskConfig",
                          capabilities={"generates_prompts"}, summary="The acme task, from a -p module.")]


@hookimpl
def grpo_config_sections():
    return [ConfigSection(name="acme_uploader", config="acme_task:UploaderConfig")]
'''
SELECT = ["env.name=acme_task", "env.acme_task.level=3", "acme_uploader.bucket=s3://runs"]


@pytest.fixture
def project(tmp_path, monkeypatch):
    """The current directory holds acme_task.py (not importable until -p names it)."""
    monkeypatch.delenv("GRPO_SDK_STRICT_PLUGINS", raising=False)
    (tmp_path / "acme_task.py").write_text(ACME_TASK)
    (tmp_path / "raises_task.py").write_text("raise RuntimeError('acme needs ACME_TOKEN')\n")
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    for name in ("acme_task", "raises_task"):
        sys.modules.pop(name, None)


# --- -p MODULE on config and plugins commands ------------------------------------------------------


def test_plugins_list_shows_a_component_of_a_p_module(cli, project):
    code, out, err = cli("plugins", "list", "--kind", "environment", "-p", "acme_task")
    assert code == 0, err
    (row,) = [line for line in out.splitlines() if line.startswith("environment") and " acme_task " in line]
    assert row.split()[:4] == ["environment", "acme_task", "ok", "hook:acme_task"]
    assert "The acme task, from a -p module." in row
    assert any(line.split()[:3] == ["hooks", "acme_task", "ok"] for line in out.splitlines())
    code, out, _ = cli("plugins", "list", "--kind", "environment")  # without -p it is not there
    assert code == 0 and " acme_task " not in out


def test_plugins_show_describes_a_component_of_a_p_module(cli, project):
    code, out, err = cli("plugins", "show", "acme_task", "--plugin", "acme_task")
    assert code == 0, err
    assert "option: level (int, default 1): How hard the acme task is." in out


def test_config_validate_accepts_the_blocks_of_a_p_module(cli, project):
    code, out, err = cli("config", "validate", "-p", "acme_task", *SELECT)
    assert code == 0, err
    assert out.startswith("config OK") and "env acme_task" in out
    code, out, err = cli("config", "validate", "env.name=acme_task")  # without it: no such environment
    assert code == 3 and out == "" and "no environment named 'acme_task'" in err
    code, out, err = cli("config", "validate", "acme_uploader.bucket=s3://runs")  # nor such a section
    assert code == 2 and "unknown key 'acme_uploader'" in err


def test_config_validate_checks_the_options_of_a_p_module(cli, project):
    code, out, err = cli("config", "validate", "-p", "acme_task", "env.name=acme_task", "env.acme_task.level=hard")
    assert code == 2 and out == ""
    assert "env.acme_task.level" in err


def test_config_show_prints_the_blocks_of_a_p_module(cli, project):
    code, out, err = cli("config", "show", "-p", "acme_task", *SELECT)
    assert code == 0, err
    shown = yaml.safe_load(out)
    assert shown["env"]["name"] == "acme_task"
    assert shown["env"]["acme_task"] == {"level": 3}
    assert shown["acme_uploader"] == {"bucket": "s3://runs"}


def test_config_schema_documents_the_blocks_of_a_p_module(cli, project):
    code, out, err = cli("config", "schema", "env", "-p", "acme_task")
    assert code == 0, err
    assert "env.acme_task: plugin block = \n    The acme task, from a -p module." in out
    assert "env.acme_task.level: int = 1\n    How hard the acme task is." in out
    code, out, _ = cli("config", "schema", "env")
    assert code == 0 and "env.acme_task" not in out


COMMANDS = [("config", "validate"), ("config", "show"), ("config", "schema"), ("plugins", "list"),
            ("plugins", "show", "hf")]


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_a_missing_p_module_is_a_plugin_error(cli, project, command):
    code, out, err = cli(*command, "-p", "acme_missing")
    assert (code, out) == (3, "")
    assert err == ("error: -p acme_missing: the hook plugin module could not be imported: ModuleNotFoundError: "
                   "No module named 'acme_missing'\n")


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_a_p_module_that_raises_names_its_error(cli, project, command):
    code, out, err = cli(*command, "-p", "raises_task")
    assert (code, out) == (3, "")
    assert "-p raises_task: the hook plugin module could not be imported: RuntimeError: acme needs ACME_TOKEN" in err
    assert "Traceback" not in err


# --- a mistyped flag or command gets a did-you-mean --------------------------------------------------


def test_a_mistyped_run_flag_names_the_flag_meant():
    proc = run_grpoctl("run", "--max-step", "5")
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr.splitlines()[-1] == "Error: No such option: --max-step. Did you mean --max-steps?"
    assert "run --help' for help." in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_mistyped_command_names_the_command_meant():
    proc = run_grpoctl("config", "valdate")
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr.splitlines()[-1] == "Error: No such command 'valdate'. Did you mean 'validate'?"
    assert "Traceback" not in proc.stderr


def _commands(group, path=()):
    """(path, click command) for every command under ``group``, groups included."""
    for name, command in sorted(group.commands.items()):
        yield (*path, name), command
        if hasattr(command, "commands"):
            yield from _commands(command, (*path, name))


def _tree():
    import typer

    from grpo_sdk.cli.app import app

    return typer.main.get_command(app)


LEAVES = [(path, sorted(opt for param in command.params for opt in param.opts if opt.startswith("--")))
          for path, command in _commands(_tree()) if not hasattr(command, "commands")]


@pytest.mark.parametrize("path, options", LEAVES, ids=[" ".join(path) for path, _ in LEAVES])
def test_every_command_names_the_option_meant(cli, path, options):
    # Each long option of the command with its last letter dropped, as a hurried user types it.
    assert options, path
    for option in options:
        typo = option[:-1]
        if typo in options or len(typo) < 4 or sum(o.startswith(typo) for o in options) > 1:
            continue  # a tie (serve's --top- is --top-k as much as --top-p) names both: test_serve_cmd.py
        code, out, err = cli(*path, typo, "x")
        assert (code, out) == (2, ""), (path, typo, err)
        assert err.splitlines()[-1] == f"Error: No such option: {typo}. Did you mean {option}?", (path, typo)


GROUPS = [(path, sorted(command.commands)) for path, command in [((), _tree()), *_commands(_tree())]
          if hasattr(command, "commands")]


@pytest.mark.parametrize("path, names", GROUPS, ids=[" ".join(path) or "grpoctl" for path, _ in GROUPS])
def test_every_group_names_the_command_meant(cli, path, names):
    for name in names:
        typo = name[:-1]
        if typo in names:
            continue
        code, out, err = cli(*path, typo)
        assert (code, out) == (2, ""), (path, typo, err)
        assert err.splitlines()[-1].startswith(f"Error: No such command '{typo}'. Did you mean '{name}'"), err


def test_only_the_closest_option_is_suggested(cli):
    # difflib finds --kind and --plugin close to --kin; the far one would only confuse.
    code, _, err = cli("plugins", "list", "--kin", "environment")
    assert (code, err.splitlines()[-1]) == (2, "Error: No such option: --kin. Did you mean --kind?")


@pytest.mark.parametrize("command", [("run",), ("config", "validate"), ("config", "show")], ids=" ".join)
def test_an_override_written_as_a_flag_is_explained(cli, command):
    code, out, err = cli(*command, "--grpo.max_num_steps=5")
    assert (code, out) == (2, "")
    assert err.splitlines()[-1] == ("Error: No such option: --grpo.max_num_steps. Config overrides take no dashes: "
                                    "grpo.max_num_steps=VALUE")


def test_an_unknown_option_with_nothing_close_says_only_that(cli):
    code, out, err = cli("config", "validate", "--learning_rate", "1e-5")
    assert (code, out) == (2, "")
    assert err.splitlines()[-1] == "Error: No such option: --learning_rate"
    assert "Usage: " in err and "Traceback" not in err


def test_a_plugin_command_names_the_option_meant(make_site):
    site = make_site()
    site.add("acme-cli", entry_points={"grpo_sdk.hooks": {"acme-cli": "acme_cli.commands"}}, files={
        "acme_cli/__init__.py": "",
        "acme_cli/commands.py": "from grpo_sdk.plugins import hookimpl\n\n@hookimpl\ndef grpo_cli_commands(app):\n"
                                "    @app.command('acme-hello')\n    def hello(name: str = 'world'):\n"
                                "        print(f'hello {name}')\n"})
    proc = site.grpoctl("acme-hello", "--nam", "x")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines()[-1] == "Error: No such option: --nam. Did you mean --name?"
    assert site.grpoctl("acme-hello", "--name", "x").stdout == "hello x\n"


# --- lazy built-in subcommands ---------------------------------------------------------------------


@pytest.mark.parametrize("name", ["run", "doctor", "report", "export", "serve", "config", "plugins"])
def test_the_help_summary_of_a_lazy_builtin_is_its_real_help(name):
    """`grpoctl --help` lists the built-ins from BUILTINS without importing them: each summary must
    be the command's own first help paragraph, or the listing would drift from `grpoctl NAME --help`."""
    from grpo_sdk.cli.app import BUILTINS, load_builtin

    command = load_builtin(name)
    assert command.name == name and hasattr(command, "commands") == BUILTINS[name].group
    assert " ".join(command.help.split("\n\n")[0].split()) == BUILTINS[name].summary


def test_the_root_help_is_the_same_with_every_command_loaded():
    import typer

    from grpo_sdk.cli.app import BUILTINS, app

    root = typer.main.get_command(app)
    lazy = root.get_help(root.context_class(root, info_name="grpoctl"))
    assert not any(isinstance(root.commands[n], type(BUILTINS["run"])) for n in BUILTINS)  # item access loads
    loaded = root.get_help(root.context_class(root, info_name="grpoctl"))
    assert lazy == loaded and list(BUILTINS) == [n for n in root.list_commands(None) if n in BUILTINS]
    assert "run      Train with GRPO." in lazy and "plugins  List and inspect plugins" in lazy


def test_root_help_imports_no_subcommand_module():
    """What `grpoctl --help` costs at start-up (benchmarks/cli_startup.py): no command module, and
    not the plugin API (the config schema) unless a hook plugin is installed."""
    import json
    import subprocess

    code = ("import importlib.metadata as md, io, json, sys, contextlib\n"
            "from grpo_sdk.cli.app import main\n"
            "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
            "    rc = main(['--help'])\n"
            "print(json.dumps({'rc': rc, 'hooks': bool(md.entry_points(group='grpo_sdk.hooks')), 'help': out.getvalue(),\n"
            "                  'modules': sorted(m for m in sys.modules if m.startswith('grpo_sdk'))}))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.splitlines()[-1])
    assert report["rc"] == 0 and "serve    Serve MODEL behind" in report["help"]
    assert not [m for m in report["modules"] if m.endswith("_cmd")], report["modules"]
    if not report["hooks"]:
        assert "grpo_sdk.plugins" not in report["modules"]
        assert not [m for m in report["modules"] if m.split(".")[:2] == ["grpo_sdk", "config"]], report["modules"]


def test_the_hooks_group_spelled_in_the_cli_is_the_plugin_api_one():
    from grpo_sdk.cli.app import HOOKS_GROUP
    from grpo_sdk.plugins.specs import HOOKS_GROUP as API_GROUP

    assert HOOKS_GROUP == API_GROUP
