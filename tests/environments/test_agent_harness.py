"""The agent harness (env.name=agent): any agent plays the rollouts over the rollout endpoint and
the trainer trains on the tokens the endpoint recorded (docs/agents.md).

End to end through ``grpoctl run`` on the tiny model: the plain-openai-client calculator agent of
examples/agents trains with exact token agreement; failing agents (raising, silent, too slow, a bad
return value) are masked or stop the run naming the rollout; an agent behind HTTP and an async
agent work; bad config is exit 2. Unit tests pin how an episode is built from a session's turns.
"""

from __future__ import annotations

import json
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from helpers import run_grpoctl
from grpo_sdk.core.agents import AgentResult, AgentTask
from grpo_sdk.environments.agent_harness import as_result
from grpo_sdk.serving.sessions import Turn

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "agents"
SMALL = ["grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=4", "policy.train_micro_batch_size=8",
         "policy.logprob_batch_size=8", "checkpointing.enabled=false"]

AGENTS = '''
import json, time, urllib.request

def post(task, messages):
    body = json.dumps({"model": task.model, "messages": messages, "max_tokens": 2}).encode()
    request = urllib.request.Request(task.base_url + "/chat/completions", data=body,
                                     headers={"Content-Type": "application/json",
                                              "Authorization": "Bearer " + task.api_key})
    return json.loads(urllib.request.urlopen(request, timeout=30).read())["choices"][0]

def two_turns(task):
    messages = [{"role": "user", "content": task.prompt}]
    first = post(task, messages)
    messages += [{"role": "assistant", "content": first["message"]["content"]}, {"role": "tool", "content": "=1>"}]
    post(task, messages)
    return {"reward": 0.25 * task.index, "metrics": {"my_metric": 2.0}}

def mixed(task):
    if task.index == 0:
        raise RuntimeError("the agent crashed on purpose")
    if task.index == 1:
        return 1.0  # never talked to the model
    if task.index == 2:
        post(task, [{"role": "user", "content": task.prompt}])
        return "high"  # not a reward
    return two_turns(task)

def slow(task):
    if task.index == 0:
        time.sleep(60)
    return two_turns(task)

async def async_agent(task):
    import asyncio
    return await asyncio.to_thread(two_turns, task)
'''


def rows_of(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
            if "reward/mean" in line]


def grpoctl(tmp_path: Path, *overrides: str, timeout: float = 300):
    (tmp_path / "agents_for_test.py").write_text(AGENTS)
    tasks = tmp_path / "tasks.jsonl"
    if not tasks.exists():
        tasks.write_text("".join(json.dumps({"prompt": f"{i}+{i}+1>", "operands": [i, i, 1]}) + "\n" for i in range(8)))
    return run_grpoctl("run", "--run-dir", "run", "env.name=agent",
                       "data.train_path=tasks.jsonl", "grpo.val_period=0", "grpo.val_at_end=false",
                       "policy.generation.max_new_tokens=2", "policy.max_total_sequence_length=48", *SMALL,
                       *overrides, cwd=tmp_path, timeout=timeout, PYTHONPATH=str(REPO))


@pytest.mark.slow
def test_the_openai_client_agent_trains_on_exactly_the_tokens_it_sampled(tmp_path):
    import subprocess
    import sys

    subprocess.run([sys.executable, str(EXAMPLE / "calculator_agent.py"), str(tmp_path / "tasks.jsonl")], check=True)
    result = grpoctl(tmp_path, "env.agent.agent=examples.agents.calculator_agent:run", "grpo.max_num_steps=2")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = rows_of(tmp_path / "run")
    assert len(rows) == 2
    for row in rows:
        assert abs(row["token_mult_prob_error"] - 1.0) < 1e-3  # what trained is what was sampled
        assert row["env/agent/failed"] == 0 and row["env/agent/broken_sessions"] == 0
        assert 1.0 <= row["episode/turns_mean"] <= 3.0
        assert all(math.isfinite(v) for v in row.values() if isinstance(v, float))


def test_failing_rollouts_are_masked_and_named(tmp_path):
    result = grpoctl(tmp_path, "env.agent.agent=agents_for_test:mixed", "grpo.max_num_steps=1",
                     "env.on_reward_error=mask", "env.max_failed_fraction=0.9")
    assert result.returncode == 0, result.stderr[-3000:]
    row = rows_of(tmp_path / "run")[0]
    # per group of 4: a crash, a silent agent, a bad reward, and one good rollout
    assert row["reward/num_failed"] == 6 and row["env/agent/failed"] == 6 and row["env/agent/no_turns"] == 2
    assert row["env/my_metric"] == 2.0  # the agents' metrics, averaged over the rollouts that reported them
    assert abs(row["token_mult_prob_error"] - 1.0) < 1e-3


def test_a_crashing_agent_stops_the_run_naming_the_rollout(tmp_path):
    result = grpoctl(tmp_path, "env.agent.agent=agents_for_test:mixed", "grpo.max_num_steps=1")
    assert result.returncode == 1
    assert "the agent crashed on purpose" in result.stderr and "session" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_a_stuck_agent_times_out_instead_of_hanging(tmp_path):
    start = time.monotonic()
    result = grpoctl(tmp_path, "env.agent.agent=agents_for_test:slow", "env.agent.timeout_s=3",
                     "grpo.max_num_steps=1", "env.on_reward_error=mask", timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert time.monotonic() - start < 60  # the sleeping agent (60 s) was abandoned, the process exited
    row = rows_of(tmp_path / "run")[0]
    assert row["reward/num_failed"] == 2


class _AgentServer(BaseHTTPRequestHandler):
    """An agent behind HTTP, as a team that runs its agent as a service would: it receives the task
    as JSON and plays it against the task's base_url."""

    def do_POST(self):  # noqa: N802
        task = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        messages = [{"role": "user", "content": task["prompt"]}]
        import urllib.request

        body = json.dumps({"model": task["model"], "messages": messages, "max_tokens": 2}).encode()
        reply = json.loads(urllib.request.urlopen(urllib.request.Request(
            task["base_url"] + "/chat/completions", data=body, headers={"Content-Type": "application/json"}),
            timeout=30).read())
        answer = json.dumps({"rewards": {"said_something": float(bool(reply["choices"][0]["message"]["content"])),
                                         "constant": 0.5}}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args):
        pass


def test_an_agent_behind_http_and_an_async_agent(tmp_path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _AgentServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        result = grpoctl(tmp_path, f"env.agent.agent=http://127.0.0.1:{server.server_address[1]}/run",
                         "grpo.max_num_steps=1")
    finally:
        server.shutdown()
    assert result.returncode == 0, result.stderr[-3000:]
    row = rows_of(tmp_path / "run")[0]
    assert row["reward/constant"] == 0.5 and 0.0 <= row["reward/said_something"] <= 1.0
    (tmp_path / "async").mkdir()
    result = grpoctl(tmp_path / "async", "env.agent.agent=agents_for_test:async_agent", "grpo.max_num_steps=1")
    assert result.returncode == 0, result.stderr[-3000:]
    row = rows_of(tmp_path / "async" / "run")[0]
    assert row["env/agent/failed"] == 0 and row["episode/turns_mean"] == 2.0


@pytest.mark.parametrize("agent, message", [
    ("", "name the agent"),
    ("no_such_module_anywhere:run", "no module"),
    ("agents_for_test", "neither 'module:function'"),
])
def test_bad_agent_config_is_exit_2_naming_the_key(tmp_path, agent, message):
    (tmp_path / "agents_for_test.py").write_text(AGENTS)
    result = run_grpoctl("config", "validate", "env.name=agent", f"env.agent.agent={agent}",
                         "data.train_path=x.jsonl", "grpo.val_period=0", "grpo.val_at_end=false", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "env.agent.agent" in result.stderr and message in result.stderr and "Traceback" not in result.stderr


# --- units -----------------------------------------------------------------------------------------


def test_what_an_agent_may_return():
    assert as_result(0.5).rewards == {"reward": 0.5}
    assert as_result({"a": 1.0, "b": None}).rewards == {"a": 1.0, "b": None}
    result = as_result({"reward": 1.0, "metrics": {"turns": 3}, "trace": "t1"})
    assert result.rewards == {"reward": 1.0} and result.metrics == {"turns": 3} and result.info == {"trace": "t1"}
    for bad in (None, True, "1.0", [1.0]):
        with pytest.raises(Exception, match="agent returned"):
            as_result(bad)


def _task(**kw):
    base = dict(session_id="s", base_url="u", endpoint_url="u", api_key="k", model="m", prompt="1+2>",
                messages=None, row={}, max_tokens=2, timeout_s=1.0, group=0, index=0)
    return AgentTask(**{**base, **kw})


class _Tok:
    def decode(self, ids):
        return "".join(chr(96 + i) for i in ids)


def _episode():
    from grpo_sdk.rollouts.episodes import Episode

    return Episode(prompt_ids=[1, 2], log=[], metadata={"k": 1}, source="row 1", chat=False)


def test_an_episode_is_its_sessions_tokens_with_the_loss_on_generated_ones():
    from grpo_sdk.rollouts.agent_rollouts import _fill

    turns = [Turn(prompt_ids=(1, 5, 6), generation_ids=(7, 8), logprobs=(-0.1, -0.2), versions=(3, 3),
                  finish_reason="length", text="gh"),
             Turn(prompt_ids=(1, 5, 6, 7, 8, 9, 9), generation_ids=(4, 2), logprobs=(-0.3, -0.4), versions=(4, 4),
                  finish_reason="stop", text="d", flags=("invalid_tool_call",))]
    episode, counts = _episode(), {"agent/no_turns": 0, "agent/broken_sessions": 0}
    assert _fill(episode, _task(), AgentResult(rewards={"r": 0.5, "none": None}), turns, _Tok(), counts) is None
    assert episode.prompt_ids == [1, 5, 6]  # the prompt the agent actually sent, not the dataset's
    assert episode.tokens == [7, 8, 9, 9, 4, 2]
    assert episode.generated == [True, True, False, False, True, True]
    assert episode.logprobs == [-0.1, -0.2, 0.0, 0.0, -0.3, -0.4]
    assert episode.versions == [3, 3, 3, 3, 4, 4]
    assert not episode.truncated and episode.rewards == {"r": 0.5} and episode.scored
    assert [m.role for m in episode.log] == ["user", "assistant", "environment", "assistant"]
    assert episode.log[-1].flags == ("invalid_tool_call",)


def test_a_session_that_is_not_one_conversation_fails_the_rollout():
    from grpo_sdk.rollouts.agent_rollouts import _fill

    turns = [Turn(prompt_ids=(1, 5), generation_ids=(7,), logprobs=(-0.1,), versions=(0,), finish_reason="stop"),
             Turn(prompt_ids=(1, 6), generation_ids=(8,), logprobs=(-0.1,), versions=(0,), finish_reason="stop")]
    counts = {"agent/no_turns": 0, "agent/broken_sessions": 0}
    failure = _fill(_episode(), _task(), AgentResult(rewards={"r": 1.0}), turns, _Tok(), counts)
    assert "not one conversation" in str(failure) and "turn 2" in str(failure) and counts["agent/broken_sessions"] == 1
    failure = _fill(_episode(), _task(), AgentResult(rewards={"r": float("nan")}), turns[:1], _Tok(), counts)
    assert "not a finite number" in str(failure)
    failure = _fill(_episode(), _task(), AgentResult(rewards={"r": 1.0}), [], _Tok(), counts)
    assert "no request" in str(failure) and counts["agent/no_turns"] == 1


def test_async_grpo_with_agents_records_each_turns_weight_version(tmp_path):
    """The endpoint serves the newest synced weights: with async GRPO (one step of staleness,
    in-flight updates) later steps train on turns sampled by newer weights, and every token
    carries the version that sampled it."""
    result = grpoctl(tmp_path, "env.agent.agent=agents_for_test:two_turns", "grpo.max_num_steps=4",
                     "grpo.async_grpo.enabled=true", "grpo.async_grpo.max_trajectory_age_steps=1",
                     "grpo.async_grpo.schedule=newest", "grpo.async_grpo.in_flight_weight_updates=true",
                     "loss_fn.use_importance_sampling_correction=true")
    assert result.returncode == 0, result.stderr[-3000:]
    versions = [row["generation/weight_version"] for row in rows_of(tmp_path / "run")]
    assert versions[0] == 0 and versions[-1] >= 2 and versions == sorted(versions)


@pytest.mark.slow
def test_agents_on_the_ray_runtime(tmp_path):
    """On Ray the policy and generation are actors; the agent environment is not (its agents reach
    the policy over HTTP, at the endpoint served where rollouts are collected)."""
    result = grpoctl(tmp_path, "env.agent.agent=agents_for_test:two_turns", "grpo.max_num_steps=2",
                     "cluster.runtime=ray")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = rows_of(tmp_path / "run")
    assert all(abs(r["token_mult_prob_error"] - 1.0) < 1e-3 and r["env/agent/failed"] == 0 for r in rows)
