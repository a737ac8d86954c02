"""Math word problems scored by math-verify, the verifier Hugging Face's evaluations use.

The reward is 1.0 when the response's final answer is mathematically equal to the gold answer
(``\\frac{1}{2}`` equals ``0.5``, ``2\\sqrt{2}`` equals ``\\sqrt{8}``), else 0.0. The final answer
is, in order:

1. the content of the last complete ``\\boxed{...}`` (or ``\\fbox{...}``), nested braces included;
2. with ``plain_answer_fallback`` (the default): the rest of the line after the last ``####``
   (GSM8K's format), else after the last "answer is" / "answer:", up to the end of the sentence;
3. else the last number in the response.

A response with none of these, or whose answer math-verify cannot parse, scores 0 and counts
against the ``extracted_fraction`` metric. The gold answer (metadata key ``answer_key``) may be
a number, a LaTeX expression, or a whole GSM8K solution ending in ``#### <answer>``.

Timeouts: math-verify bounds each parse and comparison with ``signal.alarm``, which works only
in a process's main thread. With ``num_workers: 0`` the environment asks to be stepped on the main
thread (``runs_on_main_thread``; the synchronous loop does so) and scores in-process; called from
another thread (async GRPO's collector), or with workers, responses go to worker processes, where
each task runs in the worker's main thread. Either way an expression that runs past
``timeout_seconds`` scores 0.
"""

from __future__ import annotations

import functools
import re
import threading
from typing import Any, Sequence

from grpo_sdk.plugins import EnvironmentReturn, MessageLog
from grpo_sdk.environments.specs import MathEnvConfig

_BOXED = re.compile(r"\\(?:boxed|fbox)")
_HASHES = re.compile(r"####[ \t]*([^\n]*)")
_ANSWER_IS = re.compile(r"answer\s*(?:is|:)[ \t:]*([^\n]*)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?")
_SENTENCE_END = re.compile(r"\.(?=\s|$)")


def _braced(text: str, start: int) -> str | None:
    """The content of the brace group opening at ``text[start]``; None if it never closes."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] in "{}" and text[i - 1] == "\\":  # \{ and \} are literal braces, not grouping
            continue
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start + 1:i]
    return None


def last_boxed(text: str) -> str | None:
    """Content of the last complete ``\\boxed{...}``; a truncated one (no closing brace) is skipped."""
    for match in reversed(list(_BOXED.finditer(text))):
        rest = match.end()
        if text.startswith("{", rest):
            content = _braced(text, rest)
        else:  # "\boxed 42": the next token
            token = re.match(r"\s+([^\s$]+)", text[rest:])
            content = token.group(1) if token else None
        if content is not None and content.strip():
            return content.strip()
    return None


def _sentence(tail: str) -> str:
    return _SENTENCE_END.split(tail, maxsplit=1)[0].strip()


def extract_answer(text: str, plain_fallback: bool = True) -> tuple[str | None, str]:
    """``(answer, how)``: how is "boxed", "hashes", "answer_is", "last_number" or "none"."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed, "boxed"
    if not plain_fallback:
        return None, "none"
    for how, pattern in (("hashes", _HASHES), ("answer_is", _ANSWER_IS)):
        matches = [m for m in pattern.finditer(text) if _sentence(m.group(1))]
        if matches:
            return _sentence(matches[-1].group(1)), how
    numbers = _NUMBER.findall(text)
    return (numbers[-1], "last_number") if numbers else (None, "none")


def parse_answer(answer: str, timeout_seconds: int) -> list[Any]:
    """math-verify's parse of one extracted answer; [] when nothing parses.

    The answer is first read as LaTeX (wrapped in ``$...$``: ``2\\sqrt{2}`` unwrapped would read
    as 2), then as a plain expression; a sympy result wins over math-verify's string fallback.
    """
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    answer = answer.strip().strip("$").strip()
    if answer.startswith("\\(") and answer.endswith("\\)"):
        answer = answer[2:-2].strip()
    if not answer:
        return []
    configs = [LatexExtractionConfig(), ExprExtractionConfig()]
    latex = parse(f"${answer}$", extraction_config=configs, parsing_timeout=timeout_seconds)
    if latex and not isinstance(latex[0], str):
        return latex
    plain = parse(answer, extraction_config=configs, parsing_timeout=timeout_seconds)
    return plain if plain and not isinstance(plain[0], str) else latex or plain


@functools.lru_cache(maxsize=4096)  # the G responses of a prompt share its gold answer
def parse_gold(gold: str, timeout_seconds: int) -> list[Any]:
    if "####" in gold:
        gold = gold.rsplit("####", 1)[1]
    gold = last_boxed(gold) or gold
    parsed = parse_answer(gold, timeout_seconds)
    if not parsed:
        raise ValueError(f"math-verify could not parse the gold answer {gold!r}")
    return parsed


def score_response(response: str, gold: str, config: MathEnvConfig) -> tuple[float, str]:
    """``(reward, how the answer was found)`` for one response; runs in a worker process too."""
    from math_verify import verify

    gold_parsed = parse_gold(gold, config.timeout_seconds)
    answer, how = extract_answer(response, config.plain_answer_fallback)
    if answer is None:
        return 0.0, how
    predicted = parse_answer(answer, config.timeout_seconds)
    if not predicted:
        return 0.0, "none"
    return float(verify(gold_parsed, predicted, timeout_seconds=config.timeout_seconds)), how


def _score_star(args: tuple[str, str, MathEnvConfig]) -> tuple[float, str]:
    return score_response(*args)


class MathEnvironment:
    """Example::

        env = MathEnvironment(MathEnvConfig(), context=None)
        log = [Message(role="user", content="1+1?"), Message(role="assistant", content="\\\\boxed{2}")]
        env.step([log], [{"answer": "2"}]).rewards   # {"correct": [1.0]}
    """

    def __init__(self, config: MathEnvConfig | None, context: Any):
        self.config = config or MathEnvConfig()
        try:
            import math_verify  # noqa: F401 - fail at construction, not at the first step
        except ImportError:
            from grpo_sdk.plugins import PluginError

            raise PluginError("environment 'math' needs math-verify: pip install 'grpo-sdk[math]'") from None
        self._pool: Any = None

    def runs_on_main_thread(self) -> bool:
        """``num_workers: 0`` scores in this process, which math-verify's ``signal.alarm`` timeouts
        allow only on the main thread: the trainer calls ``step`` there (``RunsOnMainThread``)."""
        return self.config.num_workers == 0

    def _gold(self, meta: dict[str, Any]) -> str:
        key = self.config.answer_key
        if key not in meta:
            raise ValueError(f"row metadata has no {key!r} key (env.math.answer_key); keys: {sorted(meta)}")
        gold = meta[key]
        if isinstance(gold, bool) or not isinstance(gold, (str, int, float)) or str(gold).strip() == "":
            raise ValueError(f"gold answer {key!r} must be a non-empty string or a number, got {gold!r}")
        return str(gold)

    def step(self, message_logs: Sequence[MessageLog], metadata: Sequence[dict[str, Any]]) -> EnvironmentReturn:
        tasks = [(log[-1].content, self._gold(meta), self.config) for log, meta in zip(message_logs, metadata)]
        in_process = self.config.num_workers == 0 and threading.current_thread() is threading.main_thread()
        if in_process:
            results = [_score_star(t) for t in tasks]
        else:  # a few chunks per worker: one task per response would be mostly pickling
            chunk = max(1, len(tasks) // (4 * max(1, self.config.num_workers)))
            results = list(self._workers().map(_score_star, tasks, chunksize=chunk))
        rewards = [r for r, _ in results]
        n = max(1, len(results))
        return EnvironmentReturn(rewards={"correct": rewards}, metrics={
            "extracted_fraction": sum(how != "none" for _, how in results) / n,
            "boxed_fraction": sum(how == "boxed" for _, how in results) / n,
        })

    def _workers(self) -> Any:
        if self._pool is None:
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor

            # spawn: a forked child would inherit the parent's torch and tokenizer threads in an unknown state
            self._pool = ProcessPoolExecutor(max(1, self.config.num_workers),
                                             mp_context=multiprocessing.get_context("spawn"))
        return self._pool

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
            self._pool = None
