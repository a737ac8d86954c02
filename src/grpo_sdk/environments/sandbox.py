"""Runs model-written Python against tests, one sandboxed process per snippet.

Example::

    sandbox = Sandbox(CodeEnvConfig(timeout_s=5))        # probes the machine once; refuses to
    result = sandbox.run("def add(a, b):\\n    return a + b", ["assert add(1, 2) == 3"])
    result.outcome, result.reason                         # ("passed", "all 1 tests passed")
    sandbox.run_many([(code, tests), ...])                # num_workers at a time
    sandbox.close()

Each snippet gets a process of its own, started by ``sandbox_boot.py`` (namespaces, mounts,
resource limits, the uid switch; docs/sandbox.md lists what each holds and what it does not). This
side enforces the wall-clock deadline (the whole session is killed), caps what it reads of
stdout/stderr, and turns the harness's report and the exit status into an outcome:

* ``passed``: the code ran and every test passed;
* ``failed``: the code ran and a test raised (an ``assert`` that failed, or any exception);
* ``timeout``: the wall-clock deadline passed;
* ``killed``: a resource limit stopped it (CPU time, memory, file size, disk, processes, open
  files, output), the reason names the limit and its key;
* ``error``: anything else that is the snippet's fault (a syntax error, an exception before the
  tests, ``sys.exit``, a process that died of a signal or exited before the tests finished).

A failure of the sandbox itself (it could not start) raises ``SandboxError``: it is not the
sample's fault and must not be trained on as a 0.
"""

from __future__ import annotations

import fcntl
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Sequence

import attrs

from grpo_sdk.environments.specs import CodeEnvConfig

BOOT = str(Path(__file__).with_name("sandbox_boot.py"))
OUTCOMES = ("passed", "failed", "timeout", "killed", "error")
# Each running snippet gets a uid of its own (RLIMIT_NPROC counts per uid, and no other process,
# not even another sandbox, can then be signalled or read by it); a lock file per uid keeps two
# sandboxes, in any process of the machine, off the same uid.
UID_BASE, UID_COUNT = 1_500_000_000, 65_536
CLEAN_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
# Threads count against RLIMIT_NPROC: numerical libraries would start one per core and fail.
SNIPPET_ENV = {**CLEAN_ENV, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
REPORT_CAP = 1 << 20  # the harness writes a short line per test
GRACE_S = 2.0  # how long the pipes may stay open once the sandbox is over or killed


class SandboxError(RuntimeError):
    """The sandbox could not run a snippet at all (not the snippet's fault)."""


@attrs.frozen(kw_only=True)
class SandboxResult:
    outcome: str  # one of OUTCOMES
    reason: str
    tests_passed: int = 0
    tests_total: int = 0
    stdout: str = ""
    stderr: str = ""
    wall_s: float = 0.0
    cpu_s: float | None = None  # the snippet's CPU time, when it ended by itself


@attrs.frozen
class _Run:
    """What one sandbox process left behind, before it is read as an outcome."""

    events: list[dict[str, Any]]
    status: dict[str, Any]
    stopped_for: str | None  # "timeout", "stdout", "stderr", "report": why this side killed it
    stdout: bytes
    stderr: bytes
    wall_s: float


class UidLeases:
    """Unprivileged uids for sandboxes, each held by one sandbox at a time across the machine."""

    def __init__(self) -> None:
        self.dir = os.path.join(tempfile.gettempdir(), "grpo-sdk-sandbox-uids")
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        info = os.lstat(self.dir)
        if info.st_uid != os.geteuid() or info.st_mode & 0o077:  # someone else's, in a shared /tmp
            raise SandboxError(f"{self.dir} is not a private directory of this user; remove it")

    def acquire(self) -> tuple[int, int]:
        # The lowest free uid: the lock files number no more than the sandboxes that ever ran at once.
        for uid in range(UID_BASE, UID_BASE + UID_COUNT):
            fd = os.open(os.path.join(self.dir, str(uid)), os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # per open file: threads exclude each other too
                return uid, fd
            except BlockingIOError:
                os.close(fd)
        raise SandboxError(f"all {UID_COUNT} sandbox uids are in use")


def kill_uid(uid: int) -> None:
    """SIGKILL every process of ``uid``: what escaped the session, where there is no PID namespace."""
    for _ in range(3):  # a process forking right now may add one between two passes
        found = False
        for entry in os.listdir("/proc"):
            try:
                with open(f"/proc/{entry}/status") as f:
                    owner = next(int(line.split()[1]) for line in f if line.startswith("Uid:"))
                if owner == uid:
                    os.kill(int(entry), signal.SIGKILL)
                    found = True
            except (ValueError, OSError, StopIteration):
                continue
        if not found:
            return


def exposed_paths(python: str) -> list[str]:
    """Directories the interpreter needs, bound back into the sandbox when a hidden path covers them."""
    if python == sys.executable:
        prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    else:  # <prefix>/bin/python; a venv's base interpreter lies where its symlink points
        prefixes = {str(Path(python).parent.parent), str(Path(python).resolve().parent.parent)}
    return sorted({os.path.realpath(p) for p in prefixes} | prefixes)


class Sandbox:
    """Runs snippets, at most ``config.num_workers`` at once; see the module docstring."""

    def __init__(self, config: CodeEnvConfig, key: str = "env.code"):
        self.config = config
        self.key = key
        self.python = config.python or sys.executable
        self.hidden = [os.path.realpath(os.path.expanduser(p)) for p in config.hidden_paths]
        self.exposed = exposed_paths(self.python)
        self.leases = UidLeases() if os.geteuid() == 0 else None
        self.layers: list[str] = []
        self.missing: dict[str, str] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._probe()

    def _probe(self) -> None:
        """One trivial snippet: learns which layers hold here, and refuses what the config forbids."""
        run = self._execute("", ["assert True"], probing=True)
        if "setup_error" in run.status or "layers" not in run.status:
            why = run.status.get("setup_error") or run.stderr.decode(errors="replace")[-500:]
            if "no network namespace" in why:
                from grpo_sdk.plugins import ConfigError

                raise ConfigError([(f"{self.key}.network_isolation", (
                    f"'required', but this machine cannot give the sandbox a network namespace ({why}). "
                    "Run the trainer as root (a container's root will do), or allow unprivileged user "
                    "namespaces (sysctl kernel.unprivileged_userns_clone=1 and user.max_user_namespaces > 0), "
                    f"or set {self.key}.network_isolation=best_effort (snippets may then reach the network)"))])
            raise SandboxError(f"the sandbox cannot start on this machine: {why}")
        self.layers = list(run.status.get("layers", []))
        self.missing = dict(run.status.get("missing", {}))
        if "proc" in run.status:  # the init's own /proc: None when mounted, else why not
            if run.status["proc"] is None:
                self.layers.append("proc")
            else:
                self.missing["proc"] = run.status["proc"]
        result = self._classify(run, ["assert True"])
        if result.outcome != "passed":
            raise SandboxError(f"the sandbox cannot run a trivial snippet with {self.python}: {result.outcome}: "
                               f"{result.reason}; stderr: {result.stderr[-500:]!r}")

    @property
    def uid_switch(self) -> bool:
        return self.leases is not None

    def run(self, code: str, tests: Sequence[str]) -> SandboxResult:
        run = self._execute(code, list(tests))
        if "setup_error" in run.status:
            raise SandboxError(f"the sandbox failed to start a snippet: {run.status['setup_error']}")
        return self._classify(run, list(tests))

    def run_many(self, jobs: Sequence[tuple[str, Sequence[str]]]) -> list[SandboxResult]:
        if self.config.num_workers <= 1 or len(jobs) <= 1:
            return [self.run(code, tests) for code, tests in jobs]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.config.num_workers, thread_name_prefix="sandbox")
        return list(self._pool.map(lambda job: self.run(*job), jobs))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    # -- one process -------------------------------------------------------------------------

    def _execute(self, code: str, tests: list[str], probing: bool = False) -> _Run:
        c = self.config
        host_dir = None if "mount" in self.layers else tempfile.mkdtemp(prefix="grpo-sandbox-")
        uid, lease = self.leases.acquire() if self.leases else (None, -1)
        job = {"code": code, "tests": tests, "network": c.network_isolation, "python": self.python,
               "hidden_paths": self.hidden, "exposed_paths": self.exposed, "host_workdir": host_dir, "uid": uid,
               "timeout_s": c.timeout_s, "cpu_s": c.cpu_s, "memory_mb": c.memory_mb, "file_size_mb": c.file_size_mb,
               "disk_mb": c.disk_mb, "max_processes": c.max_processes, "max_open_files": c.max_open_files,
               "env": SNIPPET_ENV}
        pipes = [os.pipe() for _ in range(3)]  # payload (in), status and report (out)
        ends = (pipes[0][0], pipes[1][1], pipes[2][1])
        start = time.monotonic()
        proc = None
        try:
            proc = subprocess.Popen([sys.executable, "-I", "-S", "-B", BOOT, *map(str, ends)], stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=ends, env=CLEAN_ENV,
                                    cwd="/", start_new_session=True)
            for fd in ends:
                os.close(fd)
            ends = ()
            try:
                with os.fdopen(pipes[0][1], "wb", closefd=False) as f:
                    f.write(json.dumps(job).encode())
            except BrokenPipeError:  # it died first: its stderr says why
                pass
            os.close(pipes[0][1])
            pipes[0] = (-1, -1)
            return self._collect(proc, pipes[1][0], pipes[2][0], start)
        finally:
            for fd in (*ends, pipes[0][1], pipes[1][0], pipes[2][0]):
                if fd >= 0:
                    try:
                        os.close(fd)
                    except OSError:
                        pass
            if proc is not None:
                _kill_session(proc)
            if uid is not None:
                if probing or "pid" not in self.layers:
                    kill_uid(uid)
                os.close(lease)
            if host_dir is not None:
                shutil.rmtree(host_dir, ignore_errors=True)

    def _collect(self, proc: subprocess.Popen, status_fd: int, report_fd: int, start: float) -> _Run:
        cap = self.config.max_output_bytes
        names = {proc.stdout.fileno(): "stdout", proc.stderr.fileno(): "stderr", status_fd: "status",
                 report_fd: "report"}
        caps = {"stdout": cap, "stderr": cap, "status": REPORT_CAP, "report": REPORT_CAP}
        data = {name: bytearray() for name in caps}
        stopped_for = None
        killed, status_open = False, True
        deadline = start + self.config.timeout_s
        with selectors.DefaultSelector() as sel:
            for fd in names:
                sel.register(fd, selectors.EVENT_READ)
            while sel.get_map():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    if killed or not status_open:
                        break  # the grace is spent: the caller kills what is left
                    stopped_for, killed = "timeout", True
                    _kill_session(proc, wait=False)
                    deadline = time.monotonic() + GRACE_S
                    continue
                for key, _ in sel.select(remaining):
                    name = names[key.fd]
                    chunk = os.read(key.fd, 65536)
                    if not chunk:
                        sel.unregister(key.fd)
                        if name == "status":  # the snippet is over: its leftovers get a short grace
                            status_open = False
                            deadline = min(deadline, time.monotonic() + GRACE_S)
                        continue
                    room = caps[name] - len(data[name])
                    data[name] += chunk[:max(0, room)]
                    if len(chunk) > room and not killed:
                        stopped_for, killed = name, True
                        _kill_session(proc, wait=False)
                        deadline = time.monotonic() + GRACE_S
        wall = time.monotonic() - start
        return _Run(events=_lines(data["report"]), status=_merged(_lines(data["status"])), stopped_for=stopped_for,
                    stdout=bytes(data["stdout"]), stderr=bytes(data["stderr"]), wall_s=wall)

    # -- outcome -------------------------------------------------------------------------------

    def _classify(self, run: _Run, tests: list[str]) -> SandboxResult:
        c, key = self.config, self.key
        test_events = [e for e in run.events if e.get("event") == "test"]
        passed = sum(e.get("ok") is True for e in test_events)
        code_event = next((e for e in run.events if e.get("event") == "code"), None)
        failure = next((e for e in test_events if e.get("ok") is not True), None)
        progress = f" ({passed} of {len(tests)} tests passed first)" if passed else ""

        def result(outcome: str, reason: str) -> SandboxResult:
            return SandboxResult(outcome=outcome, reason=reason, tests_passed=passed, tests_total=len(tests),
                                 stdout=run.stdout.decode(errors="replace"), stderr=run.stderr.decode(errors="replace"),
                                 wall_s=run.wall_s, cpu_s=run.status.get("cpu_s"))

        if run.stopped_for == "timeout":
            return result("timeout", f"ran past the {c.timeout_s:g} s wall-clock limit ({key}.timeout_s){progress}")
        if run.stopped_for in ("stdout", "stderr"):
            return result("killed", f"output limit: wrote more than {c.max_output_bytes} bytes to {run.stopped_for} "
                          f"({key}.max_output_bytes){progress}")
        if run.stopped_for == "report":
            return result("error", "flooded the harness's report channel (fd 3)")
        if code_event is not None and not code_event.get("ok"):
            error = code_event.get("error") or {}
            limit = self._limit_of(error)
            if limit:
                return result("killed", f"{limit}, while the code ran: {error.get('message', '')}")
            return result("error", f"the code raised {error.get('message', '?')}")
        if any(e.get("event") == "done" for e in run.events):
            if failure is None:
                return result("passed", f"all {len(tests)} tests passed")
            error, index = failure.get("error") or {}, failure.get("index", "?")
            source = _short(tests[index]) if isinstance(index, int) and index < len(tests) else "?"
            limit = self._limit_of(error)
            if limit:
                return result("killed", f"{limit}, in test {index} {source}")
            return result("failed", f"test {index} {source} failed: {error.get('message', '?')} "
                          f"({passed} of {len(tests)} passed)")
        # The process ended without the harness's last word.
        where = ("before the code finished" if code_event is None else
                 f"during test {len(test_events)}" if len(test_events) < len(tests) else "after the tests")
        if "signal" in run.status:
            sig = run.status["signal"]
            cpu = run.status.get("cpu_s") or 0.0
            # SIGXCPU at the soft limit; SIGKILL a second later, at the hard one, if it was caught
            if sig == signal.SIGXCPU or sig == signal.SIGKILL and cpu >= c.cpu_s:
                return result("killed", f"CPU limit: used {cpu:.1f} s of CPU time, the limit is {c.cpu_s} s "
                              f"({key}.cpu_s), {where}")
            name = signal.Signals(sig).name if sig in signal.Signals.__members__.values() else str(sig)
            crash = " (a crash: recursion deeper than the C stack, or a bad native call)"
            hint = crash if sig == signal.SIGSEGV else ""
            return result("error", f"killed by signal {name}{hint}, {where}{progress}")
        tail = run.stderr.decode(errors="replace").strip().splitlines()[-1:] or [""]
        return result("error", f"exited with status {run.status.get('exit', '?')} {where}{progress}"
                      + (f": {_short(tail[0])}" if tail[0] else ""))

    def _limit_of(self, error: dict[str, Any]) -> str | None:
        """The resource limit an exception from the snippet stands for, if any."""
        c, key, kind, errno = self.config, self.key, error.get("type"), error.get("errno")
        if kind == "MemoryError":
            return f"memory limit: {c.memory_mb} MiB of address space ({key}.memory_mb)"
        if errno == 27:  # EFBIG: Python ignores SIGXFSZ, so the write fails instead
            return f"file size limit: {c.file_size_mb} MiB per file ({key}.file_size_mb)"
        if errno == 28 and "mount" in self.layers:
            return f"disk limit: {c.disk_mb} MiB of scratch space ({key}.disk_mb)"
        if errno == 11 and kind == "BlockingIOError":  # EAGAIN: fork() at RLIMIT_NPROC (there is no network)
            return f"process limit: {c.max_processes} processes ({key}.max_processes)"
        if errno == 24:
            return f"open-files limit: {c.max_open_files} ({key}.max_open_files)"
        return None


def _kill_session(proc: subprocess.Popen, wait: bool = True) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the bootstrap's session: the snippet dies with it (PDEATHSIG)
    except (ProcessLookupError, PermissionError):
        pass
    if wait:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def _lines(data: bytes | bytearray) -> list[dict[str, Any]]:
    out = []
    for line in bytes(data).splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a torn last line, or bytes the snippet wrote to fd 3 itself
        if isinstance(record, dict):
            out.append(record)
    return out


def _merged(records: list[dict[str, Any]]) -> dict[str, Any]:
    status: dict[str, Any] = {}
    for record in records:
        status.update(record)
    return status


def _short(text: str, limit: int = 120) -> str:
    text = " ".join(str(text).split())
    return repr(text if len(text) <= limit else text[:limit - 3] + "...")
