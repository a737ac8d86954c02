"""`grpoctl serve` as a user starts it, in a subprocess: ``Served`` waits (bounded) for its URL and
stops it with a signal; ``post`` and ``get`` call it with the test key (test_serve_cmd, test_gguf and
test_gguf_real drive it)."""

from __future__ import annotations

import json
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from helpers import grpoctl_env

KEY = "test-key-31415"
START_TIMEOUT_S = 90  # the URL line: python, torch, the model; a few seconds on an idle machine


class Served:
    """`grpoctl serve ARGS` in a subprocess; ``url`` waits (bounded) for the line with the base URL."""

    def __init__(self, *args: object, cwd: Path | None = None, **env: str):
        self.proc = subprocess.Popen([sys.executable, "-m", "grpo_sdk.cli.entry", "serve", *map(str, args)], cwd=cwd,
                                     env=grpoctl_env(**env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.stdout: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def url(self) -> str:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"no URL line within {START_TIMEOUT_S} s; stdout so far: {self.stdout}")
            if line is None:
                self.proc.wait(10)
                pytest.fail(f"exited {self.proc.returncode} before listening:\n{self.proc.stderr.read()[-3000:]}")
            self.stdout.append(line)
            found = re.search(r"(http://\S+/v1) ", line)
            if found:
                return found.group(1)

    def stop(self, signum: int = signal.SIGTERM) -> tuple[int, str]:
        """Send ``signum``; the exit code (within a few seconds) and stderr."""
        self.proc.send_signal(signum)
        code = self.proc.wait(timeout=15)
        return code, self.proc.stderr.read()

    def __enter__(self) -> Served:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc.stdout.close()
        self.proc.stderr.close()



def post(url: str, body: dict, key: str | None = KEY) -> dict:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    with urllib.request.urlopen(request, timeout=30) as answer:
        return json.loads(answer.read())



def get(url: str) -> dict:
    with urllib.request.urlopen(urllib.request.Request(url, headers={"Authorization": f"Bearer {KEY}"}),
                                timeout=30) as answer:
        return json.loads(answer.read())

