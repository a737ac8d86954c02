"""The public plugin API, pinned: ``grpo_sdk.plugins`` and the hooks (docs/compatibility.md).

Plugin authors import only ``grpo_sdk.plugins``. Its names, the methods and arguments of its
protocols, the fields of its records, and the names and arguments of the hook specs are spelled
out here as literals, so an accidental change (a renamed protocol method, a dropped record
field, a new required hook argument) fails this test. A deliberate change updates the literal
here, the docs (docs/compatibility.md lists the names; docs/plugins.md documents every hook with
its signature), and, when it can break a plugin, comes with a deprecation or a plugin API bump.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import attrs
import pluggy
import pytest

import grpo_sdk.plugins as api
from grpo_sdk.plugins import hookspecs

DOCS = Path(__file__).resolve().parents[2] / "docs"

PUBLIC_NAMES = [
    "AdvantageEstimator",
    "AdvantageInput",
    "AgentResult",
    "AgentTask",
    "AsyncGeneration",
    "Capability",
    "Checkpointable",
    "ComponentInfo",
    "ComponentSpec",
    "ConfigError",
    "ConfigSection",
    "DataError",
    "DeclaresRewardComponents",
    "DeclaresTools",
    "EndpointConfig",
    "Environment",
    "EnvironmentReturn",
    "EnvironmentStepError",
    "ExitCode",
    "ExportsMergedModel",
    "Generation",
    "GenerationInput",
    "GenerationOutput",
    "GrpoSdkError",
    "HOOKS_GROUP",
    "KINDS",
    "Logger",
    "LossFunction",
    "Message",
    "MessageLog",
    "ModelLoadError",
    "MultiTurnEnvironment",
    "NonFiniteError",
    "PLUGIN_API_VERSION",
    "PausesForRefit",
    "PluginError",
    "Policy",
    "PromptSampler",
    "ReceivesBroadcast",
    "ReportsMetrics",
    "RunContext",
    "RunStatus",
    "RunsAgents",
    "RunsOnMainThread",
    "SUPPORTED_PLUGIN_APIS",
    "SamplingParams",
    "SupportsShutdown",
    "SurvivorNormalizedLoss",
    "SyncStats",
    "TrainBatch",
    "WeightFileLoader",
    "WeightFileWriter",
    "WeightSync",
    "Worker",
    "WorkerGroup",
    "ZeroGradientRows",
    "hookimpl",
    "hookspec",
    "option",
]

# Each protocol's methods, as (argument names): "*" starts keyword-only arguments. The optional
# protocols (Checkpointable ... WeightFileWriter) are what the loop and runtimes check with isinstance.
PROTOCOLS = {
    "AdvantageEstimator": {"compute_advantages": "(self, batch)"},
    "AsyncGeneration": {"cancel": "(self, request_ids)", "poll": "(self, timeout_s)",
                        "submit": "(self, request_id, prompts, sampling)"},
    "Checkpointable": {"load_checkpoint": "(self, path)", "save_checkpoint": "(self, path)"},
    "DeclaresRewardComponents": {"num_reward_components": "(self)"},
    "DeclaresTools": {"tool_schemas": "(self)"},
    "RunsAgents": {"run_agents": "(self, tasks)"},
    "Environment": {"step": "(self, message_logs, metadata)"},
    "ExportsMergedModel": {"export_merged": "(self, policy_dir, out)"},
    "Generation": {
        "finish_generation": "(self)",
        "generate": "(self, prompts, sampling)",
        "prepare_for_generation": "(self)",
        "shutdown": "(self)",
        "update_weights": "(self, weights, *, version)",
    },
    "Logger": {"close": "(self)", "log_metrics": "(self, step, metrics)"},
    "LossFunction": {"__call__": "(self, logprobs, batch, *, global_valid_seqs, global_valid_toks)"},
    "PausesForRefit": {"pause_generation": "(self, *, keep_in_flight)",
                       "resume_generation": "(self, *, recompute_kv_cache)"},
    "Policy": {
        "load_checkpoint": "(self, path)",
        "logprobs": "(self, batch)",
        "named_weights": "(self)",
        "offload": "(self)",
        "onload": "(self)",
        "reference_logprobs": "(self, batch)",
        "save_checkpoint": "(self, path)",
        "shutdown": "(self)",
        "train": "(self, batch, loss_fn)",
    },
    "MultiTurnEnvironment": {"step": "(self, message_logs, metadata)"},
    "PromptSampler": {"sample_prompts": "(self, num_prompts, rng)"},
    "ReceivesBroadcast": {"broadcast_ranks": "(self)",
                          "join_broadcast": "(self, *, master_address, master_port, rank_offset, world_size, "
                                            "group_name, backend)",
                          "receive_broadcast": "(self, tensors, *, group_name, version, last)"},
    "ReportsMetrics": {},
    "RunsOnMainThread": {"runs_on_main_thread": "(self)"},
    "SupportsShutdown": {"shutdown": "(self)"},
    "SurvivorNormalizedLoss": {
        "survivor_normalization": "(self, micro_metrics, *, global_valid_seqs, global_valid_toks)",
    },
    "WeightFileLoader": {"load_weights": "(self, path, *, version)"},
    "WeightFileWriter": {"save_weights": "(self, path)"},
    "WeightSync": {"sync_weights": "(self, policy, generation, *, version)"},
    "ZeroGradientRows": {
        "metrics_of_trained_rows": "(self, metrics, *, trained_toks, trained_seqs, global_valid_toks, "
                                   "global_valid_seqs)",
        "zero_gradient_rows": "(self, batch)",
    },
    # The worker-group API weight-sync transports use (Ray runtime).
    "Worker": {"store_address": "(self)"},
    "WorkerGroup": {
        "run": "(self, fn, *args, ranks=, timeout=, name=, **kwargs)",
        "submit": "(self, fn, *args, ranks=, name=, **kwargs)",
        "wait": "(self, calls, *, timeout=, on_app_error=, deadline_key=)",
    },
}

# Protocol members that are attributes (a plain attribute or a property satisfies them), not methods.
PROTOCOL_ATTRIBUTES = {
    "ReportsMetrics": {"last_metrics"},
    "RunsAgents": {"endpoint"},
    "SurvivorNormalizedLoss": {"requires_survivor_normalization"},
    "Worker": {"component", "rank", "world_size", "device", "state"},
    "WorkerGroup": {"workers"},
}

# Each record's fields in order; "=" marks a field with a default (optional to construct).
RECORDS = {
    "AdvantageInput": ("rewards, group_ids, mask, reward_components=, valid_mask=, sample_mask=, generation_logprobs=, "
                       "prev_logprobs=, reference_logprobs=, teacher_logprobs=, metadata="),
    "AgentResult": "rewards, metrics=, turns=, flags=, info=",
    "AgentTask": ("session_id, base_url, endpoint_url, api_key, model, prompt, messages, row, max_tokens, "
                  "timeout_s, group, index"),
    "EndpointConfig": ("host=, port=, api_key=, model_name=, tool_parser=, request_timeout_s=, max_queue=, "
                       "max_connections="),
    "ComponentInfo": "kind, name, status, spec=, entry_point=, dist=, version=, problem=, hint=",
    "ComponentSpec": "name, kind, impl, config=, requires=, extra=, api=, capabilities=, metrics=, summary=, check=",
    "ConfigSection": "name, config, summary=",
    "EnvironmentReturn": "rewards, done=, observations=, metadata=, metrics=, flags=",
    "GenerationInput": "input_ids, attention_mask, max_new_tokens=, seeds=",
    "GenerationOutput": ("response_ids, response_lengths, logprobs, truncated, weight_version=, "
                         "token_weight_versions="),
    "Message": "role, content, token_ids=, generation_logprobs=, flags=",
    "RunContext": ("config, run_dir, model_path, tokenizer_path, device, seed, needs_reference, registry=, "
                   "resume_step=, rank=, world_size=, eos_token_id=, pad_token_id="),
    "SamplingParams": "max_new_tokens, temperature=, top_p=, top_k=, stop_token_ids=, seed=, ignore_eos=",
    "SyncStats": "version, num_tensors, num_bytes, seconds",
    "TrainBatch": ("input_ids, attention_mask, token_mask, sample_mask, generation_logprobs, group_ids, rewards, "
                   "advantages=, prev_logprobs=, reference_logprobs=, extras=, teacher_logprobs=, reward_components=, "
                   "reward_valid=, truncated=, response_start=, message_logs=, metadata="),
}

# Hook name -> the argument names of its pluggy spec (what @hookimpl functions may take).
HOOKS = {
    "grpo_checkpoint_saved": ("run", "step", "path"),
    "grpo_cli_commands": ("app",),
    "grpo_components": (),
    "grpo_config_sections": (),
    "grpo_run_end": ("run", "status", "error"),
    "grpo_run_start": ("run",),
    "grpo_step_end": ("run", "step", "metrics"),
}

EXIT_CODES = {"OK": 0, "FAILED": 1, "USAGE": 2, "PLUGIN": 3, "ENVIRONMENT": 4, "INTERRUPTED": 130, "HANGUP": 129,
              "TERMINATED": 143}

ENTRY_POINT_GROUPS = {
    "generation": "grpo_sdk.generation",
    "policy": "grpo_sdk.policy",
    "estimator": "grpo_sdk.estimators",
    "environment": "grpo_sdk.environments",
    "weight_sync": "grpo_sdk.weight_sync",
    "logger": "grpo_sdk.loggers",
}


def arguments(function) -> str:
    """``(self, weights, *, version)``: argument names and kinds, without annotations or defaults."""
    parts, keyword_only = [], False
    for p in inspect.signature(function).parameters.values():
        if p.kind is p.VAR_POSITIONAL:
            parts.append(f"*{p.name}")
            keyword_only = True
        elif p.kind is p.VAR_KEYWORD:
            parts.append(f"**{p.name}")
        else:
            if p.kind is p.KEYWORD_ONLY and not keyword_only:
                parts.append("*")
                keyword_only = True
            parts.append(p.name + ("=" if p.default is not p.empty else ""))
    return f"({', '.join(parts)})"


def hook_callers() -> dict[str, pluggy.HookCaller]:
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    return {name: caller for name, caller in vars(pm.hook).items() if isinstance(caller, pluggy.HookCaller)}


# --- the names -----------------------------------------------------------------------------------


def test_public_names_are_pinned():
    assert PUBLIC_NAMES == sorted(PUBLIC_NAMES), "keep the pinned list sorted"
    assert sorted(api.__all__) == PUBLIC_NAMES, (
        "grpo_sdk.plugins.__all__ changed: a public API change must be deliberate. Update PUBLIC_NAMES, "
        "docs/compatibility.md and, if a plugin can break, deprecate first (docs/compatibility.md)")
    assert len(set(api.__all__)) == len(api.__all__)


def test_every_public_name_resolves_and_nothing_else_is_public():
    for name in api.__all__:
        assert getattr(api, name, None) is not None, f"grpo_sdk.plugins.{name} is in __all__ but does not resolve"
    namespace: dict = {}
    exec("from grpo_sdk.plugins import *", namespace)
    assert sorted(k for k in namespace if k != "__builtins__") == PUBLIC_NAMES
    # Submodules are attributes too, but private: only the re-exports are the API.
    stray = [n for n, v in vars(api).items()
             if not n.startswith("_") and n not in api.__all__ and not isinstance(v, types.ModuleType)]
    assert stray == [], f"public-looking names missing from __all__: {stray}"


def test_the_plugin_api_version_is_supported_and_is_the_spec_default():
    assert isinstance(api.PLUGIN_API_VERSION, int) and api.PLUGIN_API_VERSION >= 1
    assert api.PLUGIN_API_VERSION in api.SUPPORTED_PLUGIN_APIS
    assert isinstance(api.SUPPORTED_PLUGIN_APIS, frozenset)
    assert attrs.fields(api.ComponentSpec).api.default == api.PLUGIN_API_VERSION


def test_importing_the_public_module_imports_no_heavy_module():
    heavy = ("torch", "transformers", "ray")
    code = ("import sys\nfrom grpo_sdk.plugins import *\nimport json\n"
            f"print(json.dumps(sorted(m for m in {heavy!r} if m in sys.modules)))\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1]) == []


# --- what the names promise ----------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(PROTOCOLS))
def test_protocol_methods_are_pinned(name):
    protocol = getattr(api, name)
    methods = {attr: arguments(value) for attr, value in vars(protocol).items()
               if inspect.isfunction(value) and (not attr.startswith("_") or attr == "__call__")}
    assert methods == PROTOCOLS[name], (
        f"the methods of {name} changed: a new required method or argument breaks every plugin of that "
        "kind (make it optional, or bump the plugin API, docs/compatibility.md)")


@pytest.mark.parametrize("name", sorted(PROTOCOLS))
def test_protocol_attributes_are_pinned(name):
    protocol = getattr(api, name)
    attributes = set(vars(protocol).get("__annotations__", {}))
    attributes |= {attr for attr, value in vars(protocol).items() if isinstance(value, property)}
    assert attributes == PROTOCOL_ATTRIBUTES.get(name, set())


def test_every_public_protocol_is_pinned():
    protocols = {n for n in api.__all__ if getattr(getattr(api, n), "_is_protocol", False)}
    assert protocols == set(PROTOCOLS)


@pytest.mark.parametrize("name", sorted(RECORDS))
def test_record_fields_are_pinned(name):
    fields = ", ".join(f.name + ("=" if f.default is not attrs.NOTHING else "")
                       for f in attrs.fields(getattr(api, name)))
    assert fields == RECORDS[name], f"the fields of {name} changed (a new field needs a default to break nobody)"


def test_every_public_record_is_pinned():
    records = {n for n in api.__all__ if isinstance(getattr(api, n), type) and attrs.has(getattr(api, n))}
    assert records == set(RECORDS)


def test_exit_codes_and_entry_point_groups_are_pinned():
    assert {m.name: int(m) for m in api.ExitCode} == EXIT_CODES
    assert api.KINDS == ENTRY_POINT_GROUPS
    assert api.HOOKS_GROUP == "grpo_sdk.hooks"
    errors = ("ConfigError", "DataError", "EnvironmentStepError", "ModelLoadError", "NonFiniteError", "PluginError")
    for error in errors:
        assert issubclass(getattr(api, error), api.GrpoSdkError)
    assert (api.ConfigError.exit_code, api.PluginError.exit_code) == (api.ExitCode.USAGE, api.ExitCode.PLUGIN)


# --- hooks ---------------------------------------------------------------------------------------


def test_hook_specs_are_pinned():
    callers = hook_callers()
    assert {name: caller.spec.argnames for name, caller in callers.items()} == HOOKS, (
        "the hook specs changed: removing a hook or an argument breaks plugins that use it "
        "(deprecate with warn_on_impl / warn_on_impl_args first, docs/compatibility.md)")
    # Plain observer/collector hooks: no firstresult or historic semantics, nothing deprecated yet.
    for name, caller in callers.items():
        opts = caller.spec.opts
        assert (opts["firstresult"], opts["historic"], opts["warn_on_impl"]) == (False, False, None), name


def test_the_hook_markers_are_the_projects():
    assert api.hookimpl.project_name == api.hookspec.project_name == "grpo_sdk"


def test_every_hook_is_documented_with_its_signature():
    """docs/plugins.md names each hook as `name(arg, ...)` with the spec's exact arguments."""
    text = (DOCS / "plugins.md").read_text()
    documented = {m.group(1): m.group(2) for m in re.finditer(r"`(grpo_\w+)\(([^)`]*)\)`", text)}
    expected = {name: ", ".join(args) for name, args in HOOKS.items()}
    missing = sorted(set(expected) - set(documented))
    unknown = sorted(set(documented) - set(expected))
    wrong = {n: (documented[n], expected[n]) for n in set(expected) & set(documented) if documented[n] != expected[n]}
    assert not missing, f"docs/plugins.md does not document these hooks: {missing}"
    assert not unknown, f"docs/plugins.md documents hooks that do not exist: {unknown}"
    assert not wrong, f"docs/plugins.md has the wrong signature (documented, actual): {wrong}"


def test_every_kind_is_documented_with_its_group_and_protocol():
    text = (DOCS / "plugins.md").read_text()
    rows = {m.group(1): (m.group(2), m.group(3))
            for m in re.finditer(r"^\| (\w+) \| `([\w.]+)` \| `(\w+)` \|", text, re.MULTILINE)}
    assert set(rows) == set(ENTRY_POINT_GROUPS)
    for kind, (group, protocol) in rows.items():
        assert group == ENTRY_POINT_GROUPS[kind] and protocol in PROTOCOLS, (kind, group, protocol)


def test_the_compatibility_page_lists_the_public_names():
    text = (DOCS / "compatibility.md").read_text()
    section = re.search(r"<!-- public-api.*?-->(.*?)<!-- /public-api -->", text, re.DOTALL)
    assert section, "docs/compatibility.md lost its public-api list"
    listed = re.findall(r"`(\w+)`", section.group(1))
    assert sorted(listed) == PUBLIC_NAMES, "docs/compatibility.md must list exactly grpo_sdk.plugins.__all__"


# The contract kit is public too: plugin packages' own test suites import it.
TESTING_NAMES = [
    "Component", "ContractError", "ContractTests", "SELECTORS", "check_config", "check_light", "check_protocol",
    "check_spec", "grpo_component", "grpo_overrides", "grpo_tiny_model", "parse_component", "pytest_addoption",
    "pytest_generate_tests", "run_training",
]
CONTRACT_TESTS = ["test_config", "test_protocol", "test_spec", "test_spec_is_light", "test_trains"]


def test_the_contract_kit_names_are_pinned():
    import grpo_sdk.testing as kit

    assert sorted(kit.__all__) == sorted(TESTING_NAMES)
    assert sorted(name for name in vars(kit.ContractTests) if name.startswith("test_")) == CONTRACT_TESTS
    assert arguments(kit.run_training) == "(kind, name, overrides=, *, steps=, registry=, run_dir=, model_dir=, " \
                                          "logprob_tolerance=)"
    for check in (kit.check_spec, kit.check_protocol, kit.check_light):
        assert arguments(check) == "(kind, name, *, registry=)"
    assert arguments(kit.check_config) == "(kind, name, overrides=, *, registry=)"


# The Python API (``import grpo_sdk``; docs/compatibility.md item 5): names, and the arguments of
# the entry points as (name, kind) with "*" before keyword-only ones.
TOP_LEVEL_NAMES = [
    "ConfigError", "DataError", "GrpoSdkError", "MasterConfig", "ModelLoadError", "PluginError", "RunStatus",
    "RunSummary", "Trainer", "__version__", "export_model", "load_config", "train",
]
API_SIGNATURES = {
    "train": ["config", "overrides", "*", "run_dir", "reward_funcs", "plugins", "resume", "progress", "on_step"],
    "load_config": ["config", "overrides", "*", "reward_funcs", "plugins"],
    "Trainer": ["config", "*", "run_dir", "overrides", "reward_funcs", "plugins", "resume", "progress", "on_step"],
    "export_model": ["run_dir", "out", "*", "step", "best", "lora"],
}
RUN_SUMMARY_FIELDS = ["status", "steps", "seconds", "reward_first", "reward_last", "validation", "run_dir",
                      "checkpoint", "example", "reason", "metrics", "ended_by"]


def _arguments(fn) -> list[str]:
    out, starred = [], False
    for p in inspect.signature(fn).parameters.values():
        if p.kind is p.KEYWORD_ONLY and not starred:
            out.append("*")
            starred = True
        out.append(p.name)
    return out


def test_the_python_api_is_pinned():
    import grpo_sdk

    assert sorted(grpo_sdk.__all__) == sorted(TOP_LEVEL_NAMES)
    for name, arguments in API_SIGNATURES.items():
        assert _arguments(getattr(grpo_sdk, name)) == arguments, name
    assert [f.name for f in attrs.fields(grpo_sdk.RunSummary)] == RUN_SUMMARY_FIELDS
    assert _arguments(grpo_sdk.Trainer.train) == ["self"]
    text = (DOCS / "compatibility.md").read_text()
    section = re.search(r"<!-- python-api.*?-->(.*?)<!-- /python-api -->", text, re.DOTALL)
    assert section, "docs/compatibility.md lost its python-api list"
    assert sorted(set(re.findall(r"`(\w+)`", section.group(1)))) == sorted(TOP_LEVEL_NAMES)
