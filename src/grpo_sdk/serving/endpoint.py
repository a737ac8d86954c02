"""The rollout endpoint: OpenAI requests in, the policy's samples out, every turn recorded.

``Endpoint`` is the logic behind the HTTP routes (``serving.server``): it renders a request to
token ids (a session's next turn continues its last turn's exact ids, ``serving.sessions``),
samples through the ``GenerationEngine``, cuts at stop strings, reads tool calls and flags the
malformed ones, records the ``Turn`` under the request's session and answers in the request's
shape (``serving.openai_api``).

Sampling follows the run in training (``sampling="run"``): the policy is trained on the
distribution the run samples from, so a request's temperature, top_p, top_k and seed are not
honoured there (counted in ``sampling_overridden``); its max_tokens (capped by the run's
max_new_tokens and the room left in policy.max_total_sequence_length) and stops are. Stand-alone
(``grpoctl serve``, ``sampling="request"``) a request's parameters are honoured.
"""

from __future__ import annotations

import threading
from typing import Any, Sequence

import attrs

from grpo_sdk.core.records import Message, SamplingParams
from grpo_sdk.serving.continuation import EnvironmentTurns
from grpo_sdk.serving.engine import GenerationEngine
from grpo_sdk.serving.openai_api import (TOKENS, BadRequest, Sampling, chat_answer, chat_messages, chat_tools,
                                         completion_answer, for_template, logprob_entries, response_input,
                                         responses_answer, sampling_of)
from grpo_sdk.serving.sessions import SessionLog, Turn

INVALID_TOOL_CALL = "invalid_tool_call"


@attrs.frozen(kw_only=True)
class EndpointSettings:
    """How the endpoint samples and what it allows."""

    model_name: str = "policy"
    sampling: str = "run"  # "run": the run's sampling parameters; "request": each request's
    defaults: SamplingParams = SamplingParams(max_new_tokens=256)  # the run's, or serve's defaults
    max_total_tokens: int = 4096  # prompt + generation of one turn
    request_timeout_s: float = 300.0
    tool_parser: str = "hermes"


class Endpoint:
    """Example (what the HTTP server calls)::

        endpoint = Endpoint(engine, tokenizer, EndpointSettings(model_name="tiny"))
        answer = endpoint.chat({"messages": [{"role": "user", "content": "7+5+3>"}]}, session="s1")
        endpoint.sessions.take("s1")     # [Turn(prompt_ids=..., generation_ids=..., logprobs=...)]
    """

    def __init__(self, engine: GenerationEngine, tokenizer: Any, settings: EndpointSettings):
        from grpo_sdk.plugins.tools import tool_call_parser

        self.engine = engine
        self.tokenizer = tokenizer
        self.settings = settings
        self.sessions = SessionLog()
        self.parser = tool_call_parser(settings.tool_parser, "tool_parser")
        self.chat_template = bool(getattr(tokenizer, "chat_template", None))
        self.turns = EnvironmentTurns(tokenizer)  # the same continuation multi-turn environments get
        self._lock = threading.Lock()  # the tokenizer and EnvironmentTurns' cache are not thread-safe
        self.sampling_overridden = 0
        self.vocab_size = len(tokenizer)

    # --- routes ----------------------------------------------------------------------------------

    def chat(self, body: dict[str, Any], session: str | None) -> dict[str, Any]:
        sampling = sampling_of(body, ("max_completion_tokens", "max_tokens"))
        messages, tools = chat_messages(body.get("messages")), chat_tools(body.get("tools"))
        turn, content, calls = self._serve_conversation(messages, tools, sampling, session)
        logprobs = self._logprobs(turn, sampling) if sampling.logprobs else None
        return chat_answer(turn, content, calls, self.settings.model_name, session, logprobs)

    def responses(self, body: dict[str, Any], session: str | None) -> dict[str, Any]:
        sampling = sampling_of(body, ("max_output_tokens",))
        messages, tools = response_input(body), chat_tools(body.get("tools"))
        turn, content, calls = self._serve_conversation(messages, tools, sampling, session)
        return responses_answer(turn, content, calls, self.settings.model_name, session)

    def completions(self, body: dict[str, Any], session: str | None) -> dict[str, Any]:
        sampling = sampling_of(body, ("max_tokens",))
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            with self._lock:
                ids = self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
        else:
            raise BadRequest("'prompt' must be a string or a list of token ids (one prompt per request)")
        turn = self._sample(ids, sampling, session, flags=())
        logprobs = self._logprobs(turn, sampling) if sampling.logprobs else None
        return completion_answer(turn, self.settings.model_name, session, self.tokenizer, logprobs)

    def tokenize(self, body: dict[str, Any]) -> dict[str, Any]:
        if "messages" in body:
            ids = self._render(chat_messages(body["messages"]), chat_tools(body.get("tools")),
                               generation_prompt=bool(body.get("add_generation_prompt", True)))
        elif isinstance(body.get("prompt"), str):
            with self._lock:
                ids = self.tokenizer(body["prompt"], add_special_tokens=bool(body.get("add_special_tokens", True)))[
                    "input_ids"]
        else:
            raise BadRequest("/tokenize needs 'prompt' (a string) or 'messages'")
        return {"tokens": ids, "count": len(ids), "max_model_len": self.settings.max_total_tokens}

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.settings.model_name, "object": "model", "owned_by": "grpo-sdk",
                                            "max_model_len": self.settings.max_total_tokens}]}

    # --- a conversation's turn ---------------------------------------------------------------------

    def _serve_conversation(self, messages: list[dict[str, Any]], tools: list[dict] | None, sampling: Sampling,
                            session: str | None) -> tuple[Turn, str, list[Any]]:
        ids, assistants = self._prompt(messages, tools, session)
        draft = self._sample(ids, sampling, session=None, flags=())
        parsed = self.parser.parse(draft.text) if tools else None
        flags = []
        if parsed is not None:
            names = {t["function"]["name"] for t in tools}
            if parsed.errors or any(c.name not in names for c in parsed.calls):
                flags.append(INVALID_TOOL_CALL)
        turn = attrs.evolve(draft, flags=tuple(flags), assistant_messages=assistants)
        if session is not None:
            self.sessions.record(session, turn)
        if parsed is None:
            return turn, turn.text, []
        return turn, parsed.content, list(parsed.calls)

    def _prompt(self, messages: list[dict[str, Any]], tools: list[dict] | None,
                session: str | None) -> tuple[list[int], int]:
        """The prompt's ids and the number of assistant messages it holds.

        A conversation that goes on after an assistant turn whose exact tokens are known continues
        those tokens: the session's last turn (the history has one more assistant message than that
        turn's request), or the ``prompt_token_ids`` + ``generation_token_ids`` the client sent back on
        its last assistant message (NeMo-Gym's model server does). Anything else is rendered."""
        assistants = sum(1 for m in messages if m["role"] == "assistant")
        last_assistant = next((i for i in range(len(messages) - 1, -1, -1) if messages[i]["role"] == "assistant"), None)
        if last_assistant is None or last_assistant == len(messages) - 1:
            return self._render(messages, tools, generation_prompt=True), assistants
        context: tuple[int, ...] | None = None
        last = self.sessions.last(session) if session is not None else None
        if last is not None and assistants == last.assistant_messages + 1:
            context, generated = last.context, last.generation_ids
            stopped = last.stop_token is not None  # a stop string's last token is no stop token
        elif TOKENS in messages[last_assistant]:
            prompt, generated = messages[last_assistant][TOKENS]
            context = prompt + generated
            stopped = bool(generated) and generated[-1] in {self.tokenizer.eos_token_id,
                                                            *self.settings.defaults.stop_token_ids}
        if context is None:
            return self._render(messages, tools, generation_prompt=True), assistants
        stop = generated[-1] if stopped and generated else None
        observation = [Message(role=m["role"], content=m["content"]) for m in messages[last_assistant + 1:]]
        with self._lock:
            continuation = self.turns.encode([(observation, stop, self.chat_template)])[0]
        return list(context) + continuation, assistants

    def _render(self, messages: list[dict[str, Any]], tools: list[dict] | None, generation_prompt: bool) -> list[int]:
        with self._lock:
            if not self.chat_template:  # plain text: the contents one after another (docs/agents.md)
                return self.tokenizer("".join(m["content"] for m in messages), add_special_tokens=True)["input_ids"]
            try:
                text = self.tokenizer.apply_chat_template(for_template(messages), tools=tools, tokenize=False,
                                                          add_generation_prompt=generation_prompt)
            except Exception as exc:  # noqa: BLE001 - Jinja's TemplateError, or whatever the template raises
                raise BadRequest(f"the chat template cannot render these messages: {type(exc).__name__}: {exc}") from None
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    # --- sampling ----------------------------------------------------------------------------------

    def _params(self, sampling: Sampling, prompt_tokens: int) -> SamplingParams:
        base, s = self.settings.defaults, self.settings
        room = s.max_total_tokens - prompt_tokens
        if room <= 0:
            # vLLM's wording: clients (NeMo-Gym's model server) recognise it and end the rollout
            raise BadRequest(f"This model's maximum context length is {s.max_total_tokens} tokens "
                             f"(policy.max_total_sequence_length); the prompt is {prompt_tokens} tokens: no room "
                             "left to generate")
        limit = min(sampling.max_tokens or base.max_new_tokens, room)
        stops = tuple(dict.fromkeys((*base.stop_token_ids, *sampling.stop_token_ids)))
        if s.sampling == "run":
            asked = {"temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
                     "seed": sampling.seed}
            if any(v is not None and v != getattr(base, k) for k, v in asked.items()):
                with self._lock:  # HTTP threads count at once
                    self.sampling_overridden += 1
            return attrs.evolve(base, max_new_tokens=min(limit, base.max_new_tokens), stop_token_ids=stops)
        temperature = base.temperature if sampling.temperature is None else sampling.temperature
        top_k = base.top_k if sampling.top_k is None else sampling.top_k
        if temperature == 0:  # greedy, as OpenAI reads it; backends divide by the temperature (NaN logprobs)
            temperature, top_k = 1.0, 1
        return SamplingParams(max_new_tokens=limit, stop_token_ids=stops, seed=sampling.seed, temperature=temperature,
                              top_p=base.top_p if sampling.top_p is None else sampling.top_p, top_k=top_k)

    def _sample(self, prompt_ids: Sequence[int], sampling: Sampling, session: str | None,
                flags: tuple[str, ...]) -> Turn:
        params = self._params(sampling, len(prompt_ids))
        bad = next((t for t in prompt_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:  # else the backend call fails for every request batched with this one
            raise BadRequest(f"token id {bad} is not a token of this model's tokenizer (0..{self.vocab_size - 1})")
        sampled = self.engine.generate(prompt_ids, params, timeout_s=self.settings.request_timeout_s)
        ids, logprobs, versions = sampled.ids, sampled.logprobs, sampled.versions
        stop_ids = {self.tokenizer.eos_token_id, *params.stop_token_ids}
        stopped = not sampled.truncated
        with self._lock:
            if sampling.stop:  # cut at the first stop string: the tokens after it were never "said"
                for n in range(1, len(ids) + 1):
                    text = self.tokenizer.decode(ids[:n], skip_special_tokens=False)
                    if any(s in text for s in sampling.stop):
                        ids, logprobs, versions, stopped = ids[:n], logprobs[:n], versions[:n], True
                        break
            stop_token = ids[-1] if stopped and ids and ids[-1] in stop_ids else None
            shown = ids[:-1] if stop_token is not None else ids
            text = self.tokenizer.decode(shown, skip_special_tokens=False)
        for s in sampling.stop:
            text = text.split(s, 1)[0]
        turn = Turn(prompt_ids=tuple(prompt_ids), generation_ids=tuple(ids), logprobs=tuple(logprobs),
                    versions=tuple(versions), finish_reason="stop" if stopped else "length", text=text, flags=flags,
                    stop_token=stop_token)
        if session is not None:
            self.sessions.record(session, turn)
        return turn

    def _logprobs(self, turn: Turn, sampling: Sampling) -> list[dict]:
        with self._lock:
            return logprob_entries(self.tokenizer, turn.generation_ids, turn.logprobs, sampling.token_ids_as_text)
