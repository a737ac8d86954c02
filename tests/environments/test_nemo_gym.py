"""The ``nemo_gym`` environment: NeMo-Gym's own servers (nemo-gym 0.4.0, its Python 3.12 venv) play rollouts.

Two parts. Without NeMo-Gym: the row -> ``/run`` body and ``/run`` answer -> ``AgentResult``
conversions over a recorded answer (``fixtures/nemo_gym/run_response.json``: real NeMo-Gym 0.4.0
simple_agent + vllm_model + a resources server, the model a stub; nulls dropped), the config
errors, a server that cannot start. With NeMo-Gym
(marker ``nemo_gym``, skipped when its venv is absent; ``.ci/nemo-gym-lane`` builds it and runs
them): ``grpoctl run`` on the tiny model with the shipped calculator resources server for 3 steps,
with NeMo-Gym's own example_single_tool_call for 2, a resources server that does not start, and
``/run`` past its timeout.
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
import time
from pathlib import Path

import pytest

from helpers import run_grpoctl
from grpo_sdk.environments.nemo_gym import protocol
from grpo_sdk.environments.nemo_gym.servers import (AGENT, MODEL, RESOURCES, GymServerError, GymServers, agent_spec,
                                                    config_dict, model_spec, resources_spec)
from grpo_sdk.environments.nemo_gym_spec import check_python, default_python
from grpo_sdk.plugins import AgentResult, AgentTask, GrpoSdkError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "nemo_gym"
GYM_PYTHON = default_python()
GYM_MISSING = check_python(GYM_PYTHON, configured=False)
# Only in the NeMo-Gym lane, which names the venv (the main lane would otherwise run them again,
# ~80 s, wherever a cached venv exists).
LANE = bool(os.environ.get("GRPO_SDK_NEMO_GYM_PYTHON"))
needs_gym = pytest.mark.skipif(GYM_MISSING is not None or not LANE,
                               reason=f"the NeMo-Gym lane runs these (.ci/nemo-gym-lane builds NeMo-Gym's venv and sets "
                                      f"GRPO_SDK_NEMO_GYM_PYTHON){f': {GYM_MISSING}' if GYM_MISSING else ''}")

ADD_TOOL = {"type": "function", "name": "add", "description": "Add two integers.", "strict": True,
            "parameters": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                           "required": ["x", "y"], "additionalProperties": False}}


def task(row: dict, *, prompt: str = "7+5+3>", messages=None, group: int = 0, index: int = 0) -> AgentTask:
    return AgentTask(session_id=f"s{group}-{index}", base_url="http://127.0.0.1:1/sessions/s/v1",
                     endpoint_url="http://127.0.0.1:1/v1", api_key="EMPTY", model="policy", prompt=prompt,
                     messages=messages, row=row, max_tokens=2, timeout_s=10.0, group=group, index=index)


def recorded() -> dict:
    return json.loads((FIXTURES / "run_response.json").read_text())


# --- rows and answers ----------------------------------------------------------------------------------


def test_a_row_goes_to_run_as_written_with_the_session_in_extra_body():
    row = {"responses_create_params": {"input": [{"role": "user", "content": "7+5+3>"}], "tools": [ADD_TOOL],
                                       "metadata": {"extra_body": json.dumps({"top_k": 5}), "tag": "a"}},
           "expected_answer": "5"}
    body = protocol.run_request(task(row))
    params = body["responses_create_params"]
    assert params["input"] == row["responses_create_params"]["input"] and params["tools"] == [ADD_TOOL]
    assert params["metadata"]["tag"] == "a"
    assert json.loads(params["metadata"]["extra_body"]) == {"top_k": 5, "session_id": "s0-0"}
    assert body["expected_answer"] == "5"
    assert row["responses_create_params"]["metadata"]["extra_body"] == json.dumps({"top_k": 5})  # the row is unchanged


def test_a_plain_or_conversational_row_gets_responses_create_params_built():
    body = protocol.run_request(task({"expected_answer": "5"}))
    assert body["responses_create_params"]["input"] == [{"role": "user", "content": "7+5+3>"}]
    messages = ({"role": "system", "content": "Add."}, {"role": "user", "content": "1+2"})
    body = protocol.run_request(task({}, messages=messages))
    assert body["responses_create_params"]["input"] == list(messages)
    with pytest.raises(GrpoSdkError, match="must be an object"):
        protocol.run_request(task({"responses_create_params": "hi"}))


def test_the_recorded_answer_becomes_the_rollouts_result():
    answer = recorded()
    result = protocol.agent_result(answer, use_reward_components=False, row_keys=("responses_create_params",))
    assert result.rewards == {"reward": 1.0}
    assert [len(t["generation_token_ids"]) for t in result.turns] == [7, 5]
    assert result.turns[1]["prompt_token_ids"][:3] == result.turns[0]["prompt_token_ids"]  # one conversation
    assert result.turns[0]["generation_log_probs"] == [-0.1, -0.2, -0.3, -0.4, -0.5, -0.6, -0.7]
    assert result.metrics == {"verify/reward_components/correct": 1.0, "verify/reward_components/used_tool": 1.0}
    assert result.info["output_tokens"] == 12
    named = protocol.agent_result(answer, use_reward_components=True)
    assert named.rewards == {"correct": 1.0, "used_tool": 1.0}


@pytest.mark.parametrize("change, message", [
    (lambda a: a.pop("response"), "no 'response'"),
    (lambda a: a.update(reward="1"), "not a number"),
    (lambda a: a.update(reward_components=[1]), "not an object"),
])
def test_an_answer_that_is_not_a_verify_response_fails_the_rollout(change, message):
    answer = recorded()
    change(answer)
    with pytest.raises(GrpoSdkError, match=message):
        protocol.agent_result(answer, use_reward_components=False)


def test_aggregate_request_is_stripped_as_nemo_gyms_rollout_collection_strips_it():
    answer = recorded()
    body = protocol.aggregate_request([answer], [task({}, group=3, index=1)])
    [entry] = body["verify_responses"]
    assert "responses_create_params" not in entry and entry["response"] == {"usage": answer["response"]["usage"]}
    assert (entry["_ng_task_index"], entry["_ng_rollout_index"], entry["reward"]) == (3, 1, 1.0)
    assert protocol.key_metrics({"key_metrics": {"mean/reward": 0.5, "name": "x", "n": True}}) == {
        "aggregate/mean/reward": 0.5, "aggregate/n": 1.0}


def test_handed_back_turns_take_the_endpoints_flags_for_the_same_tokens():
    from grpo_sdk.serving.sessions import Turn
    from grpo_sdk.rollouts.agent_rollouts import _turns

    seen = Turn(prompt_ids=(1, 2), generation_ids=(3, 4), logprobs=(-0.5, -0.25), versions=(7, 7),
                finish_reason="length", text="ab", flags=("invalid_tool_call",))
    result = AgentResult(rewards={"reward": 0.0}, turns=[
        {"prompt_token_ids": [1, 2], "generation_token_ids": [3, 4], "generation_log_probs": [-0.5, -0.25]},
        {"prompt_token_ids": [1, 2, 3, 4, 9], "generation_token_ids": [5], "generation_log_probs": [-1.0]}])
    first, second = _turns(result, [seen])
    assert first is seen and first.flags == ("invalid_tool_call",) and first.versions == (7, 7)
    assert second.flags == () and second.finish_reason == "stop"  # not recorded: the agent's copy


def test_the_config_dict_wires_the_three_servers_together():
    specs = [model_spec("http://127.0.0.1:9/v1", "EMPTY", "policy", {"uses_reasoning_parser": True}),
             resources_spec("builtin:calculator", {"modulus": 10}), agent_spec("simple_agent", 4, {})]
    config = config_dict(specs, {MODEL: 1, RESOURCES: 2, AGENT: 3})
    model = config[MODEL]["responses_api_models"]["vllm_model"]
    assert (model["base_url"], model["port"]) == ("http://127.0.0.1:9/v1", 1) and model["return_token_id_information"]
    assert model["uses_reasoning_parser"] is True  # model_server_config overrides
    assert config[RESOURCES]["resources_servers"]["grpo_calculator"]["modulus"] == 10
    agent = config[AGENT]["responses_api_agents"]["simple_agent"]
    assert agent["max_steps"] == 4 and agent["resources_server"] == {"type": "resources_servers", "name": RESOURCES}
    assert config["dry_run"] is False and "port" in config["head_server"]
    assert resources_spec("example_multi_step", {}).app == "resources_servers.example_multi_step"


def test_step_is_refused():
    from grpo_sdk.environments.nemo_gym.environment import NemoGymEnvironment

    with pytest.raises(GrpoSdkError, match="run_agents"):
        NemoGymEnvironment(None, None).step([], [])


# --- config errors: exit 2 at config time, no traceback ----------------------------------------------------


@pytest.mark.parametrize("overrides, key, message", [
    (["env.nemo_gym.python=/nonexistent/bin/python"], "env.nemo_gym.python", ".ci/nemo-gym-venv"),
    ([f"env.nemo_gym.python={sys.executable}"], "env.nemo_gym.python", "without nemo-gym"),
    (["env.nemo_gym.resources_server=nowhere/app.py"], "env.nemo_gym.resources_server", "no such file"),
    (["env.nemo_gym.agent=builtin:agent"], "env.nemo_gym.agent", "not built in"),
])
def test_bad_config_is_exit_2_naming_the_key(tmp_path, overrides, key, message):
    result = run_grpoctl("config", "validate", "env.name=nemo_gym", "data.train_path=rows.jsonl", "grpo.val_period=0",
                         "grpo.val_at_end=false", *overrides, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert f"{key}:" in result.stderr and message in result.stderr and "Traceback" not in result.stderr


def test_the_default_interpreter_missing_names_the_script_that_builds_it(tmp_path):
    result = run_grpoctl("config", "validate", "env.name=nemo_gym", "data.train_path=rows.jsonl", "grpo.val_period=0",
                         "grpo.val_at_end=false", cwd=tmp_path, GRPO_SDK_NEMO_GYM_PYTHON="",
                         GRPO_SDK_NEMO_GYM_VENV=str(tmp_path / "no-venv"))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"null means {tmp_path / 'no-venv' / 'bin' / 'python'}, which does not exist" in result.stderr
    assert ".ci/nemo-gym-venv" in result.stderr


def test_a_server_that_cannot_start_is_named_with_its_log(tmp_path):
    """This Python has no nemo-gym: launch.py fails at its import, and the error shows why."""
    servers = GymServers(Path(sys.executable), tmp_path / "logs", [resources_spec("builtin:calculator", {})],
                         startup_timeout_s=60)
    start = time.monotonic()
    with pytest.raises(GymServerError) as excinfo:
        servers.start()
    message = str(excinfo.value)
    assert "resources server (builtin:calculator) exited with code 1 while starting" in message
    assert "No module named 'nemo_gym'" in message and str(tmp_path / "logs" / f"{RESOURCES}.log") in message
    assert time.monotonic() - start < 30 and servers.procs == {}


# --- with NeMo-Gym ----------------------------------------------------------------------------------------


def write_rows(path: Path, n: int = 8, **extra) -> None:
    rng = random.Random(0)
    with open(path, "w") as f:
        for i in range(n):
            ops = [rng.randrange(10) for _ in range(3)]
            prompt = "+".join(map(str, ops)) + ">"
            row = {"prompt": prompt, "expected_answer": str(sum(ops) % 10),
                   "responses_create_params": {"input": [{"role": "user", "content": prompt}], "tools": [ADD_TOOL]}}
            f.write(json.dumps({**row, **{k: v(i) for k, v in extra.items()}}) + "\n")


RUN_YAML = """
policy:
  model_name: "builtin:tiny-gpt2"
  train_micro_batch_size: 8
  logprob_batch_size: 8
  max_total_sequence_length: 64
  generation: {{max_new_tokens: 2, temperature: 1.0}}
grpo: {{num_prompts_per_step: 2, num_generations_per_prompt: 4, max_num_steps: {steps}, val_period: 0,
        val_at_end: false, invalid_tool_call_advantage: -0.5, length_penalty: {{default: {{total_bonus: 0.1}}}},
        effort_levels: {{low_weight: 1.0, low_string: "<low>"}}}}
reward_penalties: {{penalize_empty_final_answer: true}}
loss_fn: {{reference_policy_kl_penalty: 0.0}}
data: {{train_path: rows.jsonl, shuffle: false}}
checkpointing: {{enabled: false}}
env:
  name: nemo_gym
  on_reward_error: {on_error}
  max_failed_fraction: 0.9
  nemo_gym:
    python: {python}
    resources_server: {resources}
    max_steps: 3
    timeout_s: {timeout}
    resources_server_config: {{modulus: 10, result_format: "={{result}}>"}}
    endpoint: {{tool_parser: "grpo_sdk.environments.calculator:DigitCalls"}}
logger: {{loggers: [jsonl]}}
"""


def gym_run(tmp_path: Path, *, steps: int = 3, resources: str = "builtin:calculator", timeout: float = 120,
            on_error: str = "raise", **rows) -> tuple[object, list[dict]]:
    write_rows(tmp_path / "rows.jsonl", **rows)
    (tmp_path / "run.yaml").write_text(RUN_YAML.format(steps=steps, python=GYM_PYTHON, resources=resources,
                                                       timeout=timeout, on_error=on_error))
    result = run_grpoctl("run", "-c", "run.yaml", "--run-dir", "run", cwd=tmp_path, timeout=400)
    metrics = tmp_path / "run" / "metrics.jsonl"
    rows_out = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    return result, [r for r in rows_out if "reward/mean" in r]


def gym_processes(log_dir: Path) -> list[int]:
    """Processes whose working directory is ``log_dir`` (the servers run there)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if Path(os.readlink(f"/proc/{pid}/cwd")) == log_dir:
                found.append(int(pid))
        except OSError:
            continue
    return found


@pytest.mark.nemo_gym
@needs_gym
def test_grpoctl_trains_the_tiny_model_through_nemo_gyms_servers(tmp_path):
    result, steps = gym_run(tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for row in steps:
        assert abs(row["token_mult_prob_error"] - 1.0) < 1e-3, row["token_mult_prob_error"]
        assert all(math.isfinite(v) for v in row.values() if isinstance(v, (int, float))), row
        assert "env/aggregate/mean/reward" in row and "env/verify/reward_components/used_tool" in row
        assert row["env/agent/failed"] == 0 and row["env/agent/broken_sessions"] == 0
        assert row["reward/num_failed"] == 0
        assert "reward_penalties/zeroed_fraction" in row and "length_penalty/env_reward_mean" in row
        assert row["effort/mean_length_high"] > 0  # no prompt is marked low-effort: measured, unchanged
    # The tiny random model's two-digit turns are add() calls NeMo-Gym's agent makes, the rest invalid:
    # the endpoint's invalid_tool_call flags reach the episodes through the handed-back turns.
    assert max(r["episode/turns_max"] for r in steps) >= 2
    assert 0 < max(r["episode/invalid_tool_call_rate"] for r in steps) <= 1
    assert sum(r["num_invalid_tool_calls"] for r in steps) > 0  # grpo.invalid_tool_call_advantage applied to them
    logs = tmp_path / "run" / "nemo_gym"
    assert {p.name for p in logs.iterdir()} == {f"{MODEL}.log", f"{RESOURCES}.log", f"{AGENT}.log"}
    assert "Application shutdown complete" in (logs / f"{AGENT}.log").read_text()
    assert gym_processes(logs) == []


BROKEN_APP = "raise RuntimeError('the test resources server refuses to start')\n"

SLOW_APP = """
import asyncio, importlib.util
spec = importlib.util.spec_from_file_location("grpo_calculator", {calculator!r})
calc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(calc)

class SlowVerifyRequest(calc.CalculatorVerifyRequest):
    slow: bool = False

class SlowServer(calc.CalculatorResourcesServer):
    async def verify(self, body: SlowVerifyRequest) -> calc.CalculatorVerifyResponse:
        if body.slow:
            await asyncio.sleep(120)
        return await super().verify(body)

if __name__ == "__main__":
    SlowServer.run_webserver()
"""


@pytest.mark.nemo_gym
@needs_gym
def test_a_resources_server_that_does_not_start_stops_the_run_naming_it(tmp_path):
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "app.py").write_text(BROKEN_APP)
    start = time.monotonic()
    result, steps = gym_run(tmp_path, resources=str(tmp_path / "broken" / "app.py"))
    assert result.returncode != 0 and steps == []
    assert "resources server" in result.stderr and "exited with code 1 while starting" in result.stderr
    assert "the test resources server refuses to start" in result.stderr  # the log's tail
    assert time.monotonic() - start < 120
    assert gym_processes(tmp_path / "run" / "nemo_gym") == []


@pytest.mark.nemo_gym
@needs_gym
@pytest.mark.parametrize("on_error", ["mask", "raise"])
def test_a_run_past_its_timeout_fails_the_rollout(tmp_path, on_error):
    from grpo_sdk.environments.nemo_gym.servers import APPS

    (tmp_path / "slow").mkdir()
    (tmp_path / "slow" / "app.py").write_text(SLOW_APP.format(calculator=str(APPS / "calculator.py")))
    result, steps = gym_run(tmp_path, steps=2, resources=str(tmp_path / "slow" / "app.py"), timeout=3,
                            on_error=on_error, slow=lambda i: i % 2 == 1)
    if on_error == "raise":
        assert result.returncode != 0, result.stderr[-2000:]
        assert "did not answer within 3 s (env.nemo_gym.timeout_s)" in result.stderr
    else:
        assert result.returncode == 0, result.stderr[-3000:]
        assert [r["reward/num_failed"] for r in steps] == [4, 4]  # one slow prompt of two, 4 rollouts each
        assert all(r["env/agent/failed"] == 4 and math.isfinite(r["token_mult_prob_error"]) for r in steps)
    assert gym_processes(tmp_path / "run" / "nemo_gym") == []


@pytest.mark.nemo_gym
@needs_gym
def test_a_resources_server_nemo_gym_ships_runs_by_name(tmp_path):
    """example_single_tool_call (a get_weather tool, reward 1 for any answer) from NeMo-Gym's package,
    on its own example rows (the system message left out: the tiny model has 64 positions)."""
    import subprocess

    probe = "import importlib.util as u; print(list(u.find_spec(%r).submodule_search_locations)[0])"
    server = subprocess.run([str(GYM_PYTHON), "-I", "-c", probe % "resources_servers.example_single_tool_call"],
                            capture_output=True, text=True, check=True).stdout.strip()
    with open(tmp_path / "rows.jsonl", "w") as f:
        for line in Path(server, "data", "example.jsonl").read_text().splitlines():
            row = json.loads(line)
            params = row["responses_create_params"]
            params["input"] = [m for m in params["input"] if m["role"] == "user"]
            f.write(json.dumps({**row, "prompt": params["input"][-1]["content"]}) + "\n")
    (tmp_path / "run.yaml").write_text(
        "policy: {model_name: 'builtin:tiny-gpt2', max_total_sequence_length: 64, generation: {max_new_tokens: 8}}\n"
        "grpo: {num_prompts_per_step: 2, num_generations_per_prompt: 2, max_num_steps: 2, val_period: 0, "
        "val_at_end: false}\n"
        "data: {train_path: rows.jsonl}\ncheckpointing: {enabled: false}\nlogger: {loggers: [jsonl]}\n"
        f"env: {{name: nemo_gym, nemo_gym: {{python: {GYM_PYTHON}, resources_server: example_single_tool_call}}}}\n")
    result = run_grpoctl("run", "-c", "run.yaml", "--run-dir", "run", cwd=tmp_path, timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if "reward/mean" in r]
    assert len(steps) == 2
    for row in steps:
        assert row["reward/mean"] == 1.0 and row["env/aggregate/mean/reward"] == 1.0
        assert abs(row["token_mult_prob_error"] - 1.0) < 1e-3
    assert gym_processes(tmp_path / "run" / "nemo_gym") == []


def test_a_native_nemo_gym_row_needs_no_prompt_key(tmp_path):
    """NeMo-Gym's JSONL rows have no prompt column: the prompt is the last user message of
    responses_create_params.input (NeMo-RL's rule), and the row reaches /run as written."""
    from grpo_sdk.data.prompts import PromptBuilder, load_prompts

    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"responses_create_params": {"input": [
        {"role": "system", "content": "Use the tool."}, {"role": "user", "content": "7+5+3>"}]},
        "expected_answer": "5"}) + "\n" + json.dumps({"responses_create_params": {"input": "1+1+1>"}}) + "\n")
    prompts = load_prompts(rows, prompt_key="prompt", builder=PromptBuilder(), max_prompt_tokens=None,
                           filter_long=False)
    assert [p.text for p in prompts] == ["7+5+3>", "1+1+1>"]
    assert prompts[0].metadata["responses_create_params"]["input"][0]["content"] == "Use the tool."
    rows.write_text(json.dumps({"responses_create_params": {"input": []}}) + "\n")
    with pytest.raises(Exception, match="no 'prompt' key"):
        load_prompts(rows, prompt_key="prompt", builder=PromptBuilder(), max_prompt_tokens=None, filter_long=False)
