"""Model-written Python scored against tests in a sandbox: the ``code`` environment.

::

    env:
      name: code
      code: {tests_key: tests, partial_credit: false, timeout_s: 10, num_workers: 4}
    data:
      train_path: problems.jsonl   # {"prompt": "Write add(a, b) ...", "tests": ["assert add(1, 2) == 3", ...]}

**The code** is taken from the last message of each conversation (the response): the last fenced
block tagged ``python`` (or ``py``, ``python3``) or untagged, a block cut off by the length
limit included; with no such block, the whole text. Blocks in other languages are ignored.

**The tests** are the row's metadata value under ``tests_key``: a list of strings, each one test
run after the code, in the code's namespace (``assert add(1, 2) == 3``, or several lines that
raise on failure), or one string, a single test. The code runs as a module named ``solution``
(``if __name__ == "__main__":`` blocks do not run), with stdin empty, and it cannot read the
tests: they are loaded, and their file deleted, before it starts.

**The reward** (component ``tests``) is 1.0 when every test passes, else 0.0; with
``partial_credit`` it is the fraction of tests that passed. Each sample's outcome (passed, failed,
timeout, killed, error) and its reason go into its metadata as ``sandbox``, and the share of each
outcome into the metrics (``env/sandbox_passed``, ...). What the sandbox holds: docs/sandbox.md.
"""

from __future__ import annotations

import os
import re
import shutil
from typing import Any, Sequence

from grpo_sdk.environments.sandbox import OUTCOMES, Sandbox, SandboxError, SandboxResult
from grpo_sdk.environments.specs import CodeEnvConfig
from grpo_sdk.plugins import ConfigError, EnvironmentReturn, MessageLog
from grpo_sdk.plugins.toolkit import MasterConfig

_FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
PYTHON_TAGS = frozenset({"", "python", "py", "python3"})
STDERR_TAIL = 400  # characters of a snippet's stderr kept in its metadata


def check_code_env(config: MasterConfig, options: CodeEnvConfig | None, registry: Any) -> list[tuple[str, str]]:
    """The ``env.code`` check (``CODE.check``): beside the environment rather than in ``specs``, as it
    tries the sandbox out, and the sandbox is configured by ``specs.CodeEnvConfig``."""
    options = options or CodeEnvConfig()
    problems = []
    if options.python and not (os.path.isabs(options.python) and os.access(options.python, os.X_OK)):
        found = shutil.which(options.python)
        problems.append(("env.code.python", f"{options.python!r} is not an executable file; give its absolute path"
                         + (f", e.g. {found}" if found else "")))
    if options.cpu_s > options.timeout_s:
        problems.append(("env.code.cpu_s", f"{options.cpu_s} CPU seconds can never be used within the "
                         f"{options.timeout_s:g} s of env.code.timeout_s; set cpu_s <= timeout_s"))
    if problems:
        return problems
    # The sandbox tries itself out now, so a machine that cannot isolate it fails `config validate`.
    try:
        Sandbox(options).close()
    except ConfigError as exc:
        problems.extend(exc.problems)
    except SandboxError as exc:
        problems.append(("env.code", str(exc)))
    return problems


def extract_code(text: str) -> tuple[str, bool]:
    """``(code, fenced)``: the last python (or untagged) fenced block, else the whole text."""
    blocks = [m.group(2) for m in _FENCE.finditer(text) if m.group(1).lower() in PYTHON_TAGS]
    if blocks:
        return blocks[-1], True
    return text, False


def row_tests(meta: dict[str, Any], key: str, index: int) -> list[str]:
    """The row's tests as a list of snippets, or a ValueError naming the sample and the key."""
    where = f"sample {index}: row metadata"
    if key not in meta:
        raise ValueError(f"{where} has no {key!r} key (env.code.tests_key); keys: {sorted(meta)}")
    tests = meta[key]
    if isinstance(tests, str):
        tests = [tests]
    if not isinstance(tests, (list, tuple)) or not tests:
        raise ValueError(f"{where} {key!r} must be a non-empty list of test snippets (or one string), "
                         f"got {type(tests).__name__} {str(tests)[:80]!r}")
    bad = [i for i, t in enumerate(tests) if not isinstance(t, str) or not t.strip()]
    if bad:
        raise ValueError(f"{where} {key!r}: test {bad[0]} is {tests[bad[0]]!r}, not a non-empty string of Python "
                         "(e.g. 'assert add(1, 2) == 3')")
    for i, test in enumerate(tests):
        try:
            compile(test, f"test_{i}", "exec")
        except SyntaxError as exc:  # the dataset's fault, not the model's: never score it as a failure
            raise ValueError(f"{where} {key!r}: test {i} is not valid Python ({exc.msg}, line {exc.lineno}): "
                             f"{test[:80]!r}") from None
    return list(tests)


class CodeEnvironment:
    """Example::

        env = CodeEnvironment(CodeEnvConfig(), context=None)
        log = [Message(role="user", content="Write add."),
               Message(role="assistant", content="```python\\ndef add(a, b):\\n    return a + b\\n```")]
        ret = env.step([log], [{"tests": ["assert add(1, 2) == 3"]}])
        ret.rewards                      # {"tests": [1.0]}
        ret.metadata[0]["sandbox"]       # {"outcome": "passed", "reason": "all 1 tests passed", ...}
    """

    def __init__(self, config: CodeEnvConfig | None, context: Any):
        self.config = config or CodeEnvConfig()
        self.sandbox = Sandbox(self.config)  # probes now: a machine that cannot isolate fails the start

    def step(self, message_logs: Sequence[MessageLog], metadata: Sequence[dict[str, Any]]) -> EnvironmentReturn:
        key = self.config.tests_key
        tests = [row_tests(meta, key, i) for i, meta in enumerate(metadata)]  # all checked before any runs
        extracted = [extract_code(log[-1].content) for log in message_logs]
        results = self.sandbox.run_many([(code, t) for (code, _), t in zip(extracted, tests)])
        rewards = [self._reward(r) for r in results]
        n = max(1, len(results))
        metrics = {f"sandbox_{o}": sum(r.outcome == o for r in results) / n for o in OUTCOMES}
        metrics["test_pass_rate"] = sum(r.tests_passed / max(1, r.tests_total) for r in results) / n
        metrics["fenced_fraction"] = sum(fenced for _, fenced in extracted) / n
        return EnvironmentReturn(rewards={"tests": rewards}, metrics=metrics,
                                 metadata=[{**meta, "sandbox": self._record(r)} for meta, r in zip(metadata, results)])

    def _reward(self, result: SandboxResult) -> float:
        if self.config.partial_credit:
            return result.tests_passed / max(1, result.tests_total)
        return 1.0 if result.outcome == "passed" else 0.0

    @staticmethod
    def _record(result: SandboxResult) -> dict[str, Any]:
        record = {"outcome": result.outcome, "reason": result.reason, "tests_passed": result.tests_passed,
                  "tests_total": result.tests_total, "wall_s": round(result.wall_s, 4)}
        if result.stderr.strip():
            record["stderr_tail"] = result.stderr[-STDERR_TAIL:]
        return record

    def shutdown(self) -> None:
        self.sandbox.close()
