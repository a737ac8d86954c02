"""Security: the local Ray cluster is closed to the network and dies with its driver; nothing the
SDK reads from a socket or a file is unpickled.

The cluster tests start the runtime's own cluster (``RayRuntime`` with ``cluster.address`` null)
in a driver subprocess, so each one gets a fresh cluster whatever the rest of the test run has
started, and find that cluster's processes as the driver's descendants in ``/proc`` (Linux).
Every wait is bounded.

The cuda_ipc tests run on the CPU. They prove the wire format: a handle with the field types
torch's ``reduce_tensor`` produces for a CUDA tensor survives the round trip, and a payload that is
garbled, malicious or of the wrong types is refused with an error naming the field. They do not
prove that a real CUDA IPC handle opens in another process (that needs a GPU:
``tests/backends/test_weight_sync_transports.py::test_cuda_ipc_on_a_gpu``).
"""

from __future__ import annotations

import ast
import base64
import contextlib
import ipaddress
import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from grpo_sdk.weight_sync import cuda_ipc
from grpo_sdk.weight_sync.buckets import Entry

SRC = Path(__file__).resolve().parents[2] / "src" / "grpo_sdk"
linux_only = pytest.mark.skipif(not os.path.isdir("/proc/net"), reason="reads processes and sockets from /proc")

# A driver that starts the runtime's own local cluster, reports it, then obeys stdin:
# "stop" shuts the runtime down and reports the RAY_AUTH_* environment; EOF leaves it waiting.
DRIVER = r'''
import json, os, sys
from grpo_sdk.config.loading import load_config
from grpo_sdk.plugins.registry import Registry
from grpo_sdk.runtime.ray_runtime import RayRuntime

registry = Registry.discover()
runtime = RayRuntime(load_config(None, ["cluster.runtime=ray"], registry), registry)
import ray

@ray.remote
def task():
    return os.getpid()

print(json.dumps({"address": runtime.local.address, "task_pid": ray.get(task.remote(), timeout=120),
                  "token": os.environ.get("RAY_AUTH_TOKEN"), "mode": os.environ.get("RAY_AUTH_MODE")}), flush=True)
for line in sys.stdin:
    if line.strip() == "stop":
        runtime.shutdown()
        print(json.dumps({k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")}), flush=True)
        break
'''

# Another process that tries to run code in the cluster: a task that writes a file.
ATTACKER = r'''
import sys, ray

@ray.remote
def task(path):
    open(path, "w").write("ran")
    return "ran"

ray.init(address=sys.argv[1], logging_level="ERROR")
print("RESULT", ray.get(task.remote(sys.argv[2]), timeout=30), flush=True)
'''


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without Ray's settings (the session cluster's token, if any)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


class Driver:
    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-c", DRIVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=clean_env())
        line = self.readline(timeout=240)
        assert line, f"the driver exited ({self.proc.poll()}) before it reported its cluster"
        self.info = json.loads(line)
        self.processes = descendants(self.proc.pid)  # the cluster's processes, with their start times

    def readline(self, timeout: float) -> str:
        import select

        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        return self.proc.stdout.readline() if ready else ""

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        kill_all(self.processes)  # whatever a failed test left


def process_table() -> dict[int, tuple[int, int, str]]:
    """pid -> (parent, start time, state) from /proc."""
    table = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                fields = Path(f"/proc/{entry.name}/stat").read_bytes().rsplit(b")", 1)[1].split()
                table[int(entry.name)] = (int(fields[1]), int(fields[19]), fields[0].decode())
    return table


def descendants(pid: int) -> dict[int, int]:
    table, found, frontier = process_table(), {}, {pid}
    while frontier:
        frontier = {p for p, (parent, _, _) in table.items() if parent in frontier and p not in found}
        found.update({p: table[p][1] for p in frontier})
    return found


def alive(processes: dict[int, int]) -> dict[int, str]:
    """Which of these (same pid and start time) still run; a zombie waiting to be reaped has ended."""
    table = process_table()
    return {pid: Path(f"/proc/{pid}/comm").read_text().strip() if Path(f"/proc/{pid}/comm").exists() else "?"
            for pid, start in processes.items() if pid in table and table[pid][1] == start and table[pid][2] != "Z"}


def wait_gone(processes: dict[int, int], timeout: float) -> dict[int, str]:
    deadline = time.monotonic() + timeout
    while (left := alive(processes)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def kill_all(processes: dict[int, int]) -> None:
    for pid in alive(processes):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def listening(pids: set[int]) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every listening TCP socket of these processes."""
    inodes: dict[str, int] = {}
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith("socket:["):
                        inodes[target[8:-1]] = pid
    found = []
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A" or inode not in inodes:  # 0A: LISTEN
                continue
            hex_address, hex_port = local.split(":")
            raw = b"".join(bytes.fromhex(hex_address[i:i + 8])[::-1] for i in range(0, width, 8))  # host-order words
            found.append((inodes[inode], str(ipaddress.ip_address(raw)), int(hex_port, 16)))
    return found


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def external_ip() -> str | None:
    """The address other machines reach this one at (the one Ray would pick), if it has one."""
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.123", 9))  # no packet is sent: this only picks the outgoing interface
        address = s.getsockname()[0]
        return None if ipaddress.ip_address(address).is_loopback else address
    return None


# --- the local cluster ----------------------------------------------------------------------------


@linux_only
def test_the_local_cluster_listens_on_loopback_only_and_runs_only_tasks_with_its_token(tmp_path):
    """Measured before the fix: GCS, raylet and workers listened on every interface (``*``), the
    runtime-env agent on the external address, RAY_AUTH_MODE=disabled: a task from another process
    ran. Now every socket is on loopback, nothing answers on the external address, a process
    without the token is refused, and one with it (the control: the attack itself works) runs."""
    pytest.importorskip("ray", reason="the Ray runtime needs ray")
    driver = Driver()
    try:
        info = driver.info
        assert info["mode"] == "token" and len(info["token"]) == 64
        sockets = listening(set(driver.processes) | {driver.proc.pid})
        assert {pid for pid, _, _ in sockets} >= {driver.proc.pid}  # the driver's own core worker, at least
        assert len(sockets) >= 4, sockets  # GCS, raylet (2), the driver, workers
        assert [s for s in sockets if not is_loopback(s[1])] == []
        host, port = info["address"].rsplit(":", 1)
        assert is_loopback(host)

        ip = external_ip()
        attacks = {}
        if ip is not None:
            for _, _, p in sockets:  # nothing of the cluster answers on the external address
                with pytest.raises(OSError), socket.create_connection((ip, p), timeout=5):
                    pass
            attacks["external"] = (f"{ip}:{port}", clean_env())
        # The loopback attacks run in a node that believes itself on loopback, so that what stops
        # them is authentication, not a missing raylet.
        local = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
        attacks["no token"] = (info["address"], clean_env(**local))
        attacks["wrong token"] = (info["address"], clean_env(**local, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="0" * 64))
        attacks["the token"] = (info["address"],
                                clean_env(**local, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=info["token"]))
        procs = {name: subprocess.Popen([sys.executable, "-c", ATTACKER, address, str(tmp_path / name)], env=env,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for name, (address, env) in attacks.items()}
        outputs, deadline = {}, time.monotonic() + 35
        for name, proc in procs.items():
            try:
                outputs[name] = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))[0]
            except subprocess.TimeoutExpired:  # still retrying to connect: it never got in
                proc.kill()
                outputs[name] = proc.communicate(timeout=30)[0]
        ran = {name for name in attacks if (tmp_path / name).exists()}
        assert ran == {"the token"}, {name: outputs[name][-600:] for name in attacks}
        assert "RESULT ran" in outputs["the token"]

        driver.proc.stdin.write("stop\n")
        driver.proc.stdin.flush()
        env_after = json.loads(driver.readline(timeout=120))
        assert env_after == {"RAY_AUTH_MODE": None, "RAY_AUTH_TOKEN": None}  # the driver's environment restored
        assert wait_gone(driver.processes, timeout=30) == {}
    finally:
        driver.close()


@linux_only
def test_a_driver_killed_with_sigkill_leaves_no_process_of_its_cluster():
    """Measured before the fix: GCS, raylet and workers went within 5 s, but the dashboard and
    runtime-env agents ran for another ~60 s (they report the raylet's death to the dead GCS with
    a 60 s timeout). Now the runtime's watchdog kills them at once."""
    pytest.importorskip("ray", reason="the Ray runtime needs ray")
    driver = Driver()
    try:
        names = set(alive(driver.processes).values())
        assert {"gcs_server", "raylet"} <= names and any(name.startswith("ray::Dashboard") for name in names), names
        assert driver.info["task_pid"] in driver.processes
        os.kill(driver.proc.pid, signal.SIGKILL)
        driver.proc.wait(timeout=30)
        start = time.monotonic()
        assert wait_gone(driver.processes, timeout=30) == {}
        assert time.monotonic() - start < 10  # the watchdog polls every WATCH_INTERVAL_S
    finally:
        driver.close()


def test_token_auth_is_on_by_default_and_an_explicit_setting_is_kept(monkeypatch, caplog):
    pytest.importorskip("ray", reason="the Ray runtime needs ray")
    from grpo_sdk.runtime import local_cluster

    monkeypatch.setattr(local_cluster, "_refresh_ray_auth", lambda: None)  # this process may hold a live cluster
    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    saved = local_cluster._token_auth()
    assert saved == {"RAY_AUTH_MODE": None, "RAY_AUTH_TOKEN": None}
    token = os.environ["RAY_AUTH_TOKEN"]
    assert os.environ["RAY_AUTH_MODE"] == "token" and len(bytes.fromhex(token)) == 32
    local_cluster._set_env(saved)
    assert "RAY_AUTH_MODE" not in os.environ and "RAY_AUTH_TOKEN" not in os.environ

    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", "/operator/token")  # the operator's token is used, none generated
    local_cluster._token_auth()
    assert os.environ["RAY_AUTH_MODE"] == "token" and "RAY_AUTH_TOKEN" not in os.environ
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH")

    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # never overridden, never silent
    with caplog.at_level("WARNING", logger="grpo_sdk.runtime.local_cluster"):
        local_cluster._token_auth()
    assert os.environ["RAY_AUTH_MODE"] == "disabled" and "RAY_AUTH_TOKEN" not in os.environ
    assert "RAY_AUTH_MODE=disabled: the local Ray cluster runs without token authentication" in caplog.text


# --- cuda_ipc: the handle format --------------------------------------------------------------------


def torch_like_handle(length=4096, *, device=0, offset=0):
    """``reduce_tensor``'s arguments for a flat uint8 CUDA buffer, with the types torch gives them
    (torch/multiprocessing/reductions.py: ``rebuild_cuda_tensor``'s parameters, ``_share_cuda_``'s
    tuple): a 64-byte cudaIpcMemHandle behind a type byte, the ref-counter's shared-memory name,
    a 64-byte cudaIpcEventHandle."""
    return (torch.Tensor, torch.Size([length]), (1,), offset, torch.storage.TypedStorage, torch.uint8,
            device, b"l" + bytes(range(64)), 2 * length, 512, False, b"/torch_1234_5678_0", 8,
            bytes(range(64, 128)), True)


def test_a_cuda_ipc_handle_survives_the_round_trip_through_json(monkeypatch):
    from torch.multiprocessing import reductions

    args = torch_like_handle()
    monkeypatch.setattr(reductions, "reduce_tensor", lambda buffer: (reductions.rebuild_cuda_tensor, args))
    handle = cuda_ipc.share_cuda(torch.empty(0))
    entries = [Entry(name="w", shape=(4, 8), dtype=torch.bfloat16, offset=0, nbytes=64),
               Entry(name="b", shape=(8,), dtype=torch.float32, offset=64, nbytes=32)]
    payload = cuda_ipc.encode_bucket(handle, entries)
    got_handle, got_entries = cuda_ipc.decode_bucket(payload)
    assert got_entries == entries
    assert cuda_ipc.decode_handle(got_handle) == args

    opened = []
    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", lambda *a: opened.append(a) or "mapped")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert cuda_ipc.open_cuda(got_handle) == "mapped"
    assert opened == [args[:6] + (3,) + args[7:]]  # the receiver's device; our classes, our rebuild function


def test_torch_shares_a_cuda_tensor_with_the_fields_the_format_expects():
    """The handle layout the format hard-codes is the one this torch's rebuild function takes."""
    import inspect

    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    params = list(inspect.signature(rebuild_cuda_tensor).parameters)
    assert params[6:] == [name for name, _ in cuda_ipc.HANDLE_FIELDS]
    assert len(params) == len(torch_like_handle())


def handle_json(**changes):
    handle = cuda_ipc.encode_handle(4096, 0, torch_like_handle()[6:])
    handle.update(changes)
    return handle


class Evil:
    def __reduce__(self):
        return (os.system, ("touch /tmp/grpo_sdk_pwned",))


@pytest.mark.parametrize("handle, message", [
    ({**handle_json(), "rebuild": "os.system"}, "has fields"),
    ({k: v for k, v in handle_json().items() if k != "event_handle"}, "has fields"),
    ("posix.system", "has fields"),
    (handle_json(storage_device="0"), "'storage_device' is '0'; expected a non-negative integer"),
    (handle_json(storage_size_bytes=True), "'storage_size_bytes' is True; expected a non-negative integer"),
    (handle_json(ref_counter_offset=-8), "'ref_counter_offset' is -8"),
    (handle_json(requires_grad=1), "'requires_grad' is 1; expected true or false"),
    (handle_json(requires_grad=True), "requires_grad is true"),
    (handle_json(storage_handle="not base64!"), "'storage_handle' is not base64"),
    (handle_json(event_handle=base64.b64encode(bytes(5000)).decode()), "expected base64 of at most 4096 bytes"),
    (handle_json(storage_handle=[1, 2]), "'storage_handle' is [1, 2]"),
    (handle_json(length=1 << 40), "lie outside its storage of 8192 bytes"),
])
def test_a_malformed_cuda_ipc_handle_is_refused_naming_the_field(handle, message):
    with pytest.raises(ValueError, match="cuda_ipc weight sync: a received CUDA IPC handle") as info:
        cuda_ipc.decode_handle(handle)
    assert message in str(info.value)


def good_entry(**changes):
    return {"name": "w", "shape": [4, 8], "dtype": "float32", "offset": 0, "nbytes": 128, **changes}


def bucket(*entries, **fields) -> bytes:
    return json.dumps({"format": cuda_ipc.FORMAT, "handle": 1, "entries": list(entries), **fields}).encode()


@pytest.mark.parametrize("payload, message", [
    (pickle.dumps((Evil(), [])), "is not JSON"),
    (b"\xff\xfe", "is not JSON"),
    (b"[1, 2]", "is not a grpo_sdk.cuda_ipc/1 payload"),
    (bucket(format="grpo_sdk.cuda_ipc/0"), "format 'grpo_sdk.cuda_ipc/0'"),
    (bucket(entries={}), "'entries' is not a list"),
    (bucket(good_entry(extra=1)), "exactly the fields"),
    (bucket(good_entry(dtype="os.system")), "dtype 'os.system' is not a torch dtype"),
    (bucket(good_entry(name=7)), "'name' is 7"),
    (bucket(good_entry(shape="4x8")), "shape '4x8' is not a list"),
    (bucket(good_entry(shape=[4, -8])), "a dimension is -8"),
    (bucket(good_entry(nbytes=1 << 30)), "bytes do not hold a [4, 8] torch.float32 tensor"),
])
def test_a_garbled_or_malicious_bucket_is_refused_and_runs_nothing(payload, message):
    marker = Path("/tmp/grpo_sdk_pwned")
    marker.unlink(missing_ok=True)
    with pytest.raises(ValueError, match="cuda_ipc weight sync: a received bucket") as info:
        cuda_ipc.decode_bucket(payload)
    assert message in str(info.value)
    assert not marker.exists()


class DictStore:
    """The three TCPStore calls the channel makes, on a dict (a get of a missing key is a bug here)."""

    def __init__(self):
        self.data = {}

    def set(self, key, value):
        self.data[key] = value if isinstance(value, bytes) else value.encode()

    def get(self, key):
        return self.data[key]

    def delete_key(self, key):
        return self.data.pop(key, None) is not None


def test_a_receiver_refuses_a_bad_bucket_and_tells_the_sender():
    store = DictStore()
    channel = cuda_ipc.Channel(store, "g/1/0")
    buffer = torch.zeros(64, dtype=torch.uint8)
    channel.publish(0, bucket(good_entry(shape=[32])))  # 128 bytes, in a buffer of 64
    with pytest.raises(ValueError, match=r"'w' at bytes 0\.\.128 lies outside buffer 0 \(64 bytes\)"):
        list(cuda_ipc.receive_buckets(channel, open_=lambda handle: buffer, device="cpu"))
    with pytest.raises(RuntimeError, match="could not read buffer 0: ValueError: cuda_ipc weight sync: 'w'"):
        channel.wait_acknowledged(0)

    channel = cuda_ipc.Channel(store, "g/2/0")
    channel.publish(0, pickle.dumps((Evil(), [])))
    with pytest.raises(ValueError, match="is not JSON"):
        list(cuda_ipc.receive_buckets(channel, open_=lambda handle: buffer, device="cpu"))
    assert not Path("/tmp/grpo_sdk_pwned").exists()


# --- no unpickling anywhere in the package ----------------------------------------------------------

UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "cloudpickle", "dill", "marshal", "shelve", "joblib"}
WRITE_ONLY = {"dumps", "HIGHEST_PROTOCOL"}
"""What may be imported from pickle by name: writing a payload an engine's wire protocol demands
(SGLang's serialized tensors, TensorRT-LLM's IPC handles), which the engine reads, never grpo-sdk."""


def unsafe_uses(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if a.name.split(".")[-1] in UNSAFE_MODULES]
        elif isinstance(node, ast.ImportFrom):
            names = {(node.module or "").split(".")[-1], *(a.name for a in node.names)}
            write_only = node.module == "pickle" and {a.name for a in node.names} <= WRITE_ONLY
            if names & UNSAFE_MODULES and not write_only:
                found.append(f"from {node.module} import ...")
        elif isinstance(node, ast.Attribute) and node.attr in UNSAFE_MODULES:
            found.append(f"{ast.unparse(node)}")  # ray.cloudpickle, torch.serialization.pickle, ...
        elif isinstance(node, ast.Call):
            call = ast.unparse(node.func)
            keywords = {k.arg: k.value for k in node.keywords}
            value = keywords.get("weights_only")
            if call.endswith("torch.load") and not (isinstance(value, ast.Constant) and value.value is True):
                found.append(f"{call}(...) without weights_only=True")
            if call in ("np.load", "numpy.load") and "allow_pickle" in keywords:
                found.append(f"{call}(..., allow_pickle=...)")
    return found


def test_no_module_of_the_package_unpickles():
    """By AST, over every module of src/grpo_sdk: no pickle/marshal/shelve/dill/cloudpickle import or
    attribute (but ``from pickle import dumps``: writing an engine's payload), no torch.load without
    weights_only=True, no numpy.load with allow_pickle. (Ray pickles its own calls and results; that
    is Ray's channel, authenticated by its token.)"""
    modules = sorted(SRC.rglob("*.py"))
    assert len(modules) > 20
    problems = {str(path.relative_to(SRC)): uses for path in modules
                if (uses := unsafe_uses(ast.parse(path.read_text(), filename=str(path))))}
    assert problems == {}


def test_the_unpickling_check_finds_what_it_looks_for():
    code = ("import pickle\nfrom marshal import loads\nfrom pickle import dumps, loads\nfrom pickle import dumps\n"
            "import torch\nimport numpy as np\nimport ray\n"
            "torch.load(f)\ntorch.load(f, weights_only=False)\ntorch.load(f, weights_only=True)\n"
            "np.load(f, allow_pickle=True)\nray.cloudpickle.loads(b)\n")
    assert sorted(unsafe_uses(ast.parse(code))) == sorted([
        "import pickle", "from marshal import ...", "from pickle import ...", "torch.load(...) without weights_only=True",
        "torch.load(...) without weights_only=True", "np.load(..., allow_pickle=...)", "ray.cloudpickle"])
