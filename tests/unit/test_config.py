"""Config loading: precedence, strict structuring, plugin blocks, cross-field checks, round trip, docs.

Everything goes through ``load_config(files, overrides, registry)`` with the registry of the
installed built-in plugins; nothing here imports torch.
"""

from __future__ import annotations

import textwrap

import attrs
import pytest
import yaml

from helpers import config_problems
from grpo_sdk.config import schema as C
from grpo_sdk.config.loading import BUILTIN_RECIPE, check_config, dump_config, load_config, to_yaml
from grpo_sdk.core.errors import ConfigError, ExitCode, PluginError
from grpo_sdk.environments.specs import ReverseDigitsConfig
from grpo_sdk.estimators.specs import GRPOEstimatorConfig
from grpo_sdk.testing import undocumented_options

# The smallest file that passes every check. max_new_tokens is set because the class defaults
# (max_new_tokens 512, max_total_sequence_length 512) fail check_config; see test_class_defaults_pass_checks.
BASE = "policy: {model_name: base-model, generation: {max_new_tokens: 16}}\n"


@pytest.fixture
def write(tmp_path):
    def _write(name: str, text: str) -> str:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
        return str(path)

    return _write


def load(registry, *overrides: str, files: list[str] | None = None) -> C.MasterConfig:
    return load_config(files, list(overrides), registry)


def problems(registry, *overrides: str, files: list[str] | None = None) -> dict[str, str]:
    """path -> message of every problem a load reports (it must fail with a ConfigError)."""
    with pytest.raises(ConfigError) as info:
        load(registry, *overrides, files=files)
    found = dict(info.value.problems)
    assert len(found) == len(info.value.problems), f"a path is reported twice: {info.value.problems}"
    return found


# --- precedence and the raw layer ---------------------------------------------------------------


def test_builtin_recipe_is_used_without_files(registry):
    cfg = load(registry)
    assert cfg.policy.model_name == "builtin:tiny-gpt2"
    assert cfg.grpo.num_prompts_per_step == 8  # the recipe's, not the class default 32
    assert cfg.grpo.num_generations_per_prompt == 16
    assert C.plugin_config(cfg.env) == ReverseDigitsConfig(num_digits=5)


def test_precedence_defaults_then_files_then_overrides(registry, write):
    first = write("first.yaml", """\
        policy: {model_name: m1, generation: {max_new_tokens: 16}}
        grpo: {num_prompts_per_step: 4, seed: 1}
        """)
    second = write("second.yaml", """\
        policy: {model_name: m2}
        grpo: {seed: 2, max_num_steps: 7}
        """)
    cfg = load(registry, "grpo.seed=3", files=[first, second])
    assert cfg.grpo.seed == 3  # override > file 2 > file 1
    assert cfg.policy.model_name == "m2"  # file 2 > file 1
    assert cfg.grpo.max_num_steps == 7
    assert cfg.grpo.num_prompts_per_step == 4  # file 1, kept: files merge deeply
    assert cfg.policy.generation.max_new_tokens == 16
    # With -c the built-in recipe is not read: class defaults fill the rest.
    assert cfg.grpo.num_generations_per_prompt == 16
    assert cfg.policy.optimizer.lr == 5e-6


def test_tilde_resets_to_class_default_and_plus_sets(registry):
    cfg = load(registry, "~grpo.num_prompts_per_step", "+data.shuffle=false", "++grpo.seed=7")
    assert cfg.grpo.num_prompts_per_step == 32  # class default, not the recipe's 8
    assert cfg.data.shuffle is False
    assert cfg.grpo.seed == 7


def test_override_values_are_yaml(registry):
    cfg = load(registry, "policy.generation.stop_token_ids=[1, 2]", "policy.max_grad_norm=null",
               "checkpointing.enabled=false", "data.shuffle=true", "policy.optimizer.betas=[0.5, 0.6]",
               "data.prompt_key=question")
    assert cfg.policy.generation.stop_token_ids == [1, 2]
    assert cfg.policy.max_grad_norm is None
    assert cfg.checkpointing.enabled is False
    assert cfg.data.shuffle is True
    assert cfg.policy.optimizer.betas == (0.5, 0.6)
    assert cfg.data.prompt_key == "question"


@pytest.mark.parametrize("override, path", [
    ("grpo.seed", ""),  # no `=`
    ("=3", ""),
    ("grpo..seed=3", ""),
    ("grpo.seed.x=5", "grpo.seed"),  # descends into a scalar
])
def test_malformed_override_is_a_usage_error(registry, override, path):
    with pytest.raises(ConfigError) as info:
        load(registry, override)
    assert info.value.exit_code == ExitCode.USAGE
    assert [p for p, _ in info.value.problems] == [path]
    if not path:
        assert "key.path=value" in str(info.value)


def test_defaults_chain_is_relative_to_the_file(registry, write, tmp_path, monkeypatch):
    write("base.yaml", BASE + "grpo: {num_prompts_per_step: 4, seed: 1}\n")
    write("mid.yaml", "grpo: {seed: 2, max_num_steps: 9}\n")
    child = write("sub/child.yaml", """\
        defaults: [../base.yaml, ../mid.yaml]
        grpo: {num_prompts_per_step: 8}
        """)
    monkeypatch.chdir(tmp_path / "sub")  # any cwd: paths are relative to child.yaml
    cfg = load(registry, files=[child])
    assert cfg.policy.model_name == "base-model"
    assert cfg.grpo.num_prompts_per_step == 8  # the file beats its bases
    assert cfg.grpo.seed == 2  # later bases beat earlier ones
    assert cfg.grpo.max_num_steps == 9


def test_single_defaults_string(registry, write):
    write("base.yaml", BASE)
    cfg = load(registry, files=[write("child.yaml", "defaults: base.yaml\ngrpo: {seed: 5}\n")])
    assert (cfg.policy.model_name, cfg.grpo.seed) == ("base-model", 5)


@pytest.mark.parametrize("files, fragment", [
    ({"loop.yaml": "defaults: loop.yaml\n"}, "inherits from itself"),
    ({"loop.yaml": "defaults: [other.yaml]\n", "other.yaml": "defaults: loop.yaml\n"}, "inherits from itself"),
    ({"loop.yaml": "defaults: nowhere.yaml\n"}, "config file not found"),
    ({"loop.yaml": "policy: [unclosed\n"}, r"loop.yaml line 2, column 1: not valid YAML"),
    ({"loop.yaml": "- a\n- b\n"}, "must hold a mapping at the top level"),
    # issue 12: every shape of a bad file is one line naming the file (and line), never a traceback
    ({"loop.yaml": "grpo:\n  seed: 1\ngrpo:\n  seed: 2\n"},
     r"loop.yaml line 3, column 1: not valid YAML: key 'grpo' is given twice \(first on line 1\)"),
    ({"loop.yaml": "grpo: {seed: 1, max_num_steps: 2, seed: 3}\n"}, r"key 'seed' is given twice"),
    ({"loop.yaml": "defaults: 5\n"}, r"loop.yaml: `defaults:` must be a file name or a list of file names, got 5"),
    ({"loop.yaml": "defaults: [null]\n"}, r"loop.yaml: `defaults:` item 0 must be a file name, got None"),
    ({"loop.yaml": "defaults: [' ']\n"}, r"`defaults:` item 0 must be a file name, got ' '"),
    ({"loop.yaml": "defaults: [base.yaml]\n", "base.yaml": "a: 1\na: 2\n"}, r"base.yaml line 2, column 1: .*'a'"),
    ({"loop.yaml": "defaults: [missing.yaml]\n"}, r"config file not found: .*missing.yaml \(in `defaults:` of "
                                                   r".*loop.yaml\)"),
    ({"loop.yaml": "a: " + "[" * 50_000 + "]" * 50_000 + "\n"}, r"loop.yaml: nested too deeply to read"),
    ({"loop.yaml": "grpo:\n  seed: 1\x00\n"}, r"loop.yaml line 2: not valid YAML: character '\\x00'"),
])
def test_bad_files_are_config_errors(registry, write, files, fragment):
    paths = [write(name, text) for name, text in files.items()]
    with pytest.raises(ConfigError, match=fragment):
        load(registry, files=paths[:1])


def test_missing_file_is_a_config_error(registry, tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load(registry, files=[str(tmp_path / "missing.yaml")])


def test_a_config_that_is_not_a_regular_utf8_file_is_named(registry, tmp_path):
    import os

    os.mkfifo(tmp_path / "pipe.yaml")  # opening it would block until a writer came
    (tmp_path / "latin1.yaml").write_bytes(b"grpo:\n  # caf\xe9\n  seed: 1\n")
    for path, message in [(tmp_path, f"config file {tmp_path} is a directory; give a YAML file"),
                          (tmp_path / "pipe.yaml", "pipe.yaml is a FIFO (named pipe), not a regular file"),
                          (tmp_path / "latin1.yaml", "latin1.yaml line 2, column 8: not UTF-8 (byte 0xe9)")]:
        with pytest.raises(ConfigError) as info:
            load(registry, files=[str(path)])
        assert message in info.value.problems[0][1]


def test_merge_keys_may_override_what_they_merge(registry, write):
    path = write("cfg.yaml", BASE + "_base: &base {seed: 1, max_num_steps: 7}\ngrpo:\n  <<: *base\n  seed: 2\n")
    with pytest.raises(ConfigError, match="unknown key '_base'"):  # merged fine; only the anchor's key is unknown
        load(registry, files=[path])


@pytest.mark.parametrize("override, path, fragment", [
    (f"grpo.seed={2**63}", "grpo.seed", f"{2**63} (int) is out of range: integers must fit in 64 bits"),
    (f"grpo.seed={-2**63}", None, None),  # the smallest int64 is fine
    (f"policy.optimizer.lr={10**400}", "policy.optimizer.lr", "(401 characters) (int), too large for a float"),
    ("grpo.advantage_clip_high=1e300", "grpo.advantage_clip_high", "must fit in a 32-bit float"),
    ('logger.log_dir="runs\\0x"', "logger.log_dir", "contains a NUL character"),
    ("grpo={1: 2}", "grpo.1", "a key must be a string, got 1 (int)"),
    ("grpo.adv_estimator={name: grpo, name: rloo}", "grpo.adv_estimator", "key 'name' is given twice"),
    ("grpo.seed=" + "[" * 50_000, "grpo.seed", "nested too deeply"),
])
def test_out_of_range_values_and_odd_keys(registry, override, path, fragment):
    if path is None:
        assert load(registry, override).grpo.seed == -2**63
        return
    assert fragment in problems(registry, override)[path]


def test_model_name_is_required_with_a_file(registry, write):
    path = write("cfg.yaml", "policy: {backend: hf}\ngrpo: {num_prompts_per_step: 4}\n")
    assert problems(registry, files=[path]) == {"policy.model_name": "required field missing"}


def test_file_without_policy_section_names_the_missing_key(registry, write):
    path = write("cfg.yaml", "grpo: {num_prompts_per_step: 4}\n")
    assert problems(registry, files=[path]) == {"policy.model_name": "required field missing"}


def test_class_defaults_pass_checks(registry, write):
    cfg = load(registry, files=[write("cfg.yaml", "policy: {model_name: m}\n")])
    assert cfg.policy.model_name == "m"


# --- unknown keys -------------------------------------------------------------------------------


@pytest.mark.parametrize("override, path, suggestion", [
    ("grpo.num_prompt_per_step=8", "grpo.num_prompt_per_step", "did you mean 'num_prompts_per_step'"),
    ("polcy.model_name=x", "polcy", "did you mean 'policy'"),
    ("policy.generation.max_new_token=4", "policy.generation.max_new_token", "did you mean 'max_new_tokens'"),
    ("env.reverse_digits.num_digit=3", "env.reverse_digits.num_digit", "did you mean 'num_digits'"),
])
def test_unknown_key_names_full_path_with_did_you_mean(registry, override, path, suggestion):
    found = problems(registry, override)
    assert list(found) == [path]
    assert found[path].startswith("unknown key") and suggestion in found[path]


def test_unknown_key_without_close_match(registry):
    assert problems(registry, "zzz=1") == {"zzz": "unknown key 'zzz'"}


def test_plugin_option_at_section_level_points_to_the_block(registry):
    found = problems(registry, "grpo.adv_estimator.normalize_rewards=false")
    assert list(found) == ["grpo.adv_estimator.normalize_rewards"]
    assert "option of grpo" in found["grpo.adv_estimator.normalize_rewards"]


def test_plugin_option_suggestion_is_the_full_path(registry):
    found = problems(registry, "grpo.adv_estimator.normalize_rewards=false")
    assert "'grpo.adv_estimator.grpo.normalize_rewards'" in found["grpo.adv_estimator.normalize_rewards"]


# --- strict scalars and validators --------------------------------------------------------------


@pytest.mark.parametrize("override, path, fragment", [
    ('loss_fn.token_level_loss="false"', "loss_fn.token_level_loss", "expected true or false, got 'false'"),
    ("data.shuffle=1", "data.shuffle", "expected true or false"),
    ("grpo.seed=3.9", "grpo.seed", "expected an integer, got 3.9"),
    ("grpo.seed=true", "grpo.seed", "expected an integer, got True"),
    ("grpo.seed='3'", "grpo.seed", "expected an integer, got '3'"),
    ("policy.train_global_batch_size=true", "policy.train_global_batch_size", "expected an integer"),
    ("loss_fn.ratio_clip_min=abc", "loss_fn.ratio_clip_min", "expected a number, got 'abc'"),
    ("loss_fn.ratio_clip_min=false", "loss_fn.ratio_clip_min", "expected a number"),
    ("policy.max_grad_norm=abc", "policy.max_grad_norm", "expected a number"),
    ("policy.model_name=5", "policy.model_name", "expected a string"),
    ("logger.loggers=jsonl", "logger.loggers", "expected a list, got 'jsonl'"),
    ("policy.generation.stop_token_ids=[1, 2.5]", "policy.generation.stop_token_ids[1]", "expected an integer"),
    ("policy.optimizer.betas=[0.9, 0.9, 0.9]", "policy.optimizer.betas", "expected a list of 2 values"),
    ("grpo=5", "grpo", "expected a mapping"),
    ("policy.precision=float64", "policy.precision",
     "expected one of 'float32', 'bfloat16', 'float16', got 'float64'"),
    ("loss_fn.reference_policy_kl_type=k4", "loss_fn.reference_policy_kl_type", "expected one of 'k1', 'k2', 'k3'"),
    ("grpo.num_prompts_per_step=0", "grpo.num_prompts_per_step", "must be > 0"),
    ("policy.optimizer.lr=-1e-5", "policy.optimizer.lr", "must be > 0"),
    ("policy.generation.top_p=1.5", "policy.generation.top_p", "must be <= 1"),
    ("env.reverse_digits.num_digits=0", "env.reverse_digits.num_digits", "must be > 0"),
])
def test_strict_values(registry, override, path, fragment):
    found = problems(registry, override)
    assert list(found) == [path]
    assert fragment in found[path]


def test_string_false_in_a_file_is_not_true(registry, write):
    path = write("cfg.yaml", BASE + 'loss_fn: {token_level_loss: "false"}\n')
    assert "expected true or false" in problems(registry, files=[path])["loss_fn.token_level_loss"]


def test_exponent_without_dot_is_a_float(registry, write):
    text = "policy:\n  model_name: m\n  optimizer: {lr: 1e-5}\n  generation: {max_new_tokens: 16}\n"
    assert yaml.safe_load(text)["policy"]["optimizer"]["lr"] == "1e-5"  # PyYAML's reading
    cfg = load(registry, files=[write("cfg.yaml", text)])
    assert isinstance(cfg.policy.optimizer.lr, float) and cfg.policy.optimizer.lr == 1e-5


def test_int_is_accepted_for_a_float(registry):
    cfg = load(registry, "policy.generation.temperature=2")
    assert cfg.policy.generation.temperature == 2.0 and isinstance(cfg.policy.generation.temperature, float)


def test_every_problem_reported_at_once(registry, write):
    path = write("cfg.yaml", """\
        policy:
          model_name: m
          optimizer: {lr: abc}
        grpo: {num_prompt_per_step: 8}
        loss_fn: {token_level_loss: "false"}
        env: {reverse_digits: {num_digits: 3.9}}
        """)
    with pytest.raises(ConfigError) as info:
        load(registry, files=[path])
    assert sorted(p for p, _ in info.value.problems) == sorted([
        "policy.optimizer.lr", "grpo.num_prompt_per_step", "loss_fn.token_level_loss",
        "env.reverse_digits.num_digits"])
    assert str(info.value).startswith("4 config problems:")


def test_plugin_problem_reported_with_config_problems(registry):
    with pytest.raises(ConfigError) as info:  # a config problem too: exit 2, everything listed
        load(registry, "grpo.seed=3.9", "policy.generation.backend=hff")
    assert dict(info.value.problems).keys() == {"grpo.seed", "policy.generation.backend"}


# --- pluggable sections -------------------------------------------------------------------------


def test_selected_block_is_validated_against_plugin_class(registry):
    found = problems(registry, "policy.generation.hf.attn_implementation=bogus")
    assert list(found) == ["policy.generation.hf.attn_implementation"]
    cfg = load(registry, "policy.generation.hf.attn_implementation=sdpa", "policy.hf.gradient_checkpointing=true")
    assert C.plugin_config(cfg.policy.generation).attn_implementation == "sdpa"
    assert C.plugin_config(cfg.policy).gradient_checkpointing is True


def test_optional_literal_lists_choices(registry):
    found = problems(registry, "policy.generation.hf.attn_implementation=bogus")
    assert "'sdpa', 'eager'" in found["policy.generation.hf.attn_implementation"]


def test_plugin_block_is_structured_into_its_class(registry):
    cfg = load(registry, "env.reverse_digits.num_digits=8")
    env_cfg = C.plugin_config(cfg.env)
    assert isinstance(env_cfg, ReverseDigitsConfig) and env_cfg.num_digits == 8
    assert C.plugin_config(cfg.env, "reverse_digits") is env_cfg
    assert isinstance(C.plugin_config(cfg.grpo.adv_estimator), GRPOEstimatorConfig)  # block written empty


def test_unselected_block_is_kept_and_not_validated(registry):
    cfg = load(registry, "logger.console.bogus=1")  # loggers: [jsonl]
    assert cfg.logger.raw_blocks["console"] == {"bogus": 1}
    assert "console" not in cfg.logger.structured_blocks
    assert dump_config(cfg)["logger"]["console"] == {"bogus": 1}
    # Once selected, the same block is checked: console takes no options.
    found = problems(registry, "logger.loggers=[jsonl, console]", "logger.console.bogus=1")
    assert "takes no options" in found["logger.console"]


def test_plugin_without_options_rejects_a_block(registry):
    assert "takes no options" in problems(registry, "weight_sync.inprocess.foo=0")["weight_sync.inprocess"]


def test_block_must_be_a_mapping(registry):
    with pytest.raises(ConfigError, match="env.reverse_digits: a plugin block must be a mapping"):
        load(registry, "env.reverse_digits=5")


def test_cfg_suffix_alias(registry):
    cfg = load(registry, "~env.reverse_digits", "env.reverse_digits_cfg.num_digits=7")
    assert C.plugin_config(cfg.env).num_digits == 7
    env = dump_config(cfg)["env"]
    assert env["reverse_digits"] == {"num_digits": 7, "format_weight": 0.0} and "reverse_digits_cfg" not in env


def test_both_block_spellings_is_an_error(registry):
    with pytest.raises(ConfigError):
        load(registry, "env.reverse_digits_cfg.num_digits=7", "env.reverse_digits.num_digits=6")


@pytest.mark.parametrize("override, path, fragment", [
    ("policy.generation.backend=hff", "policy.generation.backend", "did you mean 'hf'"),
    ("env.name=reverse_digit", "env.name", "did you mean 'reverse_digits'"),
    ("logger.loggers=[jsonl, jsonll]", "logger.loggers", "did you mean 'jsonl'"),
])
def test_unknown_plugin_is_a_plugin_error(registry, override, path, fragment):
    with pytest.raises(PluginError) as info:
        load(registry, override)
    assert info.value.exit_code == ExitCode.PLUGIN
    assert str(info.value).startswith(f"{path}: ") and fragment in str(info.value)


# --- cross-field checks -------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, path, fragment", [
    (["policy.train_global_batch_size=7"], "policy.train_global_batch_size", "must divide the rollout batch"),
    (["policy.generation.max_new_tokens=64"], "policy.generation.max_new_tokens", "leaves no room for a prompt"),
    (["data.max_input_seq_length=60"], "data.max_input_seq_length", "exceeds policy.max_total_sequence_length"),
    (["policy.generation.top_k=-1"], "policy.generation.top_k", "must be >= 0 or null"),
    (["loss_fn.reference_policy_kl_penalty=0.1", "loss_fn.kl_input_clamp_value=0"],
     "loss_fn.kl_input_clamp_value", "must be > 0 or null"),
])
def test_cross_field_rules(registry, overrides, path, fragment):
    found = problems(registry, *overrides)
    assert list(found) == [path] and fragment in found[path]


def test_cross_field_rules_accept_valid_values(registry):
    cfg = load(registry, "policy.train_global_batch_size=64", "data.max_input_seq_length=59",
               "policy.generation.top_k=0", "loss_fn.kl_input_clamp_value=null")
    assert check_config(cfg) == []


def test_cross_field_problems_reported_together(registry):
    found = problems(registry, "policy.train_global_batch_size=7", "policy.generation.top_k=-1")
    assert found.keys() == {"policy.train_global_batch_size", "policy.generation.top_k"}


# --- round trip ---------------------------------------------------------------------------------


def _round_trip(registry, cfg, tmp_path):
    path = tmp_path / "resolved.yaml"
    path.write_text(to_yaml(cfg))
    return load(registry, files=[str(path)])


def test_round_trip_with_every_section_written(registry, tmp_path):
    cfg = load(registry, "env.reverse_digits.num_digits=8", "weight_sync.backend=inprocess",
               "policy.generation.hf.attn_implementation=eager", "logger.console.note=kept")
    again = _round_trip(registry, cfg, tmp_path)
    assert dump_config(again) == dump_config(cfg)
    assert C.plugin_config(again.env) == C.plugin_config(cfg.env)
    assert C.plugin_config(again.policy.generation) == C.plugin_config(cfg.policy.generation)
    written = yaml.safe_load(to_yaml(cfg))
    assert written["grpo"]["adv_estimator"]["grpo"] == {"normalize_rewards": True,
                                                        "use_leave_one_out_baseline": True}
    assert written["policy"]["hf"] == {"attn_implementation": None, "gradient_checkpointing": False, "autocast": None,
                                       "skip_zero_advantage_rows": False}
    assert written["env"]["reverse_digits"] == {"num_digits": 8, "format_weight": 0.0}


def test_round_trip_of_builtin_recipe(registry, tmp_path):
    cfg = load(registry)
    assert dump_config(_round_trip(registry, cfg, tmp_path)) == dump_config(cfg)


def test_omitted_pluggable_section_gets_plugin_defaults(registry, write):
    cfg = load(registry, files=[write("cfg.yaml", BASE)])
    assert C.plugin_config(cfg.env) == ReverseDigitsConfig()
    assert C.plugin_config(cfg.grpo.adv_estimator) == GRPOEstimatorConfig()
    assert cfg.weight_sync.structured_blocks == {"inprocess": None}  # selected, takes no options


# --- removed options ----------------------------------------------------------------------------


def test_an_old_resolved_config_with_removed_keys_still_loads(registry, tmp_path, caplog):
    """`--resume` reads the run's config.resolved.yaml, which lists every key: one written before a key
    was removed holds it at its default, and must load (silently: it meant nothing)."""
    old = yaml.safe_load(to_yaml(load(registry)))
    old["grpo"]["skip_reference_policy_logprobs_calculation"] = False
    path = tmp_path / "config.resolved.yaml"
    path.write_text(yaml.safe_dump(old, sort_keys=False))
    cfg = load(registry, files=[str(path)])
    assert "skip_reference_policy_logprobs_calculation" not in dump_config(cfg)["grpo"]
    assert caplog.records == []
    # A plugin's config class declares its removed keys the same way: dropped there too.
    from grpo_sdk.config.loading import Structurer

    assert Structurer(registry).structure({"legacy": False}, PluginOptions) == PluginOptions()


@attrs.frozen(kw_only=True)
class PluginOptions:
    """A plugin's options with a removed key, as ``vllm.async_engine`` was until issue 15."""

    __removed__ = {"legacy": C.RemovedOption(inert=(False,), why="the loop does it another way")}
    enforce_eager: bool = C.option(False, "A kept option.")


def test_a_removed_key_at_another_inert_value_loads_with_a_warning(registry, caplog):
    cfg = load(registry, "grpo.skip_reference_policy_logprobs_calculation=true", "loss_fn.reference_policy_kl_penalty=0")
    assert cfg.loss_fn.reference_policy_kl_penalty == 0
    [record] = caplog.records
    assert record.getMessage().startswith("grpo-sdk: warning: grpo.skip_reference_policy_logprobs_calculation: "
                                          "removed option, ignored: ")
    assert "\n" not in record.getMessage()


def test_a_removed_key_at_a_value_that_did_something_is_an_error(registry):
    from grpo_sdk.config.loading import Structurer

    with pytest.raises(ConfigError) as info:
        Structurer(registry).structure({"legacy": True, "enforce_eager": 3}, PluginOptions)
    found = dict(info.value.problems)
    assert found.keys() == {"legacy", "enforce_eager"}  # reported with the other problems
    assert found["legacy"].startswith("this option was removed: the loop does it another way")
    assert "saved configs that hold false still load" in found["legacy"]
    assert "this option was removed" in problems(registry, "grpo.skip_reference_policy_logprobs_calculation=1")[
        "grpo.skip_reference_policy_logprobs_calculation"]


# --- documentation ------------------------------------------------------------------------------


def plugin_config_classes(registry) -> dict[str, type]:
    """Every built-in's config class, usable or not (config modules are light: no requirement needed)."""
    from grpo_sdk.core.imports import import_target

    return {f"{info.kind}:{info.name}": import_target(info.spec.config) for info in registry.list()
            if info.spec is not None and info.spec.config is not None}


def test_every_master_config_field_is_documented():
    assert undocumented_options(C.MasterConfig) == []


def test_every_plugin_config_field_is_documented(registry):
    classes = plugin_config_classes(registry)
    assert {"generation:hf", "generation:vllm", "policy:hf", "estimator:grpo", "environment:reverse_digits"} <= classes.keys()
    assert {name: undocumented_options(cls) for name, cls in classes.items() if undocumented_options(cls)} == {}


@attrs.frozen
class _Inner:
    a: int = C.option(1, "")


@attrs.frozen
class _Outer:
    inner: _Inner = C.option(factory=_Inner, help="documented")
    b: int = attrs.field(default=0)
    hidden: dict = attrs.field(factory=dict, metadata={"internal": True})


def test_documentation_check_flags_undocumented_fields():
    assert undocumented_options(_Outer) == ["inner.a", "b"]


# --- YAML 1.1 booleans and ~key typos --------------------------------------------------------------


@pytest.mark.parametrize("word", ["yes", "no", "on", "off", "y", "n", "Yes", "OFF"])
def test_yaml_1_1_words_are_not_booleans(registry, word):
    # PyYAML reads these as booleans; a config option that wants one takes only true or false.
    found = config_problems(registry, f"data.shuffle={word}")
    assert f"expected true or false, got '{word}'" in found["data.shuffle"]


def test_true_and_false_are_booleans_in_files_and_overrides(registry, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("data:\n  shuffle: False\n  filter_long_prompts: TRUE\n")
    cfg = load_config([str(BUILTIN_RECIPE), str(recipe)], [], registry)
    assert cfg.data.shuffle is False and cfg.data.filter_long_prompts is True
    assert load_config(None, ["data.shuffle=true"], registry).data.shuffle is True


def test_a_string_option_keeps_yes_as_text(registry, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("data:\n  system_prompt: yes\n")
    assert load_config([str(BUILTIN_RECIPE), str(recipe)], [], registry).data.system_prompt == "yes"


def test_resetting_a_key_the_config_does_not_have_is_an_error(registry):
    found = config_problems(registry, "grpo.seed=5", "~grpo.seeed")
    assert "is not a key of this config" in found["~grpo.seeed"] and "did you mean ~grpo.seed?" in found["~grpo.seeed"]
    cfg = load_config(None, ["grpo.seed=5", "~grpo.seed"], registry)
    assert cfg.grpo.seed == load_config(None, [], registry).grpo.seed != 5
    assert load_config(None, ["~policy.generation.hf.compile"], registry).policy.generation.backend == "hf"
