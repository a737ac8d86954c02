"""The rollout endpoint (serving/): real HTTP on 127.0.0.1, the ``openai`` client and the tiny model.

Three servers, each built once per module: ``tiny`` (HFGeneration over the tiny model, one engine
behind a sampling="run" and a sampling="request" endpoint), ``chat`` (the tiny tokenizer extended
to printable ASCII with a ChatML template that renders tools, over a scripted fake backend: the
random model never writes a tool call) and ``scripted`` (the tiny tokenizer over a scripted fake
backend that blocks or raises on demand: queue, deadline and backend failures). Every HTTP call
has a timeout; the openai clients never retry.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import string
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from types import SimpleNamespace

import openai
import pytest
import torch

from grpo_sdk.config.loading import load_config
from grpo_sdk.config.context import RunContext
from grpo_sdk.core.errors import ConfigError
from grpo_sdk.core.models import load_tokenizer
from grpo_sdk.core.records import GenerationOutput, Message, SamplingParams
from grpo_sdk.serving import server as server_module
from grpo_sdk.serving.continuation import EnvironmentTurns  # what the trainer's multi-turn episodes continue with
from grpo_sdk.serving.endpoint import INVALID_TOOL_CALL, Endpoint, EndpointSettings
from grpo_sdk.serving.engine import GenerationEngine
from grpo_sdk.serving.server import RolloutServer
from grpo_sdk.serving.sessions import SessionLog

TIMEOUT = 30.0  # seconds, every HTTP call
USER = [{"role": "user", "content": "7+5+3>"}]
CHATML = ("{%- if tools %}<|im_start|>system\n# Tools\n{% for t in tools %}{{ t.function | tojson }}\n{% endfor %}"
          "<|im_end|>\n{% endif %}{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
          "{%- for c in m.tool_calls or [] %}<tool_call>{\"name\": \"{{ c.function.name }}\", \"arguments\": "
          "{{ c.function.arguments | tojson }}}</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
          "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
ADD = {"name": "add", "description": "Add a and b", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}
CALL = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'


@contextmanager
def serving(endpoint, **kwargs):
    server = RolloutServer(endpoint, **kwargs)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def call(url, body=None, *, raw=None, headers=None):
    """(status, JSON body) of a GET (no body) or POST."""
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def client(url, **kwargs):
    return openai.OpenAI(base_url=url, api_key=kwargs.pop("api_key", "unused"), timeout=TIMEOUT, max_retries=0,
                         **kwargs)


def extra(obj):  # the fields the openai client does not know (the turn's tokens)
    return obj.model_extra


def ids_of(tok, text, special=False):
    return tuple(tok(text, add_special_tokens=special)["input_ids"])


class ScriptedGeneration:
    """A fake generation backend: answers every row with ``reply`` (cut at max_new_tokens), after
    ``gate`` is set (a slow backend when cleared); raises ``fail`` once when set (a broken one)."""

    def __init__(self, stops):
        self.stops, self.reply, self.fail = set(stops), [5, 6], None
        self.gate, self.entered = threading.Event(), threading.Event()
        self.gate.set()

    def generate(self, inputs, sampling):
        self.entered.set()
        self.gate.wait(TIMEOUT)
        if self.fail is not None:
            error, self.fail = self.fail, None
            raise error
        ids, rows = self.reply[:sampling.max_new_tokens], inputs.input_ids.shape[0]
        stopped = ids[-1] in self.stops | set(sampling.stop_token_ids)
        return GenerationOutput(response_ids=torch.tensor([ids] * rows), response_lengths=torch.full((rows,), len(ids)),
                                logprobs=torch.tensor([[-0.25 * (i + 1) for i in range(len(ids))]] * rows),
                                truncated=torch.full((rows,), not stopped))


@pytest.fixture(scope="module")
def tiny(tiny_model_dir, registry):
    from grpo_sdk.backends.hf.generation import HFGeneration

    config = load_config(None, [f"policy.model_name={tiny_model_dir}"], registry)
    generation = HFGeneration(None, RunContext(config=config, run_dir=tiny_model_dir, model_path=str(tiny_model_dir),
                                               tokenizer_path=str(tiny_model_dir), device="cpu", seed=0,
                                               needs_reference=False))
    calls, generate, submit, step = [], generation.generate, generation.submit, generation.sampler.step
    widest = [0]  # the most rows the continuous-batching sampler decoded at once

    def counted(inputs, sampling):  # every generate call: (rows, the SamplingParams the backend got)
        calls.append((inputs.input_ids.shape[0], sampling))
        return generate(inputs, sampling)

    def submitted(request_id, inputs, sampling):  # the engine streams: every request, as counted() counts
        calls.append((inputs.input_ids.shape[0], sampling))
        return submit(request_id, inputs, sampling)

    def stepped(between):
        widest[0] = max(widest[0], len(generation.sampler.rows) + len(generation.sampler.waiting))
        return step(between)

    generation.generate, generation.submit, generation.sampler.step = counted, submitted, stepped
    tok = load_tokenizer(str(tiny_model_dir))
    engine = GenerationEngine(generation, pad_token_id=tok.pad_token_id)
    engine.start()
    settings = dict(model_name="tiny", defaults=SamplingParams(max_new_tokens=6), max_total_tokens=64)
    run = Endpoint(engine, tok, EndpointSettings(**settings))
    own = Endpoint(engine, tok, EndpointSettings(sampling="request", **settings))
    with serving(run) as server, serving(own) as own_server:
        yield SimpleNamespace(tok=tok, engine=engine, ep=run, srv=server, own=own, own_srv=own_server, calls=calls,
                              widest=widest)
    engine.stop()


@pytest.fixture(scope="module")
def chat(tiny_model_dir):
    tok = load_tokenizer(str(tiny_model_dir))
    tok.add_tokens([c for c in string.printable if c not in tok.get_vocab() and c not in "\r\x0b\x0c"])
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML
    end = tok.convert_tokens_to_ids("<|im_end|>")
    generation = ScriptedGeneration({tok.eos_token_id})
    engine = GenerationEngine(generation, pad_token_id=tok.pad_token_id)
    engine.start()
    ep = Endpoint(engine, tok, EndpointSettings(model_name="chat", defaults=SamplingParams(
        max_new_tokens=128, stop_token_ids=(end,)), max_total_tokens=1024))

    def say(text, stop=True):  # the backend's next replies: the text's ids, then <|im_end|>
        generation.reply = [*ids_of(tok, text), *([end] if stop else [])]

    with serving(ep) as server:
        yield SimpleNamespace(tok=tok, ep=ep, srv=server, end=end, say=say)
    engine.stop()


@pytest.fixture(scope="module")
def scripted(tiny_model_dir):
    tok = load_tokenizer(str(tiny_model_dir))
    generation = ScriptedGeneration({tok.eos_token_id})
    engine = GenerationEngine(generation, pad_token_id=tok.pad_token_id, max_queue=1, batch_wait_s=0.0)
    engine.start()
    ep = Endpoint(engine, tok, EndpointSettings(defaults=SamplingParams(max_new_tokens=4), max_total_tokens=64,
                                                request_timeout_s=10.0))
    with serving(ep) as server:
        yield SimpleNamespace(tok=tok, gen=generation, engine=engine, ep=ep, srv=server,
                              url=server.base_url + "/chat/completions", body={"messages": USER})
    generation.gate.set()
    engine.stop()


def test_chat_answer_is_the_recorded_turn_with_token_logprobs(tiny):
    with client(tiny.srv.session_url("one")) as c:
        r = c.chat.completions.create(model="tiny", messages=USER, max_tokens=5, logprobs=True,
                                      extra_body={"return_tokens_as_token_ids": True})
    [turn] = tiny.ep.sessions.turns("one")
    message, ids = extra(r.choices[0].message), list(turn.generation_ids)
    assert turn.prompt_ids == ids_of(tiny.tok, "7+5+3>", special=True)
    assert message["generation_token_ids"] == ids and message["prompt_token_ids"] == list(turn.prompt_ids)
    assert message["generation_log_probs"] == list(turn.logprobs) and message["session_id"] == "one"
    assert extra(r)["prompt_token_ids"] == list(turn.prompt_ids) and r.usage.completion_tokens == len(ids)
    assert 1 <= len(ids) <= 5 and all(lp < 0 for lp in turn.logprobs)
    stopped = ids[-1] == tiny.tok.eos_token_id
    assert r.choices[0].finish_reason == turn.finish_reason == ("stop" if stopped else "length")
    assert stopped or len(ids) == 5
    assert r.choices[0].message.content == turn.text == tiny.tok.decode(ids[:-1] if stopped else ids)
    entries = r.choices[0].logprobs.content
    assert [e.token for e in entries] == [f"token_id:{t}" for t in ids]
    assert [e.logprob for e in entries] == list(turn.logprobs)


def test_seeded_request_mode_stop_token_and_stop_string(tiny):
    """sampling="request": a seed repeats the sample; a stop token is recorded, not shown; a stop
    string cuts the text before it and the recorded ids after it."""
    tok = tiny.tok
    with client(tiny.own_srv.session_url("seeded")) as c:
        def ask(**kwargs):
            r = c.chat.completions.create(model="tiny", messages=USER, max_tokens=6, seed=11, temperature=1.0, **kwargs)
            return r.choices[0], tiny.own.sessions.turns("seeded")[-1]

        (first, t1), (again, t2) = ask(), ask()
        ids = list(t1.generation_ids)
        assert t2.generation_ids == t1.generation_ids and again.message.content == first.message.content
        assert tiny.calls[-1][1].seed == 11 and len(ids) >= 3
        k = next(i for i in range(1, len(ids)) if ids[i] > 3 and ids[i] not in ids[:i])  # a character token
        choice, turn = ask(extra_body={"stop_token_ids": [ids[k]]})
        assert list(turn.generation_ids) == ids[:k + 1] and choice.finish_reason == "stop"
        assert choice.message.content == tok.decode(ids[:k])
        mark = tok.decode([ids[k]])
        j = next(i for i in range(len(ids)) if mark in tok.decode(ids[:i + 1]))
        choice, turn = ask(stop=[mark])
        assert list(turn.generation_ids) == ids[:j + 1] and choice.finish_reason == "stop"
        assert choice.message.content == tok.decode(ids[:j + 1]).split(mark)[0] and mark not in choice.message.content


def test_run_mode_keeps_the_runs_sampling_and_caps_max_tokens(tiny):
    ep, before = tiny.ep, tiny.ep.sampling_overridden
    with client(tiny.srv.base_url) as c, client(tiny.own_srv.base_url) as own:
        r = c.chat.completions.create(model="tiny", messages=USER, temperature=0.5, top_p=0.5, max_tokens=50)
        assert ep.sampling_overridden == before + 1
        sampling = tiny.calls[-1][1]
        assert (sampling.temperature, sampling.top_p, sampling.max_new_tokens) == (1.0, 1.0, 6)
        assert len(extra(r.choices[0].message)["generation_token_ids"]) <= 6
        c.chat.completions.create(model="tiny", messages=USER, temperature=1.0, max_tokens=2)
        assert ep.sampling_overridden == before + 1 and tiny.calls[-1][1].max_new_tokens == 2
        c.chat.completions.create(model="tiny", messages=USER, seed=3, max_tokens=2)
        assert ep.sampling_overridden == before + 2 and tiny.calls[-1][1].seed is None
        greedy = [own.chat.completions.create(model="tiny", messages=USER, temperature=0, max_tokens=4)
                  for _ in range(2)]
        sampling = tiny.calls[-1][1]
        assert (sampling.temperature, sampling.top_k) == (1.0, 1)  # temperature 0: greedy, not a division by 0
        [a, b] = [extra(r.choices[0].message) for r in greedy]
        assert a["generation_token_ids"] == b["generation_token_ids"] and set(a["generation_log_probs"]) == {0.0}
        own.chat.completions.create(model="tiny", messages=USER, temperature=0.5, max_tokens=2)
        assert tiny.calls[-1][1].temperature == 0.5 and tiny.own.sampling_overridden == 0
        own.chat.completions.create(model="tiny", messages=USER, max_tokens=500)  # capped by the room left: 64 - 7
        assert tiny.calls[-1][1].max_new_tokens == 57


def test_continuation_follows_the_sampled_tokens_not_the_agents_text(tiny):
    tok = tiny.tok
    with client(tiny.srv.session_url("edited")) as c:
        messages = list(USER)
        for observation in ("=12>", "+1>"):
            c.chat.completions.create(model="tiny", messages=messages, max_tokens=3)
            messages += [{"role": "assistant", "content": "XYZ"}, {"role": "user", "content": observation}]
        r = c.chat.completions.create(model="tiny", messages=messages, max_tokens=3)
    turns = tiny.ep.sessions.turns("edited")
    assert len(turns) == 3 and SessionLog.chain(turns) == (turns, None)
    assert turns[1].prompt_ids == turns[0].context + ids_of(tok, "=12>")
    assert turns[2].prompt_ids == turns[1].context + ids_of(tok, "+1>")
    assert extra(r)["prompt_token_ids"] == list(turns[2].prompt_ids)
    with client(tiny.srv.session_url("restarted")) as c:
        c.chat.completions.create(model="tiny", messages=USER, max_tokens=2)
        c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "abc>"}], max_tokens=2)
    turns = tiny.ep.sessions.turns("restarted")
    assert turns[1].prompt_ids == ids_of(tok, "abc>", special=True)
    kept, why = SessionLog.chain(turns)
    assert kept == turns[:1] and "turn 2's prompt does not extend turn 1" in why


def test_session_by_header_by_body_and_none(tiny):
    sessions = tiny.ep.sessions
    with client(tiny.srv.base_url, default_headers={"X-Session-Id": "by-header"}) as c:
        r = c.chat.completions.create(model="tiny", messages=USER, max_tokens=2)
    assert extra(r.choices[0].message)["session_id"] == "by-header"
    assert [list(t.generation_ids) for t in sessions.turns("by-header")] == [
        extra(r.choices[0].message)["generation_token_ids"]]
    with client(tiny.srv.base_url) as c:
        c.chat.completions.create(model="tiny", messages=USER, max_tokens=2, extra_body={"session_id": "by-body"})
        assert len(sessions.turns("by-body")) == 1
        count = len(sessions)
        r = c.chat.completions.create(model="tiny", messages=USER, max_tokens=2)
    assert len(sessions) == count and extra(r.choices[0].message)["session_id"] is None


def test_completions_responses_models_health_tokenize(tiny):
    tok, prompt = tiny.tok, list(ids_of(tiny.tok, "12+34>", special=True))
    with client(tiny.srv.session_url("routes")) as c:
        for given in ("12+34>", prompt):
            r = c.completions.create(model="tiny", prompt=given, max_tokens=4)
            turn = tiny.ep.sessions.turns("routes")[-1]
            assert turn.prompt_ids == tuple(prompt) and r.choices[0].text == turn.text
            assert extra(r.choices[0])["generation_token_ids"] == list(turn.generation_ids)
        r = c.responses.create(model="tiny", input="7+5>", max_output_tokens=3)
        turn = tiny.ep.sessions.turns("routes")[-1]
        assert turn.prompt_ids == ids_of(tok, "7+5>", special=True) and r.output_text == turn.text
        assert extra(r.output[-1])["generation_token_ids"] == list(turn.generation_ids)
        assert r.status == ("completed" if turn.finish_reason == "stop" else "incomplete")
        assert [(m.id, extra(m)["max_model_len"]) for m in c.models.list().data] == [("tiny", 64)]
    root = tiny.srv.root_url
    assert call(root + "/health") == (200, {"status": "ok", "queued": 0})
    assert call(root + "/sessions/x/v1/models")[1]["data"][0]["id"] == "tiny"
    assert call(root + "/tokenize", {"prompt": "12+3>"}) == (200, {"tokens": list(ids_of(tok, "12+3>", True)),
                                                                   "count": 6, "max_model_len": 64})
    messages = [{"role": "user", "content": "12"}, {"role": "tool", "content": "+3>"}]  # no template: the contents
    assert tuple(call(root + "/tokenize", {"messages": messages})[1]["tokens"]) == ids_of(tok, "12+3>", True)


def test_template_renders_tools_and_a_tool_result_continues_like_environment_turns(chat):
    tok, tools = chat.tok, [{"type": "function", "function": ADD}]
    system = f"<|im_start|>system\n# Tools\n{json.dumps(ADD)}\n<|im_end|>\n"
    status, answer = call(chat.srv.root_url + "/tokenize", {"messages": USER, "tools": tools})
    assert status == 200 and tuple(answer["tokens"]) == ids_of(
        tok, system + "<|im_start|>user\n7+5+3><|im_end|>\n<|im_start|>assistant\n")
    chat.say(CALL)
    with client(chat.srv.session_url("tool")) as c:
        r1 = c.chat.completions.create(model="chat", messages=USER, tools=tools)
        [made] = r1.choices[0].message.tool_calls
        assert r1.choices[0].finish_reason == "tool_calls" and made.function.name == "add"
        assert isinstance(made.function.arguments, str) and json.loads(made.function.arguments) == {"a": 1, "b": 2}
        chat.say("It is 3.")
        history = [*USER, r1.choices[0].message.model_dump(exclude_none=True),
                   {"role": "tool", "tool_call_id": made.id, "content": "3"}]
        r2 = c.chat.completions.create(model="chat", messages=history, tools=tools)
    t1, t2 = chat.ep.sessions.turns("tool")
    assert t1.generation_ids[-1] == chat.end and t1.flags == () and t1.finish_reason == "stop"
    continuation = EnvironmentTurns(tok).encode([([Message(role="tool", content="3")], chat.end, True)])[0]
    assert t2.prompt_ids == t1.context + tuple(continuation)
    # the sampled <|im_end|> is not written again: the turn's end, then the tool's message
    assert t2.prompt_ids == t1.context + ids_of(tok, "\n<|im_start|>tool\n3<|im_end|>\n<|im_start|>assistant\n")
    assert r2.choices[0].message.content == "It is 3." and r2.choices[0].message.tool_calls is None
    assert SessionLog.chain([t1, t2])[1] is None
    with client(chat.srv.base_url) as c:  # no session: the tokens the client sent back on its assistant message
        r3 = c.chat.completions.create(model="chat", messages=history, tools=tools)
    assert extra(r3)["prompt_token_ids"] == list(t2.prompt_ids)


def test_a_turn_cut_by_a_stop_string_is_closed_by_the_template(chat):
    """The stop string's last token ("<") is no stop token: the template's "<|im_end|>" is written whole."""
    chat.say("ab<cd", stop=False)
    with client(chat.srv.session_url("cut")) as c:
        r1 = c.chat.completions.create(model="chat", messages=USER, stop=["<"])
        history = [*USER, {"role": "assistant", "content": r1.choices[0].message.content},
                   {"role": "tool", "content": "3"}]
        c.chat.completions.create(model="chat", messages=history)
    t1, t2 = chat.ep.sessions.turns("cut")
    assert t1.generation_ids == ids_of(chat.tok, "ab<") and (t1.text, t1.finish_reason) == ("ab", "stop")
    assert t2.prompt_ids == t1.context + ids_of(
        chat.tok, "<|im_end|>\n<|im_start|>tool\n3<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("reply, cut", [('<tool_call>{"name": "add", "arguments": {"a": 1</tool_call>', 0),
                                        ('<tool_call>{"name": "mul", "arguments": {}}</tool_call>', 0),
                                        ('<tool_call>{"name": "add", "arguments": {}}</tool_call>', 13)])
def test_a_malformed_tool_call_is_flagged(chat, reply, cut):
    """Not JSON; a tool the request did not offer; a call never closed (cut by max_tokens)."""
    chat.say(reply, stop=False)
    tools, session = [{"type": "function", "function": ADD}], f"bad-{len(reply)}-{cut}"
    with client(chat.srv.session_url(session)) as c:
        r = c.chat.completions.create(model="chat", messages=USER, tools=tools, max_tokens=len(reply) - cut)
        [turn] = chat.ep.sessions.turns(session)
        assert turn.flags == (INVALID_TOOL_CALL,) and turn.text == reply[:len(reply) - cut]
        assert [t.function.name for t in r.choices[0].message.tool_calls or []] == (["mul"] if "mul" in reply else [])
        r = c.chat.completions.create(model="chat", messages=USER, max_tokens=len(reply))  # no tools: not read
    assert chat.ep.sessions.turns(session)[1].flags == () and r.choices[0].message.content == reply
    assert r.choices[0].message.tool_calls is None


def test_responses_function_call_items_round_trip(chat):
    tok, tools = chat.tok, [{"type": "function", **ADD}]  # the Responses API's flat tool shape
    chat.say(CALL)
    with client(chat.srv.session_url("resp")) as c:
        r1 = c.responses.create(model="chat", input="7+5+3>", tools=tools)
        [item] = r1.output
        assert item.type == "function_call" and item.name == "add" and json.loads(item.arguments) == {"a": 1, "b": 2}
        chat.say("15")
        items = [{"type": "message", "role": "user", "content": "7+5+3>"},
                 {"type": "function_call", "call_id": item.call_id, "name": "add", "arguments": item.arguments},
                 {"type": "function_call_output", "call_id": item.call_id, "output": "3"}]
        r2 = c.responses.create(model="chat", input=items, tools=tools)
        assert r2.output_text == "15" and r2.status == "completed"
    t1, t2 = chat.ep.sessions.turns("resp")
    assert extra(item)["generation_token_ids"] == list(t1.generation_ids)
    assert t2.prompt_ids == t1.context + ids_of(tok, "\n<|im_start|>tool\n3<|im_end|>\n<|im_start|>assistant\n")
    with client(chat.srv.base_url) as c:  # no session: the items rendered by the template, the call included
        r3 = c.responses.create(model="chat", input=items, instructions="Be brief.")
    assert tok.decode(extra(r3.output[-1])["prompt_token_ids"]) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n7+5+3><|im_end|>\n<|im_start|>assistant\n"
        f"{CALL}<|im_end|>\n<|im_start|>tool\n3<|im_end|>\n<|im_start|>assistant\n")


def assert_error(answer, status, kind, *fragments):
    got_status, body = answer
    assert got_status == status, body
    assert body["error"]["code"] == status and body["error"]["type"] == kind
    assert all(f in body["error"]["message"] for f in fragments), body


def test_bad_requests_are_answered_400_404_413(scripted, monkeypatch):
    url, body = scripted.url, scripted.body
    assert_error(call(url, raw=b'{"messages": ['), 400, "invalid_request_error", "not JSON")
    assert_error(call(url, [1]), 400, "invalid_request_error", "JSON object")
    assert_error(call(url, {**body, "n": 2}), 400, "invalid_request_error", "'n' must be 1")
    assert_error(call(url, {**body, "stream": True}), 400, "invalid_request_error", "'stream' is not supported")
    assert_error(call(url, {**body, "temperature": "hot"}), 400, "invalid_request_error", "'temperature'", "'hot'")
    assert_error(call(url, {"messages": [{"role": "user", "content": "1" * 80}]}), 400, "invalid_request_error",
                 "maximum context length is 64 tokens", "the prompt is 81 tokens")
    assert_error(call(scripted.srv.base_url + "/completions", {"prompt": [1, 7, 25]}), 400, "invalid_request_error",
                 "25")  # not a token of the tokenizer: it would fail the backend call of every request batched with it
    foreign = [*USER, {"role": "assistant", "content": "", "prompt_token_ids": [1], "generation_token_ids": [-4]},
               {"role": "user", "content": "1"}]
    assert_error(call(url, {"messages": foreign}), 400, "invalid_request_error", "-4")
    assert_error(call(url, {"messages": []}), 400, "invalid_request_error", "'messages'")
    assert_error(call(scripted.srv.base_url + "/embeddings", body), 404, "not_found", "POST /v1/embeddings")
    assert_error(call(scripted.srv.root_url + "/nothing"), 404, "not_found", "GET /nothing")
    monkeypatch.setattr(server_module, "MAX_BODY", 100)
    assert_error(call(url, {**body, "pad": "x" * 200}), 413, "invalid_request_error", "0..100 bytes")
    assert call(url, body)[0] == 200


def test_api_key_and_loopback_only_without_one(scripted):
    with serving(scripted.ep, api_key="s3cret") as server:
        assert_error(call(server.base_url + "/models"), 401, "authentication_error", "Bearer")
        assert_error(call(server.base_url + "/models", headers={"Authorization": "Bearer nope"}), 401,
                     "authentication_error")
        assert call(server.base_url + "/models", headers={"Authorization": "Bearer s3cret"})[0] == 200
        with client(server.base_url, api_key="s3cret") as c:
            assert c.chat.completions.create(model="policy", messages=USER).choices[0].message.content
        with client(server.base_url, api_key="wrong") as c, pytest.raises(openai.AuthenticationError):
            c.chat.completions.create(model="policy", messages=USER)
    stopper = threading.Thread(target=RolloutServer(scripted.ep).stop, daemon=True)  # never started
    stopper.start()
    stopper.join(5)
    assert not stopper.is_alive()
    for host in ("0.0.0.0", "192.0.2.7", "example.org"):
        with pytest.raises(ConfigError, match="without an API key"):
            RolloutServer(scripted.ep, host=host)


def test_full_queue_is_429_and_the_queued_requests_are_served(scripted):
    gen, engine = scripted.gen, scripted.engine
    gen.gate.clear()
    gen.entered.clear()
    try:
        with cf.ThreadPoolExecutor(2) as pool:
            generating = pool.submit(call, scripted.url, scripted.body)
            assert gen.entered.wait(10)
            queued = pool.submit(call, scripted.url, scripted.body)
            deadline = time.monotonic() + 10
            while engine.queued < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert_error(call(scripted.url, scripted.body), 429, "rate_limit_error", "queue is full")
            gen.gate.set()
            assert generating.result(TIMEOUT)[0] == 200 and queued.result(TIMEOUT)[0] == 200
    finally:
        gen.gate.set()


def test_deadlines_are_504_within_seconds(scripted):
    gen = scripted.gen
    impatient = Endpoint(scripted.engine, scripted.tok, EndpointSettings(
        defaults=SamplingParams(max_new_tokens=4), max_total_tokens=64, request_timeout_s=0.5))
    gen.gate.clear()
    try:
        with serving(impatient) as server, cf.ThreadPoolExecutor(2) as pool:
            url, start = server.base_url + "/chat/completions", time.monotonic()
            assert_error(call(url, scripted.body), 504, "timeout", "deadline of 0.5 s")  # stuck in the backend
            assert time.monotonic() - start < 5
            gen.gate.set()
            time.sleep(0.2)
            gen.gate.clear()
            gen.entered.clear()
            generating = pool.submit(call, url, scripted.body)
            assert gen.entered.wait(10)
            waiting = pool.submit(call, url, scripted.body)
            time.sleep(1.0)  # past the queued request's deadline, before the backstop of the generating one
            gen.gate.set()
            assert generating.result(TIMEOUT)[0] == 200
            assert_error(waiting.result(TIMEOUT), 504, "timeout", "waited in the queue")
    finally:
        gen.gate.set()


def test_backend_error_is_500_then_served_and_closed_engine_is_503(scripted):
    scripted.gen.fail = RuntimeError("the backend exploded")
    assert_error(call(scripted.url, scripted.body), 500, "server_error", "RuntimeError: the backend exploded")
    assert call(scripted.url, scripted.body)[0] == 200
    scripted.engine.close()
    try:
        assert_error(call(scripted.url, scripted.body), 503, "service_unavailable", "not serving")
        assert call(scripted.srv.root_url + "/health")[1]["status"] == "closed"
    finally:
        scripted.engine.open()
    assert call(scripted.url, scripted.body)[0] == 200


def test_64_concurrent_sessions_are_batched_and_chained(tiny):
    before = len(tiny.calls)

    def agent(i):
        with client(tiny.srv.session_url(f"agent-{i}")) as c:
            messages = [{"role": "user", "content": f"{i}+{i}>"}]
            for _ in range(3):
                r = c.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
                messages += [{"role": "assistant", "content": r.choices[0].message.content},
                             {"role": "user", "content": "=>"}]

    with cf.ThreadPoolExecutor(64) as pool:
        for done in [pool.submit(agent, i) for i in range(64)]:
            done.result(TIMEOUT * 2)
    for i in range(64):
        turns = tiny.ep.sessions.turns(f"agent-{i}")
        assert len(turns) == 3 and SessionLog.chain(turns) == (turns, None)
        assert turns[0].prompt_ids == ids_of(tiny.tok, f"{i}+{i}>", special=True)
        assert turns[2].prompt_ids[len(turns[1].context):] == ids_of(tiny.tok, "=>")
    calls = tiny.calls[before:]
    assert tiny.engine.streaming and sum(rows for rows, _ in calls) == 192
    assert tiny.widest[0] > 1  # one request per turn, decoded beside the others (continuous batching)
