"""Rewards from plain Python functions (TRL's ``reward_funcs``): the ``reward_functions`` environment.

A reward function scores a step's completions in one call::

    # my_rewards.py, next to the config
    def correctness(prompts, completions, answer, **kwargs):
        return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]

    # config
    env:
      name: reward_functions
      reward_functions:
        functions: [my_rewards:correctness, my_rewards:brevity]
        weights: [1.0, 0.1]            # null: all 1.0

* Arguments are passed by name: ``prompts`` and ``completions`` (one per sample), and one keyword
  list per column of the dataset rows besides the prompt (``answer`` above: the row's value for
  each sample, None where a row lacks it). A function with ``**kwargs`` gets every column; one
  without gets only the names it declares.
* Plain rows: ``prompts`` are the prompt texts as the model saw them, ``completions`` the response
  texts. Conversational rows (``messages``): ``prompts`` are the messages before the response, as
  ``{"role", "content"}`` dicts, and each completion is ``[{"role": "assistant", "content": text}]``.
  (A log is plain when its prompt is one user message carrying its token ids, as the trainer
  builds it for a text prompt.)
* It returns one number per completion, or None for "no reward" (the function does not apply to
  that sample): beside another function's score a None counts 0; a sample no function scored
  leaves the loss and is counted in ``reward/num_no_reward`` (``env/none_fraction/<name>`` is each
  function's share of None).
* Each function is a reward component named after it (``__name__``; ``correctness``,
  ``correctness_2`` if two share a name) whose value is ``weight * output``; the total reward is the
  sum. ``gdpo`` takes the components as they are and orders them alphabetically by name.
* ``async def`` functions run concurrently with each other (``asyncio.gather``) on an event loop
  of this environment's own thread, which lives as long as the environment (so an async client
  made once can be reused) and works when the caller already runs a loop (Jupyter).
* A function that raises fails the samples it is called on (the trainer retries each sample alone
  and names the one that fails, ``env.on_reward_error``); one that returns the wrong number of
  values stops the run naming it. A function that never returns is stopped by
  ``cluster.call_timeout_s``, the deadline of every environment call.

Where they run. Plain (``def``) functions run in the trainer's process, on its main thread, as TRL
calls them, whenever the training loop runs there (``grpoctl run`` and ``grpo_sdk.train`` with the
synchronous loop on the local runtime): so signal-based timeouts work (math-verify's ``parse`` and
``verify`` with their default timeouts, ``signal.alarm`` of your own), module globals and caches
persist from step to step and are the trainer's own, and a call costs nothing beyond the function.
The deadline is enforced by interrupting the main thread (``runtime/deadlines.py``): a function
stuck in Python or in a blocking system call (a socket read, a sleep) raises there and the run
stops with ``CallTimeout``'s error naming the sample; one stuck in native code that cannot be
interrupted ends the process with exit code 1, a message naming the call and every thread's stack,
a few seconds past the deadline. Elsewhere, functions run on a helper thread where signals cannot
reach them: the asynchronous loop's collector thread (``grpo.async_grpo.enabled``), where
math-verify's default timeouts raise "doesn't support threaded environment" (pass
``parsing_timeout=None``/``timeout_seconds=None``, or score with the ``math`` environment, whose
worker processes have a main thread). On Ray, environment actors call them in their own processes,
and the driver's deadline kills an actor that does not answer; Ray runs an actor's calls on its
main thread only with ``cluster.env_max_concurrency: 1`` (the default 4 uses a thread pool), so set
that (and ``cluster.env_workers`` for parallelism) for signal-based timeouts; ``callable:``
references cannot reach an actor.

Functions given as Python objects (``grpo_sdk.train(..., reward_funcs=[fn])``) go into the config
as text through ``callables.reference_for(fn)``: ``module:qualname`` when that import gives the
same object back, else a process-local ``callable:<name>#<n>`` that only this process can resolve.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from typing import Any, Callable, Sequence

import attrs

from grpo_sdk.environments.callables import name_of, resolve
from grpo_sdk.environments.specs import NO_FUNCTIONS, RewardFunctionsConfig
from grpo_sdk.plugins import ConfigError, EnvironmentReturn, EnvironmentStepError, MessageLog
from grpo_sdk.plugins.toolkit import background_event_loop

KEY = "env.reward_functions.functions"
RESERVED = ("prompts", "completions")  # argument names: a column of that name is not passed

class RewardFunctionError(Exception):
    """A reward function raised; the message names it (the trainer names the sample)."""


@attrs.frozen(kw_only=True)
class RewardFunction:
    entry: str  # as the config names it
    name: str  # the reward component's name
    fn: Callable[..., Any]
    weight: float
    takes_all: bool  # has **kwargs: every column
    accepts: frozenset[str]  # the names it declares
    required: frozenset[str]  # declared without a default

    @classmethod
    def of(cls, entry: str, name: str, fn: Callable[..., Any], weight: float, key: str) -> RewardFunction:
        try:
            parameters = inspect.signature(fn).parameters.values()
        except (TypeError, ValueError):  # some builtins have no signature: give them everything
            return cls(entry=entry, name=name, fn=fn, weight=weight, takes_all=True, accepts=frozenset(),
                       required=frozenset())
        positional = [p.name for p in parameters if p.kind is p.POSITIONAL_ONLY]
        if positional:
            raise ConfigError([(key, f"{entry!r}: parameter {positional[0]!r} is positional-only, but reward "
                                "functions are called by name (prompts=, completions=, and one keyword per column)")])
        named = [p for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        return cls(entry=entry, name=name, fn=fn, weight=weight,
                   takes_all=any(p.kind is p.VAR_KEYWORD for p in parameters),
                   accepts=frozenset(p.name for p in named),
                   required=frozenset(p.name for p in named if p.default is p.empty))

    def arguments(self, available: dict[str, list[Any]]) -> dict[str, list[Any]]:
        missing = sorted(self.required - set(available))
        if missing:
            columns = sorted(set(available) - set(RESERVED))
            raise EnvironmentStepError(f"reward function {self.name!r} ({self.entry}) needs "
                                       f"{', '.join(map(repr, missing))}, which the rows do not have; columns: "
                                       f"{columns}")
        return dict(available) if self.takes_all else {k: v for k, v in available.items() if k in self.accepts}


def _unique_names(names: Sequence[str]) -> list[str]:
    """``names`` with a repeated one numbered from its second use (``f``, ``f_2``), in order."""
    out: list[str] = []
    for name in names:
        candidate, n = name, 1
        while candidate in out:
            n += 1
            candidate = f"{name}_{n}"
        out.append(candidate)
    return out


def is_conversational(log: MessageLog) -> bool:
    """Whether a log came from a conversational row: its prompt is not one user message carrying the
    token ids the model saw (the trainer's log of a plain-text prompt)."""
    return not (len(log) == 2 and log[0].role == "user" and bool(log[0].token_ids))


def _inputs(message_logs: Sequence[MessageLog]) -> tuple[list[Any], list[Any]]:
    prompts, completions = [], []
    for log in message_logs:
        if is_conversational(log):
            prompts.append([{"role": m.role, "content": m.content} for m in log[:-1]])
            completions.append([{"role": "assistant", "content": log[-1].content}])
        else:
            prompts.append(log[0].content)
            completions.append(log[-1].content)
    return prompts, completions


def _columns(metadata: Sequence[dict[str, Any]]) -> dict[str, list[Any]]:
    names: dict[str, None] = {}  # every row's keys, in order of first appearance
    for meta in metadata:
        names.update(dict.fromkeys(meta))
    return {name: [meta.get(name) for meta in metadata] for name in names if name not in RESERVED}


def _weighted(value: Any, weight: float) -> Any:
    if value is None:
        return None
    try:
        return weight * float(value)
    except (TypeError, ValueError, OverflowError):
        return value  # text, a list...: the trainer reports it as not a number, naming the sample


class RewardFunctionsEnvironment:
    """Example::

        env = RewardFunctionsEnvironment(RewardFunctionsConfig(functions=["my_rewards:correctness"]), None)
        log = [Message(role="user", content="2+2=", token_ids=(1,)), Message(role="assistant", content="4")]
        env.step([log], [{"answer": "4"}]).rewards   # {"correctness": [1.0]}
    """

    def __init__(self, config: RewardFunctionsConfig | None, context: Any, *, key: str = KEY,
                 weights_key: str = "env.reward_functions.weights"):
        # key, weights_key: where errors point when another environment holds the functions
        # (reward_model's rule_functions).
        if config is None or not config.functions:
            raise ConfigError([(key, NO_FUNCTIONS)])
        self.config = config
        weights = config.weights if config.weights is not None else [1.0] * len(config.functions)
        if len(weights) != len(config.functions):  # the config check says so first; a direct caller too
            raise ConfigError([(weights_key, f"{len(weights)} weights for {len(config.functions)} functions")])
        found = [(entry, resolve(entry, f"{key}[{i}]")) for i, entry in enumerate(config.functions)]
        names = _unique_names([name_of(fn) for _, fn in found])
        self.functions = [RewardFunction.of(entry, name, fn, float(w), f"{key}[{i}]")
                          for i, ((entry, fn), name, w) in enumerate(zip(found, names, weights))]
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_lock = threading.Lock()

    def runs_on_main_thread(self) -> bool:
        """Yes: TRL-style functions call math-verify, whose timeouts need the main thread."""
        return True

    def step(self, message_logs: Sequence[MessageLog], metadata: Sequence[dict[str, Any]]) -> EnvironmentReturn:
        size = len(message_logs)
        prompts, completions = _inputs(message_logs)
        available = {"prompts": prompts, "completions": completions, **_columns(metadata)}
        outputs = self._call_all(available)
        rewards, metrics = {}, {}
        for rf in self.functions:
            values = _as_list(rf, outputs[rf.name], size)
            rewards[rf.name] = [_weighted(v, rf.weight) for v in values]
            metrics[f"none_fraction/{rf.name}"] = sum(v is None for v in values) / max(1, size)
        return EnvironmentReturn(rewards=rewards, metrics=metrics)

    def _call_all(self, available: dict[str, list[Any]]) -> dict[str, Any]:
        """Every function's output: plain ones in order, then every awaitable together."""
        outputs: dict[str, Any] = {}
        pending: dict[str, Any] = {}
        try:
            for rf in self.functions:
                try:
                    result = rf.fn(**rf.arguments(available))
                except EnvironmentStepError:
                    raise
                except Exception as exc:
                    raise RewardFunctionError(f"reward function {rf.name!r} ({rf.entry}) raised "
                                              f"{type(exc).__name__}: {exc}") from exc
                if inspect.isawaitable(result):
                    pending[rf.name] = result
                else:
                    outputs[rf.name] = result
        except BaseException:
            for awaitable in pending.values():  # never awaited: close them, quietly
                if inspect.iscoroutine(awaitable):
                    awaitable.close()
            raise
        if pending:
            outputs.update(zip(pending, self._run_concurrently(pending)))
        return outputs

    def _run_concurrently(self, pending: dict[str, Any]) -> list[Any]:
        entries = {rf.name: rf.entry for rf in self.functions}

        async def guarded(name: str, awaitable: Any) -> Any:
            try:
                return await awaitable
            except Exception as exc:
                raise RewardFunctionError(f"reward function {name!r} ({entries[name]}) raised "
                                          f"{type(exc).__name__}: {exc}") from exc

        async def gather() -> list[Any]:
            return await asyncio.gather(*(guarded(name, aw) for name, aw in pending.items()))

        # The environment's own loop on its own thread: the caller's thread may already run one
        # (Jupyter), which cannot be entered again, and clients bound to the loop outlive the step.
        return asyncio.run_coroutine_threadsafe(gather(), self._event_loop()).result()

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        with self._loop_lock:
            if self._loop is None:
                self._loop = background_event_loop("grpo-sdk: reward functions")
            return self._loop

    def shutdown(self) -> None:
        with self._loop_lock:
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._loop = None



def _as_list(rf: RewardFunction, output: Any, size: int) -> list[Any]:
    if isinstance(output, (str, bytes, dict)) or not hasattr(output, "__len__"):
        raise EnvironmentStepError(f"reward function {rf.name!r} ({rf.entry}) returned {type(output).__name__}, not "
                                   f"a list of {size} rewards (one float or None per completion)")
    values = list(output)
    if len(values) != size:
        raise EnvironmentStepError(f"reward function {rf.name!r} ({rf.entry}) returned {len(values)} values for "
                                   f"{size} completions; it must return one per completion (None for no reward)")
    return values
