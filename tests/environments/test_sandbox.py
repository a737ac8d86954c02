"""The sandbox of the ``code`` environment against hostile snippets.

Each snippet goes through ``CodeEnvironment.step`` as a model's response would; each test asserts
the outcome, the reason, the reward 0, and that the trainer (this process) is unaffected: a file
it owns is intact, a process it started (the canary) is alive, and no process of any sandbox is
left (``assert_no_sandbox_processes``; it assumes no other sandbox runs on this machine meanwhile).
docs/sandbox.md says what the sandbox holds; this file is the evidence for it on this machine.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from grpo_sdk.core.records import Message
from grpo_sdk.environments.code_env import CodeEnvironment
from grpo_sdk.environments.sandbox import UID_BASE, UID_COUNT
from grpo_sdk.environments.specs import CodeEnvConfig

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the sandbox needs Linux namespaces")
ROOT = os.geteuid() == 0
SECRET = "grpo-test-secret-7f3a"


def sandbox_processes() -> list[str]:
    """Processes of any sandbox: a sandbox uid, or the bootstrap's command line."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                uid = next(int(line.split()[1]) for line in f if line.startswith("Uid:"))
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, StopIteration):
            continue
        if UID_BASE <= uid < UID_BASE + UID_COUNT or "sandbox_boot.py" in cmdline or "import builtins, json" in cmdline:
            found.append(f"{entry} uid={uid} {cmdline[:80]}")
    return found


def assert_no_sandbox_processes(within_s: float = 3.0) -> None:
    deadline = time.monotonic() + within_s
    while (left := sandbox_processes()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"processes left behind: {left}"


@pytest.fixture(scope="module")
def trainer_dirs():
    """A directory the snippet can see (outside /tmp, which it gets a private copy of) holding a file
    only the trainer's user may read, and a world-readable one in a directory the config hides."""
    base = Path(tempfile.mkdtemp(prefix="grpo-sandbox-test-", dir="/var/lib" if ROOT else None))
    visible, hidden = base / "visible", base / "hidden"
    visible.mkdir(mode=0o755)
    hidden.mkdir(mode=0o755)
    os.chmod(base, 0o755)
    (visible / "private.txt").write_text(SECRET)
    os.chmod(visible / "private.txt", 0o600)
    (hidden / "public.txt").write_text(SECRET)
    os.chmod(hidden / "public.txt", 0o644)
    yield visible, hidden
    subprocess.run(["rm", "-rf", str(base)], check=False)


@pytest.fixture(scope="module")
def env(trainer_dirs):
    config = CodeEnvConfig(timeout_s=4, cpu_s=2, memory_mb=256, file_size_mb=1, disk_mb=8, max_processes=8,
                           max_output_bytes=4096, num_workers=2, hidden_paths=["~", "/run", str(trainer_dirs[1])])
    environment = CodeEnvironment(config, context=None)
    yield environment
    environment.shutdown()


@pytest.fixture(autouse=True)
def trainer_unaffected(tmp_path, trainer_dirs, monkeypatch):
    """Around every test: a secret in this process's environment, a file it owns, a canary process;
    afterwards the file and the canary must be as they were and no sandbox process left."""
    monkeypatch.setenv("GRPO_TEST_SECRET", SECRET)
    own = tmp_path / "trainer.txt"
    own.write_text("intact")
    canary = subprocess.Popen(["sleep", "60"])
    yield canary
    try:
        assert own.read_text() == "intact"
        assert (trainer_dirs[0] / "private.txt").read_text() == SECRET
        assert canary.poll() is None, "the canary process was killed"
        assert_no_sandbox_processes()
    finally:
        canary.kill()
        canary.wait()


def score(env, code: str, tests=("assert True",)):
    """(reward, the sample's sandbox record, the batch metrics) for one response."""
    log = [Message(role="user", content="write it"), Message(role="assistant", content=f"```python\n{code}\n```")]
    ret = env.step([log], [{"tests": list(tests)}])
    return ret.rewards["tests"][0], ret.metadata[0]["sandbox"], ret.metrics


def assert_scored(env, code, outcome, *reason_parts, tests=("assert True",)):
    reward, record, metrics = score(env, code, tests)
    assert (record["outcome"], reward) == (outcome, 0.0), record
    for part in reason_parts:
        assert part in record["reason"], record
    assert metrics[f"sandbox_{outcome}"] == 1.0
    return record


def test_the_machine_gives_every_layer(env):
    """What the rest of this file relies on; docs/sandbox.md says what is lost without each."""
    layers = {"net", "mount", "pid", "proc", "ipc", "uts", "readonly_root"}
    assert layers <= set(env.sandbox.layers), env.sandbox.missing
    assert env.sandbox.uid_switch == ROOT


def test_benign_snippets_pass_and_fail(env):
    code = "def add(a, b):\n    return a + b"
    reward, record, _ = score(env, code, ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"])
    assert (reward, record["outcome"], record["reason"]) == (1.0, "passed", "all 2 tests passed")
    record = assert_scored(env, code.replace("+", "-"), "failed", "test 0 'assert add(1, 2) == 3' failed",
                           "AssertionError", tests=["assert add(1, 2) == 3", "assert add(0, 0) == 0"])
    assert record["tests_passed"] == 1


@pytest.mark.parametrize("code, outcome, reason", [
    ("import os\nwhile True:\n    os.fork()", "killed", "process limit: 8 processes"),
    # one that swallows the failed fork spins until a limit or the clock stops it
    ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass", None, None),
], ids=["fork-bomb", "fork-bomb-that-retries"])
def test_fork_bombs(env, code, outcome, reason):
    if outcome is None:
        reward, record, _ = score(env, code)
        assert reward == 0.0 and record["outcome"] in ("timeout", "killed"), record
    else:
        assert_scored(env, code, outcome, reason)


@pytest.mark.parametrize("code", ["x = bytearray(1 << 34)",
                                  "chunks = []\nwhile True:\n    chunks.append(bytearray(1 << 20))"],
                         ids=["at-once", "gradually"])
def test_memory_bombs_hit_the_memory_limit(env, code):
    assert_scored(env, code, "killed", "memory limit: 256 MiB", "MemoryError")


def test_a_busy_loop_hits_the_cpu_limit_and_a_sleep_the_wall_clock(env):
    # a wall clock well past the CPU limit: on a busy machine a second of CPU takes longer
    patient = CodeEnvironment(CodeEnvConfig(timeout_s=60, cpu_s=1), context=None)
    try:
        assert_scored(patient, "while True:\n    pass", "killed", "CPU limit", "the limit is 1 s (env.code.cpu_s)")
    finally:
        patient.shutdown()
    record = assert_scored(env, "import time\ntime.sleep(1000)", "timeout", "4 s wall-clock limit")
    assert 4.0 <= record["wall_s"] < 8.0


def test_a_sleeper_that_spawned_children_takes_them_down_with_it(env):
    code = ("import os, subprocess, time\n"
            "subprocess.Popen(['sleep', '1000'])\n"
            "if os.fork() == 0:\n"  # a daemon: its own session, out of the process group
            "    os.setsid()\n"
            "    if os.fork() == 0:\n"
            "        time.sleep(1000)\n"
            "    os._exit(0)\n"
            "time.sleep(1000)")
    with ThreadPoolExecutor(1) as pool:
        scoring = pool.submit(assert_scored, env, code, "timeout")
        deadline = time.monotonic() + 4
        while not scoring.done() and time.monotonic() < deadline:  # they all ran (the host sees them)
            running = [p for p in sandbox_processes() if "sleep 1000" in p or "-I -B -c" in p]
            if len(running) >= 3:  # the snippet, its `sleep` and the daemon's child (the daemon exited)
                break
            time.sleep(0.05)
        assert len(running) >= 3, running
        scoring.result()


@pytest.mark.parametrize("path, error", [
    ("/var/lib/grpo-sandbox-pwned", "Read-only file system"),
    ("/etc/passwd", "Permission denied" if ROOT else "Read-only file system"),  # the mode is checked first
    ("{tmp}/pwned", "No such file or directory"),  # the trainer's /tmp is not the sandbox's
    ("{home}/pwned", "Read-only file system"),  # the empty stand-in for the hidden home
])
def test_writing_outside_the_working_directory_fails(env, tmp_path, path, error):
    path = path.format(tmp=tmp_path, home=Path.home())
    before = Path("/etc/passwd").read_bytes()
    assert_scored(env, f"open({path!r}, 'a').write('pwned')", "error", error)
    assert Path("/etc/passwd").read_bytes() == before
    assert not Path("/var/lib/grpo-sandbox-pwned").exists() and not (tmp_path / "pwned").exists()


def test_files_written_inside_stay_inside_and_are_capped(env):
    assert_scored(env, "open('big', 'wb').write(b'x' * (2 << 20))", "killed", "file size limit: 1 MiB")
    code = "for i in range(20):\n    open(f'f{i}', 'wb').write(bytes((1 << 20) - 1))"  # each under the file limit
    assert_scored(env, code, "killed", "disk limit: 8 MiB")


def test_the_trainers_files_environment_and_processes_are_out_of_reach(env, trainer_dirs, trainer_unaffected):
    visible, hidden = trainer_dirs
    if ROOT:  # another uid: the file's mode keeps it out
        assert_scored(env, f"print(open({str(visible / 'private.txt')!r}).read())", "error", "Permission denied")
    assert_scored(env, f"print(open({str(hidden / 'public.txt')!r}).read())", "error", "No such file")
    record = assert_scored(env, "import os\nprint(dict(os.environ))\nos.environ['GRPO_TEST_SECRET']", "error",
                           "KeyError: 'GRPO_TEST_SECRET'")
    assert SECRET not in record["reason"] and SECRET not in record.get("stderr_tail", "")
    printed = env.sandbox.run("import os\nprint(sorted(os.environ.items()))", ["assert True"]).stdout
    assert SECRET not in printed and "('HOME', '/tmp/sandbox')" in printed and "GRPO_TEST_SECRET" not in printed
    # another PID namespace: the trainer's processes do not exist in the sandbox
    assert_scored(env, f"open('/proc/{os.getpid()}/environ').read()", "error", "No such file")
    assert_scored(env, f"import os\nprint(os.listdir('/proc/{trainer_unaffected.pid}'))", "error", "No such file")


@pytest.mark.parametrize("attack, outcome, reason", [
    ("os.kill(os.getppid(), signal.SIGKILL)", "error", "PermissionError"),  # its parent is the sandbox's init
    ("os.kill(1, signal.SIGKILL)", "error", "PermissionError"),
    ("os.kill(TRAINER, signal.SIGKILL)", "error", "ProcessLookupError"),
    ("os.kill(CANARY, signal.SIGKILL)", "error", "ProcessLookupError"),
    ("os.kill(-1, signal.SIGKILL)", "error", "ProcessLookupError"),  # every process it may signal: none
    ("os.killpg(os.getpgrp(), signal.SIGKILL)", "error", "killed by signal SIGKILL"),  # itself, only
])
def test_signals_cannot_reach_the_trainer(env, trainer_unaffected, attack, outcome, reason):
    code = f"import os, signal\nTRAINER, CANARY = {os.getpid()}, {trainer_unaffected.pid}\n{attack}"
    assert_scored(env, code, outcome, reason)


@pytest.fixture
def listener():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    server.setblocking(False)
    yield server
    server.close()


@pytest.mark.parametrize("target", ["local", "outside"])
def test_sockets_reach_nothing(env, listener, target):
    host, port = ("127.0.0.1", listener.getsockname()[1]) if target == "local" else ("1.1.1.1", 53)
    assert_scored(env, f"import socket\nsocket.create_connection(({host!r}, {port}), timeout=2)", "error",
                  "Network is unreachable")
    with pytest.raises(BlockingIOError):
        listener.accept()  # nobody connected


def test_unix_sockets_under_hidden_paths_are_unreachable(env):
    """A network namespace does not cover unix sockets in the file system; hiding /run does."""
    if not os.access("/run", os.W_OK):
        pytest.skip("/run is not writable here")
    folder = Path(tempfile.mkdtemp(prefix="grpo-sandbox-test-", dir="/run"))
    os.chmod(folder, 0o755)
    server = socket.socket(socket.AF_UNIX)
    try:
        server.bind(str(folder / "sock"))
        os.chmod(folder / "sock", 0o777)
        server.listen(1)
        code = f"import socket\nsocket.socket(socket.AF_UNIX).connect({str(folder / 'sock')!r})"
        assert_scored(env, code, "error", "No such file or directory")
    finally:
        server.close()
        subprocess.run(["rm", "-rf", str(folder)], check=False)


@pytest.mark.parametrize("code, stream", [("print('x' * 10**7)", "stdout"),
                                          ("import sys\nwhile True:\n    sys.stderr.write('y' * 1000)", "stderr")])
def test_giant_output_is_capped_and_killed(env, code, stream):
    assert_scored(env, code, "killed", f"output limit: wrote more than 4096 bytes to {stream}")
    result = env.sandbox.run(code, ["assert True"])
    assert len(result.stdout) <= 4096 and len(result.stderr) <= 4096


@pytest.mark.parametrize("code, reason", [
    ("def f(n):\n    return f(n + 1)\nf(0)", "RecursionError"),
    # recursion through C (a __getattr__ slot per level) past the C stack: the process crashes
    ("import sys\nsys.setrecursionlimit(10**7)\nclass A:\n    def __getattr__(self, name):\n"
     "        return getattr(self, name)\nA().x", "killed by signal SIGSEGV"),
])
def test_deep_recursion(env, code, reason):
    assert_scored(env, code, "error", reason)


@pytest.mark.parametrize("code, tests, reason", [
    ("import os\nos._exit(0)", ["assert True"], "exited with status 0 before the code finished"),
    ("import os", ["assert True", "os._exit(0)", "assert True"], "exited with status 0 during test 1"),
    ("import sys\nsys.exit(0)", ["assert True"], "the code raised SystemExit: 0"),
])
def test_exiting_early_is_no_pass(env, code, tests, reason):
    assert_scored(env, code, "error", reason, tests=tests)


def test_the_code_cannot_read_its_tests_and_its_main_block_does_not_run(env):
    code = ("import os\nANSWER = os.listdir('.')\n"
            "if __name__ == '__main__':\n    input()  # stdin is empty: this would raise EOFError")
    reward, record, _ = score(env, code, ["assert ANSWER == ['solution.py'], ANSWER"])
    assert (reward, record["outcome"]) == (1.0, "passed"), record


def test_snippets_run_num_workers_at_a_time(env):
    """num_workers=2: of four snippets that each sleep half a second, two and never more run at once."""
    code = "import time\nprint(time.time())\ntime.sleep(0.5)\nprint(time.time())"
    results = env.sandbox.run_many([(code, ["assert True"])] * 4)
    assert [r.outcome for r in results] == ["passed"] * 4
    spans = [tuple(map(float, r.stdout.split())) for r in results]
    most = max(sum(start <= t < end for start, end in spans) for t, _ in spans)
    assert most == 2, spans


def test_a_forked_child_cannot_report_for_its_parent(env):
    """A child the code forks returns into the harness too; only the snippet's own process reports."""
    code = "import os, time\nif os.fork() != 0:\n    time.sleep(0.5)\n    raise ValueError('the parent fails')"
    assert_scored(env, code, "error", "ValueError: the parent fails")


def test_a_sandbox_whose_trainer_died_goes_within_seconds_of_its_timeout(tmp_path):
    """The trainer is SIGKILLed mid-snippet: nothing kills the sandbox's session any more, so the
    bootstrap's alarm (timeout_s + 5 s) and each process's parent-death signal must."""
    trainer = subprocess.Popen([sys.executable, "-c", (
        "from grpo_sdk.environments.sandbox import Sandbox\n"
        "from grpo_sdk.environments.specs import CodeEnvConfig\n"
        "sandbox = Sandbox(CodeEnvConfig(timeout_s=6, cpu_s=1))\n"
        "print('probed', flush=True)\n"
        "sandbox.run('import time\\ntime.sleep(1000)', ['assert True'])")], stdout=subprocess.PIPE, text=True)
    try:
        assert trainer.stdout.readline() == "probed\n"
        deadline = time.monotonic() + 30
        while not any("-I -B -c" in p for p in sandbox_processes()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert any("-I -B -c" in p for p in sandbox_processes()), "the snippet never started"
        time.sleep(1.0)  # into its sleep: a harness still writing its first lines would die of the closed pipe
    finally:
        trainer.kill()
        trainer.wait()
    killed = time.monotonic()
    time.sleep(0.5)
    assert sandbox_processes(), "the sandbox went with its trainer at once: then this test shows nothing"
    assert_no_sandbox_processes(within_s=6 + 5 + 3)
    assert time.monotonic() - killed < 6 + 5 + 3


def test_the_snippet_inherits_no_descriptor_but_its_report_pipe(env):
    """stdin, stdout, stderr, the report pipe (3), and the directory listing itself (4)."""
    code = "import os\nFDS = sorted(int(f) for f in os.listdir('/proc/self/fd'))"
    reward, record, _ = score(env, code, ["assert FDS == [0, 1, 2, 3, 4], FDS"])
    assert (reward, record["outcome"]) == (1.0, "passed"), record


def test_an_interpreter_in_a_virtual_environment_under_tmp_runs(tmp_path):
    """/tmp is private scratch inside the sandbox: an interpreter that lives there (a venv in a
    temporary clone, as CI makes) is bound back read-only, not lost under the tmpfs."""
    venv = Path(tempfile.mkdtemp(prefix="grpo-sandbox-venv-", dir="/tmp"))
    try:
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
        os.chmod(venv, 0o755)
        config = CodeEnvConfig(timeout_s=10, num_workers=1, python=str(venv / "bin" / "python"))
        environment = CodeEnvironment(config, context=None)
        try:
            reward, record, _ = score(environment, "import sys\nprefix = sys.prefix",
                                      [f"assert prefix == {str(venv)!r}"])
            assert (reward, record["outcome"]) == (1.0, "passed"), record
        finally:
            environment.shutdown()
    finally:
        shutil.rmtree(venv, ignore_errors=True)
