"""`grpoctl --version`, `config show|validate|schema`, `doctor`, and `run`'s config errors.

Config commands run in-process through ``grpo_sdk.cli.app.main`` (fast; the shared ``STATE`` is
restored after each test). ``--version``, ``doctor`` and ``run`` run as subprocesses: they import
torch or must prove that torch is not imported.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import platform
import subprocess
import sys

import attrs
import pytest
import yaml

import grpo_sdk
from grpo_sdk.cli.common import STATE
from grpo_sdk.config import schema as C
from grpo_sdk.config.loading import dump_config, load_config
from grpo_sdk.plugins.host import PluginHost
from grpo_sdk.plugins.registry import Registry
from helpers import grpoctl_env, run_grpoctl

BUILTINS = {("generation", "hf"), ("policy", "hf"), ("estimator", "grpo"), ("environment", "reverse_digits"),
            ("weight_sync", "inprocess"), ("logger", "jsonl"), ("logger", "console")}
BAD = ["grpo.num_prompt_per_step=8", 'loss_fn.token_level_loss="false"', "grpo.seed=3.9", "logger.loggers=jsonl"]


def schema_entries(out: str) -> dict[str, tuple[str, str]]:
    """`config schema` output -> {path: (type and default, help)}; each key line is followed by its help."""
    lines = out.splitlines()
    assert len(lines) % 2 == 0, out
    entries = {}
    for key_line, help_line in zip(lines[::2], lines[1::2]):
        assert not key_line.startswith(" ") and help_line.startswith("    "), (key_line, help_line)
        path, _, rest = key_line.partition(": ")
        entries[path] = (rest, help_line.strip())
    return entries


# --- --version, state -------------------------------------------------------------------------


def test_version():
    proc = run_grpoctl("--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"grpo-sdk {grpo_sdk.__version__}\n"
    assert grpo_sdk.__version__ == md.version("grpo-sdk")


def test_main_does_not_reuse_a_previous_registry(cli):
    STATE.host, STATE.registry = PluginHost(), Registry([])  # a stale registry with no components
    assert cli("config", "validate")[0] == 0
    assert STATE.registry.names("generation") == ["dynamo", "hf", "megatron", "sglang", "trtllm", "vllm"]


def test_calls_do_not_leak_into_each_other(cli):
    assert cli("config", "validate", "policy.generation.backend=hff")[0] == 3
    code, out, err = cli("config", "validate")
    assert (code, err) == (0, "") and out.startswith("config OK")


# --- config show --------------------------------------------------------------------------------


def test_show_prints_resolved_yaml(cli):
    code, out, err = cli("config", "show", "grpo.num_prompts_per_step=8")
    assert code == 0, err
    shown = yaml.safe_load(out)
    assert shown["grpo"]["num_prompts_per_step"] == 8
    assert shown["policy"]["model_name"] == "builtin:tiny-gpt2"
    assert shown["env"]["reverse_digits"] == {"num_digits": 5, "format_weight": 0.0}  # selected plugin block in full
    expected = dump_config(load_config(None, ["grpo.num_prompts_per_step=8"], Registry.discover()))
    assert shown == json.loads(json.dumps(expected))  # tuples come back as lists


def test_show_json_matches_yaml(cli):
    code, out, _ = cli("config", "show", "--format", "json")
    assert code == 0
    assert json.loads(out) == yaml.safe_load(cli("config", "show")[1])


def test_show_layers_files(cli, tmp_path):
    first, second = tmp_path / "a.yaml", tmp_path / "b.yaml"
    first.write_text("policy: {model_name: m1, generation: {max_new_tokens: 8}}\ngrpo: {seed: 1}\n")
    second.write_text("grpo: {seed: 2}\n")
    code, out, err = cli("config", "show", "-c", str(first), "--config", str(second), "grpo.max_num_steps=3")
    assert code == 0, err
    shown = yaml.safe_load(out)
    assert (shown["policy"]["model_name"], shown["grpo"]["seed"], shown["grpo"]["max_num_steps"]) == ("m1", 2, 3)
    assert shown["grpo"]["num_prompts_per_step"] == 32  # class default: the recipe is not read with -c


def test_show_rejects_unknown_format(cli):
    assert cli("config", "show", "--format", "xml")[0] == 2


# --- config validate ----------------------------------------------------------------------------


def test_validate_recipe(cli):
    code, out, err = cli("config", "validate")
    assert (code, err) == (0, "")
    assert "config OK" in out and "128 rollouts per step" in out  # 8 prompts x 16 generations


def test_validate_reports_every_problem(cli):
    code, out, err = cli("config", "validate", *BAD)
    assert code == 2 and out == ""
    assert "4 config problems" in err
    for path in ("grpo.num_prompt_per_step", "loss_fn.token_level_loss", "grpo.seed", "logger.loggers"):
        assert f"  {path}: " in err
    assert "did you mean 'num_prompts_per_step'" in err


@pytest.mark.parametrize("args, code, fragment", [
    (["policy.generation.backend=hff"], 3, "did you mean 'hf'"),
    (["grpo.seed"], 2, "is not of the form key.path=value"),
    (["-c", "/nonexistent/cfg.yaml"], 2, "config file not found"),
    (["policy.train_global_batch_size=7"], 2, "must divide the rollout batch"),
])
def test_validate_errors(cli, args, code, fragment):
    got, out, err = cli("config", "validate", *args)
    assert got == code and out == ""
    assert err.startswith("error: ") and fragment in err


# --- config schema ------------------------------------------------------------------------------


def test_schema_documents_every_key(cli):
    code, out, err = cli("config", "schema")
    assert code == 0, err
    entries = schema_entries(out)
    help_text = attrs.fields_dict(C.GRPOConfig)["num_prompts_per_step"].metadata["help"]
    assert entries["grpo.num_prompts_per_step"] == ("int = 32", help_text)
    assert entries["env.reverse_digits.num_digits"][0] == "int = 5"
    assert "Length of the digit strings" in entries["env.reverse_digits.num_digits"][1]
    assert "sdpa" in entries["policy.generation.hf.attn_implementation"][0]
    for path in ("policy.model_name", "policy.hf.gradient_checkpointing", "grpo.adv_estimator.grpo.normalize_rewards",
                 "logger.jsonl", "weight_sync.inprocess"):
        assert path in entries
    assert entries["policy.model_name"][0] == "str = (required)"
    assert [path for path, (_, text) in entries.items() if not text] == []
    assert not any(key in path for path in entries for key in ("raw_blocks", "structured_blocks", "extra_sections"))


@pytest.mark.parametrize("section, inside, outside", [
    ("grpo", "grpo.adv_estimator.grpo.normalize_rewards", "policy.model_name"),
    ("policy.generation.hf", "policy.generation.hf.attn_implementation", "policy.generation.max_new_tokens"),
])
def test_schema_filters_by_section(cli, section, inside, outside):
    code, out, _ = cli("config", "schema", section)
    assert code == 0
    entries = schema_entries(out)
    assert inside in entries and outside not in entries
    assert all(path == section or path.startswith(section + ".") for path in entries)


def test_schema_unknown_section_is_a_usage_error(cli):
    code, _, err = cli("config", "schema", "nothere")
    assert code == 2 and "no config key under 'nothere'" in err


# --- doctor -------------------------------------------------------------------------------------


def test_doctor_json():
    proc = run_grpoctl("doctor", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    status = {(c["kind"], c["name"]): c["status"] for c in report["components"]}
    assert BUILTINS <= status.keys()
    assert {status[key] for key in BUILTINS} == {"ok"}
    assert report["problems"] == []
    assert report["python"] == platform.python_version()
    assert report["packages"]["grpo-sdk"] == grpo_sdk.__version__
    assert report["packages"]["torch"] == md.version("torch")
    devices = report["devices"]
    assert isinstance(devices["cuda_available"], bool) and isinstance(devices["gpus"], list)
    assert devices["cpu_threads"] >= 1


# --- run ----------------------------------------------------------------------------------------


def test_run_with_bad_config_exits_2_before_any_model(tmp_path):
    run_dir = tmp_path / "run"
    program = ("import sys; from grpo_sdk.cli.app import main; "
               f"code = main(['run', *{BAD!r}, '--run-dir', {str(run_dir)!r}]); "
               "print('torch imported:', 'torch' in sys.modules); sys.exit(code)")
    proc = subprocess.run([sys.executable, "-c", program], env=grpoctl_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2
    assert proc.stdout == "torch imported: False\n"
    assert "4 config problems" in proc.stderr
    assert not run_dir.exists()


def test_run_with_unknown_plugin_exits_3(cli, tmp_path):
    code, _, err = cli("run", "env.name=reverse_digit", "--run-dir", str(tmp_path / "run"))
    assert code == 3 and "did you mean 'reverse_digits'" in err


def test_run_with_missing_model_exits_1_naming_the_path(tmp_path):
    proc = run_grpoctl("run", "policy.model_name=/nonexistent/dir", "grpo.max_num_steps=1",
                       "--run-dir", str(tmp_path / "run"))
    assert proc.returncode == 1, proc.stderr
    assert "error: " in proc.stderr and "/nonexistent/dir" in proc.stderr
    assert "Traceback" not in proc.stderr
