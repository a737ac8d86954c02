"""Entry-point targets and config classes of the built-in environments.

Capability ``generates_prompts``: the environment implements ``sample_prompts(n, rng)``, so a run
needs no dataset (synthetic tasks), for training or validation.
"""

from __future__ import annotations

from typing import Any, Literal

import attrs

from grpo_sdk.environments.callables import FUNCTION_ENTRY, LOCAL_REFERENCE, resolve
from grpo_sdk.plugins import option
from grpo_sdk.plugins.toolkit import MAX_THREADS, MAX_TOKENS, MasterConfig
from grpo_sdk.plugins import ComponentSpec


@attrs.frozen(kw_only=True)
class ReverseDigitsConfig:
    num_digits: int = option(5, "Length of the digit strings to reverse; 8 is a harder variant.",
                             validator=[attrs.validators.gt(0), attrs.validators.le(10_000)])  # a prompt must fit a context
    format_weight: float = option(0.0, "Share of the reward given to the answer's format (exactly num_digits "
                                  "digits), as a second component `format`; `correct_digits` gets the rest. "
                                  "0 reports `correct_digits` alone; 0.1 gives gdpo two components.",
                                  validator=[attrs.validators.ge(0.0), attrs.validators.lt(1.0)])

    def num_reward_components(self) -> int:
        return 2 if self.format_weight > 0 else 1


REVERSE_DIGITS = ComponentSpec(
    name="reverse_digits",
    kind="environment",
    impl="grpo_sdk.environments.reverse_digits:ReverseDigitsEnvironment",
    config="grpo_sdk.environments.specs:ReverseDigitsConfig",
    capabilities={"generates_prompts"},
    metrics={"exact_match", "format_fraction"},
    summary="Synthetic task: reverse a digit string; partial credit per correct position (and, with "
            "format_weight, a format component).",
)


@attrs.frozen(kw_only=True)
class MathEnvConfig:
    answer_key: str = option("answer", "Key of the gold answer in each row's metadata (a number, a LaTeX "
                             "expression, or a GSM8K solution ending in '#### <answer>').")
    plain_answer_fallback: bool = option(True, "When a response has no \\boxed{} answer, take its plain final "
                                         "answer: after the last '####', else after the last 'answer is' / "
                                         "'answer:', else its last number. False: only \\boxed{} counts.")
    timeout_seconds: int = option(5, "Seconds math-verify may spend parsing or comparing one answer; one that "
                                  "runs out scores 0 (a pathological expression cannot stall the run).",
                                  validator=attrs.validators.gt(0))
    num_workers: int = option(0, "Processes that score responses in parallel; 0 scores in the calling process. "
                              "math-verify's timeouts need the main thread, so a call from another thread "
                              "uses one worker process even when this is 0.",
                              validator=[attrs.validators.ge(0), attrs.validators.le(MAX_THREADS)])


MATH = ComponentSpec(
    name="math",
    kind="environment",
    impl="grpo_sdk.environments.math_env:MathEnvironment",
    config="grpo_sdk.environments.specs:MathEnvConfig",
    requires=("math-verify>=0.7",),
    extra="math",
    metrics={"extracted_fraction", "boxed_fraction"},
    summary="Math word problems: reward 1 when the final answer (\\boxed{} or plain) equals the gold answer "
            "under math-verify.",
)


NO_FUNCTIONS = "is empty: name at least one reward function as 'module:function', e.g. [my_rewards:correctness]"


def _check_functions(instance: Any, attribute: Any, value: list[str]) -> None:
    # An empty list is check_reward_functions' to report: attrs validates an absent key's default
    # too, and would name the block rather than the key.
    bad = [entry for entry in value if not (FUNCTION_ENTRY.match(entry) or LOCAL_REFERENCE.match(entry))]
    if bad:
        raise ValueError(f"{', '.join(map(repr, bad))} {'is' if len(bad) == 1 else 'are'} not 'module:function' "
                         "(a module importable from the current directory or an installed package, and a "
                         "function in it), e.g. my_rewards:correctness")


@attrs.frozen(kw_only=True)
class RewardFunctionsConfig:
    functions: list[str] = option(factory=list, validator=_check_functions, help=(
        "Reward functions, each 'module:function' (the module importable from the current directory or an "
        "installed package), called as fn(prompts, completions, **columns) -> one float (or None) per "
        "completion; each is a reward component named after the function."))
    weights: list[float] | None = option(None, "Weight of each function's reward, in the order of functions; "
                                         "null weighs all 1.0. The total reward is the weighted sum.")

    def num_reward_components(self) -> int:
        return len(self.functions)


def check_reward_functions(config: MasterConfig, options: RewardFunctionsConfig | None,
                           registry: Any) -> list[tuple[str, str]]:
    if options is None or not options.functions:  # a default is not validated: an absent key lands here
        return [("env.reward_functions.functions", NO_FUNCTIONS)]
    return function_problems(options.functions, options.weights, "env.reward_functions.functions",
                             "env.reward_functions.weights")


def function_problems(functions: list[str], weights: list[float] | None, key: str,
                      weights_key: str) -> list[tuple[str, str]]:
    """What is wrong with a list of reward functions and their weights (``functions[i]`` at
    ``key[i]``): the environments that call such functions share it."""
    problems = []
    if weights is not None and len(weights) != len(functions):
        problems.append((weights_key, f"{len(weights)} weights for {len(functions)} functions ({key}); give one "
                         "weight per function, in the same order, or null for all 1.0"))
    from grpo_sdk.plugins import ConfigError, PluginError

    for i, entry in enumerate(functions):
        at = f"{key}[{i}]"
        try:
            # Imported now, so `config validate` and the start of `run` find a missing module or
            # function, not the first step after the model loaded.
            resolve(entry, at)
        except ConfigError as exc:
            problems.extend((at, message) for _, message in exc.problems)
        except PluginError as exc:  # the user's module raised while it was imported
            problems.append((at, str(exc).removeprefix(f"{at}: ")))
    return problems


REWARD_FUNCTIONS = ComponentSpec(
    name="reward_functions",
    kind="environment",
    impl="grpo_sdk.environments.reward_functions:RewardFunctionsEnvironment",
    config="grpo_sdk.environments.specs:RewardFunctionsConfig",
    check="grpo_sdk.environments.specs:check_reward_functions",
    summary="Rewards from plain Python functions fn(prompts, completions, **columns) named 'module:function'; "
            "one weighted component each.",
)


# --- reward_model -----------------------------------------------------------------------------------

RM = "env.reward_model"


@attrs.frozen(kw_only=True)
class RewardModelConfig:
    model_name: str = option("", "The reward model: a local Hugging Face model directory (saved with save_pretrained) "
                             "or a hub name, loaded with AutoModelForSequenceClassification.")
    tokenizer_name: str | None = option(None, "Its tokenizer (directory or hub name); null: model_name's.")
    trust_remote_code: bool = option(False, "Let transformers run the model's own code (some reward models, e.g. "
                                     "ArmoRM, need it). Only for a model you trust.")
    format: Literal["auto", "chat_template", "pair", "text"] = option(
        "auto", "How a (prompt, response) pair becomes one input: `chat_template` renders the conversation up to and "
        "including the last assistant message with the reward model's chat template; `pair` is the tokenizer's "
        "text-pair encoding (prompt, response) with its own separator tokens (BERT/DeBERTa cross-encoders); `text` "
        "is prompt + separator + response; `auto` is chat_template when the tokenizer has one, else text.")
    separator: str = option("\n", "format=text: what joins the prompt (and the prompt's messages) to the response.")
    label_index: int | None = option(None, "Which logit is the reward when the model has several labels (0-based); "
                                     "a one-label model's logit is the reward without it.",
                                     validator=attrs.validators.optional(attrs.validators.ge(0)))
    label_name: str | None = option(None, "The same by name, a key of the model config's label2id (e.g. "
                                    "'positive'); set at most one of label_index and label_name.")
    normalize: Literal["none", "sigmoid", "softmax"] = option(
        "none", "Transform of the chosen logit: `sigmoid` maps it to (0, 1); `softmax` is the probability of the "
        "chosen label over all labels (needs two or more).")
    scale: float = option(1.0, "The score is scale * normalized + shift.")
    shift: float = option(0.0, "See scale; e.g. shift: -5.0 centres a reward model whose logits sit near 5.")
    weight: float = option(1.0, "Weight of the `reward_model` component; the total reward is the weighted sum of "
                           "it and the rule_functions.")
    batch_size: int = option(8, "Inputs per forward pass of the reward model.",
                             validator=[attrs.validators.gt(0), attrs.validators.le(4096)])
    max_length: int = option(1024, "Tokens per input; longer inputs are cut (truncation_side) and counted in "
                             "env/truncated_fraction.", validator=[attrs.validators.gt(0), attrs.validators.le(MAX_TOKENS)])
    truncation_side: Literal["left", "right"] = option(
        "left", "Which end of a too long input is cut: `left` drops the start of the prompt and keeps the "
        "response's end, where GPT-style classifiers read the score; `right` drops the end.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = option(
        "auto", "Weights dtype: auto is bfloat16 on a GPU, float32 on the CPU.")
    device: Literal["auto", "cpu", "cuda"] = option(
        "auto", "Where the reward model runs: auto takes the device this process was given (the run's, in "
        "process; on Ray a GPU only when cluster.env_gpus_per_worker gives the actor one), else the CPU.")
    rule_functions: list[str] = option(factory=list, validator=_check_functions, help=(
        "Rule rewards beside the model, each 'module:function' as in env.reward_functions.functions; each is a "
        "reward component named after the function."))
    rule_weights: list[float] | None = option(None, "Weight of each rule function, in order; null weighs all 1.0.")

    def num_reward_components(self) -> int:
        return 1 + len(self.rule_functions)


def label_problems(options: RewardModelConfig, model_config: dict[str, Any]) -> list[tuple[str, str]]:
    """What is wrong with the label choice for a model whose config.json is ``model_config``."""
    id2label = model_config.get("id2label") or {}
    num_labels = len(id2label) or int(model_config.get("num_labels", 2))  # transformers' default is 2
    labels = ", ".join(f"{i}={id2label[i]!r}" for i in sorted(id2label, key=int)) if id2label else "unnamed"
    if options.label_index is not None and options.label_name is not None:
        return [(f"{RM}.label_name", "set label_index or label_name, not both")]
    if options.label_index is not None and options.label_index >= num_labels:
        return [(f"{RM}.label_index", f"{options.label_index} is out of range: the model has {num_labels} "
                 f"label(s) ({labels}); give 0..{num_labels - 1}")]
    if options.label_name is not None and options.label_name not in (model_config.get("label2id") or {}):
        return [(f"{RM}.label_name", f"{options.label_name!r} is not a label of the model; its labels: {labels}")]
    if num_labels > 1 and options.label_index is None and options.label_name is None:
        return [(f"{RM}.label_index", f"the model has {num_labels} labels ({labels}): say which logit is the "
                 "reward with label_index or label_name")]
    if num_labels == 1 and options.normalize == "softmax":
        return [(f"{RM}.normalize", "softmax over one label is always 1; use sigmoid or none")]
    return []


def classifier_problem(model_config: dict[str, Any]) -> str | None:
    """Why a config.json is not a sequence classifier's, or None (it is, or it does not say)."""
    architectures = model_config.get("architectures") or []
    auto_map = model_config.get("auto_map") or {}
    if not architectures or "AutoModelForSequenceClassification" in auto_map:
        return None
    if any(str(a).endswith("ForSequenceClassification") for a in architectures):
        return None
    return (f"holds a {', '.join(architectures)}, not a sequence classifier (an *ForSequenceClassification "
            "model); loading it as one would score with a randomly initialised head. Use a reward model")


def check_reward_model(config: MasterConfig, options: RewardModelConfig | None, registry: Any) -> list[tuple[str, str]]:
    """The model source, the label choice and the rule functions, from files only: no model is loaded."""
    import json
    from pathlib import Path

    from grpo_sdk.plugins import GrpoSdkError, PluginError
    from grpo_sdk.plugins.toolkit import check_model_source

    if options is None or not options.model_name:
        return [(f"{RM}.model_name", "is empty: name a reward model directory (or hub name)")]
    problems = []
    for key, name in ((f"{RM}.model_name", options.model_name), (f"{RM}.tokenizer_name", options.tokenizer_name)):
        try:
            if name:
                check_model_source(name, key=key)
        except PluginError:  # a package to install (a GGUF file's gguf): exit 3 with the install line
            raise
        except GrpoSdkError as exc:
            problems.append((key, str(exc).removeprefix(f"{key}: ")))
    path = Path(options.model_name).expanduser() / "config.json"
    if not problems and path.is_file():  # a hub name is checked when it loads
        try:
            model_config = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            return problems + [(f"{RM}.model_name", f"cannot read {path}: {exc}")]
        problem = classifier_problem(model_config)
        if problem:
            problems.append((f"{RM}.model_name", f"{options.model_name} {problem}"))
        problems += label_problems(options, model_config)
    return problems + function_problems(options.rule_functions, options.rule_weights, f"{RM}.rule_functions",
                                        f"{RM}.rule_weights")


REWARD_MODEL = ComponentSpec(
    name="reward_model",
    kind="environment",
    impl="grpo_sdk.environments.reward_model:RewardModelEnvironment",
    config="grpo_sdk.environments.specs:RewardModelConfig",
    check="grpo_sdk.environments.specs:check_reward_model",
    requires=("transformers>=4.50",),
    metrics={"truncated_fraction", "logit_mean"},
    summary="A Hugging Face sequence-classification reward model scores (prompt, response) pairs in batches; "
            "optional rule functions as further weighted components.",
)


def _check_hidden(instance: Any, attribute: Any, value: list[str]) -> None:
    bad = [p for p in value if not (p.startswith("/") or p.startswith("~")) or p.rstrip("/") in ("", "/tmp")]
    if bad:
        raise ValueError(f"{', '.join(map(repr, bad))}: each hidden path must be absolute (or start with ~), and "
                         "neither / nor /tmp (the sandbox's scratch space), e.g. [~, /data]")


@attrs.frozen(kw_only=True)
class CodeEnvConfig:
    tests_key: str = option("tests", "Key of the tests in each row's metadata: a list of test snippets (each one "
                            "test, e.g. 'assert add(1, 2) == 3', run after the code in its namespace) or one "
                            "string (a single test).", validator=attrs.validators.min_len(1))
    partial_credit: bool = option(False, "false: reward 1 when every test passes, else 0. true: the fraction of "
                                  "the tests that passed.")
    num_workers: int = option(4, "Snippets run at once (a sandboxed process each; starting one costs about 70 ms "
                              "beyond the interpreter's own start, docs/sandbox.md).",
                              validator=[attrs.validators.gt(0), attrs.validators.le(MAX_THREADS)])
    timeout_s: float = option(10.0, "Wall-clock seconds one snippet (its code and all its tests) may take; then "
                              "the whole sandbox is killed and the outcome is 'timeout'.",
                              validator=[attrs.validators.gt(0), attrs.validators.le(3600)])
    cpu_s: int = option(5, "CPU seconds each process of a snippet may use (RLIMIT_CPU: a process's threads "
                        "together); then 'killed', CPU limit.",
                        validator=[attrs.validators.gt(0), attrs.validators.le(3600)])
    memory_mb: int = option(1024, "Address space of each sandbox process, MiB (RLIMIT_AS); the interpreter "
                            "alone maps about 13, with numpy imported about 140.",
                            validator=[attrs.validators.ge(64), attrs.validators.le(1 << 20)])
    file_size_mb: int = option(16, "Largest file a snippet may write, MiB (RLIMIT_FSIZE).",
                               validator=[attrs.validators.ge(0), attrs.validators.le(1 << 20)])
    disk_mb: int = option(64, "Size of each private scratch tmpfs (/tmp, which holds the working directory, "
                          "/var/tmp, /dev/shm), MiB; it is memory, freed when the snippet ends.",
                          validator=[attrs.validators.gt(0), attrs.validators.le(1 << 20)])
    max_processes: int = option(8, "Processes and threads a snippet may have at once (RLIMIT_NPROC, for the "
                                "sandbox's own uid). Each may map memory_mb.",
                                validator=[attrs.validators.gt(0), attrs.validators.le(4096)])
    max_open_files: int = option(64, "Open file descriptors per sandbox process (RLIMIT_NOFILE).",
                                 validator=[attrs.validators.ge(16), attrs.validators.le(65536)])
    max_output_bytes: int = option(65536, "Bytes read of stdout and of stderr each; a snippet that writes more is "
                                   "killed ('killed', output limit).",
                                   validator=[attrs.validators.gt(0), attrs.validators.le(1 << 30)])
    network_isolation: Literal["required", "best_effort", "off"] = option("required", (
        "required: every snippet runs in a network namespace of its own (no interface but a down loopback), and the "
        "environment refuses to start where none can be made. best_effort: the same where the machine allows it. "
        "off: snippets share the trainer's network."))
    hidden_paths: list[str] = option(factory=lambda: ["~", "/run"], validator=_check_hidden, help=(
        "Directories a snippet sees as empty (an empty read-only tmpfs over each, in its mount namespace; the "
        "interpreter's own directories are bound back). ~ is the trainer's home; /run holds the machine's unix "
        "sockets, which a network namespace does not cover. Add your data and checkpoint directories."))
    python: str = option("", "Interpreter that runs the snippets; empty: the trainer's own (its installed "
                         "packages importable).")


CODE = ComponentSpec(
    name="code",
    kind="environment",
    impl="grpo_sdk.environments.code_env:CodeEnvironment",
    config="grpo_sdk.environments.specs:CodeEnvConfig",
    check="grpo_sdk.environments.code_env:check_code_env",
    metrics={"sandbox_passed", "sandbox_failed", "sandbox_timeout", "sandbox_killed", "sandbox_error",
             "test_pass_rate", "fenced_fraction"},
    summary="Python code scored against tests in a sandbox (a process each, resource limits, no network); reward 1 "
            "when every test passes (or the fraction passed).",
)


def _tool_parser(instance: Any, attribute: Any, value: str) -> None:
    if value not in ("hermes", "digits") and not FUNCTION_ENTRY.match(value):
        raise ValueError(f"{value!r} is not a parser: 'hermes', 'digits' or 'module:Class'")


@attrs.frozen(kw_only=True)
class CalculatorConfig:
    num_operands: int = option(3, "Numbers in each sum; the answer takes num_operands - 1 calls of add.",
                               validator=[attrs.validators.ge(2), attrs.validators.le(8)])
    modulus: int | None = option(10, "The tool and the answer work modulo this (operands below it); null: plain "
                                 "sums of operands from 0 to max_operand.",
                                 validator=attrs.validators.optional(attrs.validators.ge(2)))
    max_operand: int = option(99, "With modulus null: the largest operand.", validator=attrs.validators.ge(1))
    tool_parser: str = option("hermes", "How calls are written: 'hermes' (<tool_call> JSON, chat models), 'digits' "
                              "(the tiny model's: two digits are a call, one digit the answer; modulus <= 10), or "
                              "'module:Class' of a parser.", validator=_tool_parser)
    reward: Literal["outcome", "reference"] = option(
        "outcome", "'outcome': the answer's correct digit positions; 'reference' (tool_parser digits): each turn "
        "scored against the reference solution's turn, a process reward (docs/tools.md).")


def check_calculator(config: MasterConfig, options: CalculatorConfig | None, registry: Any) -> list[tuple[str, str]]:
    options = options or CalculatorConfig()
    problems = []
    if options.reward == "reference" and options.tool_parser != "digits":
        problems.append(("env.calculator.reward", "'reference' compares each turn with the solution's, token by "
                         "token, which needs tool_parser 'digits'; use reward 'outcome' with other parsers"))
    if options.tool_parser == "digits" and (options.modulus is None or options.modulus > 10):
        problems.append(("env.calculator.tool_parser", "'digits' writes every operand and result as one digit: set "
                         "env.calculator.modulus to at most 10"))
    return problems


CALCULATOR = ComponentSpec(
    name="calculator",
    kind="environment",
    impl="grpo_sdk.environments.calculator:CalculatorEnvironment",
    config="grpo_sdk.environments.specs:CalculatorConfig",
    check="grpo_sdk.environments.specs:check_calculator",
    capabilities={"generates_prompts", "multi_turn", "tool_calls"},
    metrics={"tool_calls_per_turn", "invalid_call_rate", "tool_error_rate", "answer_rate"},
    summary="Tool use: multi-step sums with a two-operand add tool (calls in Hermes JSON, or the tiny model's "
            "two-digit calls); the built-in tool-calling example.",
)


# --- agent -------------------------------------------------------------------------------------------

from grpo_sdk.plugins import AgentTask, EndpointConfig  # noqa: E402 - the agent block's own imports

AGENT_KEY = "env.agent.agent"


@attrs.frozen(kw_only=True)
class AgentHarnessConfig:
    agent: str = option("", "The agent that plays each rollout: 'module:function' (called with an AgentTask, "
                        "in a thread pool; awaited if it is async) or an http(s):// URL the task is POSTed to as "
                        "JSON. It talks to the policy at task.base_url and returns its reward (docs/agents.md).")
    max_concurrency: int = option(64, "Rollouts played at once (threads, or concurrent coroutines).",
                                  validator=[attrs.validators.gt(0), attrs.validators.le(4096)])
    timeout_s: float = option(600.0, "Seconds one rollout may take; past it the rollout fails "
                              "(env.on_reward_error) and its agent's further requests are refused.",
                              validator=attrs.validators.gt(0))
    endpoint: EndpointConfig = option(factory=EndpointConfig, help="The rollout endpoint the agents talk to.")


def check_agent(config: MasterConfig, options: AgentHarnessConfig | None, registry: Any) -> list[tuple[str, str]]:
    target = "" if options is None else options.agent
    if not target:
        return [(AGENT_KEY, "name the agent: 'module:function' or an http(s):// URL (docs/agents.md)")]
    if target.startswith(("http://", "https://")):
        return []
    if ":" not in target:
        return [(AGENT_KEY, f"{target!r} is neither 'module:function' nor an http(s):// URL")]
    from grpo_sdk.plugins import ConfigError, PluginError

    try:
        resolve(target, AGENT_KEY)  # imported now: a missing module is found before the model loads
    except ConfigError as exc:
        return list(exc.problems)
    except PluginError as exc:
        return [(AGENT_KEY, str(exc))]
    return []


AGENT = ComponentSpec(
    name="agent",
    kind="environment",
    impl="grpo_sdk.environments.agent_harness:AgentHarness",
    config="grpo_sdk.environments.specs:AgentHarnessConfig",
    check="grpo_sdk.environments.specs:check_agent",
    capabilities={"runs_agents"},
    summary="Any agent plays the rollouts over the OpenAI-compatible rollout endpoint (a Python function, async "
            "or not, or an HTTP service) and returns the reward; episodes are built from the tokens it sampled.",
)
