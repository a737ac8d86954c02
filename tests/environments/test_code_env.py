"""The ``code`` environment: code and test extraction, rewards, metrics and per-sample records,
config errors, the refusal to start without a network namespace, an unprivileged trainer (user
namespaces), and short training runs in-process and on Ray. The hostile snippets are in
test_sandbox.py."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from helpers import config_problems, run_grpoctl, small_trainer
from grpo_sdk.core.records import Message
from grpo_sdk.environments.code_env import CodeEnvironment, extract_code, row_tests
from grpo_sdk.environments.specs import CodeEnvConfig

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the sandbox needs Linux namespaces")
ROOT = os.geteuid() == 0
ADD = "def add(a, b):\n    return a + b"
TESTS = ["assert add(1, 2) == 3", "assert add(2, 2) == 4"]


def log(response: str) -> list[Message]:
    return [Message(role="user", content="Write add(a, b)."), Message(role="assistant", content=response)]


@pytest.fixture(scope="module")
def env():
    environment = CodeEnvironment(CodeEnvConfig(timeout_s=5, cpu_s=2, num_workers=2), context=None)
    yield environment
    environment.shutdown()


@pytest.mark.parametrize("text, expected", [
    (f"Here:\n```python\n{ADD}\n```\nDone.", (ADD + "\n", True)),
    (f"```py\nx = 1\n```\nthen\n```python3\n{ADD}\n```", (ADD + "\n", True)),  # the last one
    (f"```bash\nls\n```\n```\n{ADD}\n```", (ADD + "\n", True)),  # untagged counts, other languages do not
    (f"```python\n{ADD}", (ADD, True)),  # cut off by the length limit
    (ADD, (ADD, False)),  # no fence: the whole text
    ("```bash\nls\n```", ("```bash\nls\n```", False)),
])
def test_code_extraction(text, expected):
    assert extract_code(text) == expected


@pytest.mark.parametrize("meta, message", [
    ({"answer": 1}, "sample 3: row metadata has no 'tests' key (env.code.tests_key); keys: ['answer']"),
    ({"tests": []}, "'tests' must be a non-empty list of test snippets (or one string), got list"),
    ({"tests": {"a": 1}}, "got dict"),
    ({"tests": ["assert True", 3]}, "test 1 is 3, not a non-empty string of Python"),
    ({"tests": ["assert True", "  "]}, "test 1 is '  '"),
    ({"tests": ["assert add(1, 2) = 3"]}, "test 0 is not valid Python"),
])
def test_bad_tests_are_errors_naming_the_sample(meta, message):
    with pytest.raises(ValueError) as info:
        row_tests(meta, "tests", 3)
    assert message in str(info.value)
    assert row_tests({"t": "assert True"}, "t", 0) == ["assert True"]  # one string: one test


def test_rewards_metrics_and_records_of_a_mixed_batch(env):
    responses = [f"```python\n{ADD}\n```", ADD.replace("+", "*"), "def add(a, b) return", "x = bytearray(1 << 40)"]
    metadata = [{"tests": TESTS, "id": i} for i in range(4)]
    ret = env.step([log(r) for r in responses], metadata)
    records = [m["sandbox"] for m in ret.metadata]
    assert [r["outcome"] for r in records] == ["passed", "failed", "error", "killed"]
    assert ret.rewards == {"tests": [1.0, 0.0, 0.0, 0.0]}
    assert records[1]["reason"].startswith("test 0 'assert add(1, 2) == 3' failed: AssertionError")
    assert (records[1]["tests_passed"], records[1]["tests_total"]) == (1, 2)  # 2 * 2 == 4
    assert "SyntaxError" in records[2]["reason"] and "memory limit" in records[3]["reason"]
    assert [m["id"] for m in ret.metadata] == [0, 1, 2, 3] and "sandbox" not in metadata[0]  # merged, not mutated
    assert ret.metrics == {"sandbox_passed": 0.25, "sandbox_failed": 0.25, "sandbox_timeout": 0.0,
                           "sandbox_killed": 0.25, "sandbox_error": 0.25, "test_pass_rate": 1.5 / 4,
                           "fenced_fraction": 0.25}
    assert set(ret.metrics) == set(registry_metrics())


def registry_metrics():
    from grpo_sdk.environments.specs import CODE

    return CODE.metrics


def test_partial_credit_is_the_fraction_of_tests_passed():
    environment = CodeEnvironment(CodeEnvConfig(partial_credit=True, timeout_s=5), context=None)
    try:
        tests = TESTS + ["assert add(0, 0) == 0", "assert add('a', 'b') == 'ab'"]
        ret = environment.step([log(ADD), log(ADD.replace("+", "*")), log("raise ValueError")],
                               [{"tests": tests}] * 3)
        assert ret.rewards == {"tests": [1.0, 0.5, 0.0]}  # a*b: add(2, 2) and add(0, 0) pass
    finally:
        environment.shutdown()


@pytest.mark.parametrize("override, key, message", [
    ("env.code.network_isolation=maybe", "env.code.network_isolation", "expected one of 'required'"),
    ("env.code.cpu_s=30", "env.code.cpu_s", "set cpu_s <= timeout_s"),
    ("env.code.python=/no/such/python", "env.code.python", "not an executable file"),
    ("env.code.hidden_paths=[data]", "env.code.hidden_paths", "must be absolute"),
    ("env.code.hidden_paths=[/tmp]", "env.code.hidden_paths", "neither / nor /tmp"),
    ("env.code.num_workers=0", "env.code.num_workers", ""),
    ("env.code.memory_mb=8", "env.code.memory_mb", ""),
])
def test_bad_options_are_config_errors(registry, override, key, message):
    problems = config_problems(registry, "env.name=code", "data.train_path=x.jsonl", override)
    assert key in problems and message in problems[key], problems


def test_config_validate_exits_2_naming_the_key(tmp_path):
    result = run_grpoctl("config", "validate", "env.name=code", "data.train_path=x.jsonl", "env.code.cpu_s=30",
                         cwd=tmp_path, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "env.code.cpu_s" in result.stderr and "timeout_s" in result.stderr


# A process that cannot make network namespaces: a user namespace of its own whose limit on them is 0.
NO_NETNS = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
ready, go = os.pipe(), os.pipe()
child = os.fork()
if child == 0:
    assert libc.unshare(0x10000000) == 0, os.strerror(ctypes.get_errno())  # CLONE_NEWUSER
    os.write(ready[1], b"x")
    os.read(go[0], 1)  # the parent maps every uid (only a process outside the namespace may)
    with open("/proc/sys/user/max_net_namespaces", "w") as f:
        f.write("0")
    os.execv(sys.argv[1], sys.argv[1:])
os.read(ready[0], 1)
for name in ("uid_map", "gid_map"):
    with open(f"/proc/{child}/{name}", "w") as f:
        f.write("0 0 4294967295")
os.write(go[1], b"x")
sys.exit(os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]))
"""


@pytest.mark.skipif(not ROOT, reason="maps every uid into a user namespace, which takes root")
def test_without_a_network_namespace_it_refuses_unless_told_otherwise(tmp_path):
    wrapper = tmp_path / "no_netns.py"
    wrapper.write_text(NO_NETNS)
    write_rows(tmp_path / "x.jsonl")
    validate = [sys.executable, str(wrapper), sys.executable, "-m", "grpo_sdk.cli.entry", "config", "validate",
                "env.name=code", "data.train_path=x.jsonl", "grpo.val_period=0", "grpo.val_at_end=false"]
    refused = subprocess.run(validate, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert refused.returncode == 2, refused.stderr
    assert "env.code.network_isolation: 'required', but this machine cannot give the sandbox a network" \
           in refused.stderr
    assert "No space left on device" in refused.stderr and "network_isolation=best_effort" in refused.stderr
    allowed = subprocess.run([*validate, "env.code.network_isolation=best_effort"], capture_output=True, text=True,
                             timeout=120, cwd=tmp_path)
    assert allowed.returncode == 0, allowed.stderr

    # best_effort then means what it says: the snippet shares the network, and the sandbox reports the gap
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    probe = tmp_path / "probe.py"
    probe.write_text(textwrap.dedent(f"""
        from grpo_sdk.environments.sandbox import Sandbox
        from grpo_sdk.environments.specs import CodeEnvConfig
        sandbox = Sandbox(CodeEnvConfig(network_isolation="best_effort"))
        result = sandbox.run("import socket\\nsocket.create_connection(('127.0.0.1', {server.getsockname()[1]}))",
                             ["assert True"])
        print(sorted(sandbox.missing), result.outcome)
    """))
    try:
        out = subprocess.run([sys.executable, str(wrapper), sys.executable, str(probe)], capture_output=True,
                             text=True, timeout=120, cwd=tmp_path)
    finally:
        server.close()
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[0] == "['net'] passed"


@pytest.mark.skipif(not ROOT or not os.access("/usr/bin/python3", os.X_OK),
                    reason="runs a trainer as an unprivileged user (needs root to switch, and a system python)")
def test_an_unprivileged_trainer_gets_the_layers_through_a_user_namespace():
    """As uid 65534 there is no uid switch: a user namespace lets it make the other namespaces."""
    version = subprocess.run(["/usr/bin/python3", "-c", "import sys; print(sys.version_info >= (3, 11))"],
                             capture_output=True, text=True).stdout.strip()
    site = next(Path(sys.prefix, "lib").glob("python3*/site-packages"))
    if version != "True" or not (site / "attrs").is_dir():
        pytest.skip("the system python cannot import grpo-sdk's dependencies")
    script = textwrap.dedent("""
        import json
        from grpo_sdk.environments.sandbox import Sandbox
        from grpo_sdk.environments.specs import CodeEnvConfig
        sandbox = Sandbox(CodeEnvConfig(timeout_s=10, cpu_s=2, max_processes=8))
        snippets = ["import os\\nassert os.getuid() == 65534 and os.getpid() == 2",
                    "import socket\\nsocket.create_connection(('127.0.0.1', 22), timeout=2)",
                    "import os\\nwhile True:\\n    os.fork()"]
        results = [sandbox.run(code, ["assert True"]) for code in snippets]
        print(json.dumps({"layers": sandbox.layers, "uid_switch": sandbox.uid_switch,
                          "results": [[r.outcome, r.reason] for r in results]}))
    """)
    src = Path(__file__).resolve().parents[2] / "src"
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{src}:{site}", "HOME": "/nonexistent"}
    out = subprocess.run(["/usr/bin/python3", "-c", script], capture_output=True, text=True, timeout=120, env=env,
                         cwd="/", user=65534, group=65534, extra_groups=[])
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert {"user", "net", "mount", "pid", "proc"} <= set(report["layers"]) and report["uid_switch"] is False
    (passed, _), (net, why_net), (bomb, why_bomb) = report["results"]
    assert passed == "passed" and net == "error" and "Network is unreachable" in why_net
    assert bomb == "killed" and "process limit" in why_bomb


def write_rows(path: Path, count: int = 16) -> Path:
    rows = [{"prompt": f"{i:05d}>", "tests": ["assert True"]} for i in range(count)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


CODE_RUN = ["env.name=code", "env.code.timeout_s=5", "env.code.num_workers=2", "grpo.val_period=0",
            "grpo.val_at_end=false", "checkpointing.enabled=false"]


@pytest.mark.slow
def test_a_short_run_logs_the_sandbox_outcomes(registry, tmp_path, tiny_model_dir):
    """The tiny model's five characters are Python or not: passed and error both occur."""
    from test_sandbox import assert_no_sandbox_processes

    data = write_rows(tmp_path / "rows.jsonl")
    # 16 samples a prompt: enough draws that both outcomes occur whatever the sampler's random stream
    trainer = small_trainer(registry, tmp_path / "run", tiny_model_dir, *CODE_RUN, f"data.train_path={data}",
                            "grpo.num_generations_per_prompt=16")
    try:
        trainer.train()
    finally:
        trainer.shutdown()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        fractions = [row[f"env/sandbox_{o}"] for o in ("passed", "failed", "timeout", "killed", "error")]
        assert sum(fractions) == pytest.approx(1.0), row
        assert row["env/sandbox_passed"] == pytest.approx(row["reward/mean"])
    assert any(r["env/sandbox_passed"] > 0 for r in rows) and any(r["env/sandbox_error"] > 0 for r in rows), rows
    assert_no_sandbox_processes()


@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster")
def test_on_ray_each_environment_actor_has_its_own_sandbox(tmp_path, tiny_model_dir):
    from helpers import bare_trainer, train
    from test_sandbox import assert_no_sandbox_processes

    data = write_rows(tmp_path / "rows.jsonl")
    steps = train(bare_trainer(tmp_path, "ray", *CODE_RUN, "grpo.max_num_steps=2", "grpo.num_prompts_per_step=4",
                              "grpo.num_generations_per_prompt=4", f"policy.model_name={tiny_model_dir}",
                              f"data.train_path={data}", "cluster.runtime=ray", "cluster.env_workers=2"))
    assert len(steps) == 2
    for metrics in steps:
        fractions = [metrics[f"env/sandbox_{o}"] for o in ("passed", "failed", "timeout", "killed", "error")]
        assert sum(fractions) == pytest.approx(1.0), metrics
        assert metrics["env/sandbox_passed"] == pytest.approx(metrics["reward/mean"])
    assert_no_sandbox_processes()  # the actors ran on this machine: its /proc shows what they left


@pytest.mark.skipif(not ROOT, reason="the uid switch needs root")
def test_an_interpreter_the_sandbox_uid_cannot_run_fails_the_start_not_the_samples(tmp_path):
    import tempfile

    from grpo_sdk.environments.sandbox import SandboxError

    private = Path(tempfile.mkdtemp(dir="/var/lib"))  # mode 0700: only the trainer's user enters
    try:
        (private / "python").symlink_to(sys.executable)
        with pytest.raises(SandboxError, match=r"the sandbox's uid cannot run .*/python: Permission denied"):
            CodeEnvironment(CodeEnvConfig(python=str(private / "python")), context=None)
    finally:
        shutil.rmtree(private)
