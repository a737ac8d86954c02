"""The local Ray cluster (``cluster.address`` null): started by ``start_local_cluster``, this process's alone.

Every server of it listens on loopback, it requires a token that this run generates (Ray's token
authentication; ``RAY_AUTH_MODE=disabled`` turns it off, with a warning), and a watchdog process
(``watch``) kills what is left of it when this process dies, even by SIGKILL. A module of its own
because none of it is about placing or calling workers (``grpo_sdk.runtime.ray_runtime``, which
starts one when it owns the cluster): it is process and environment plumbing around ``ray.init``.
A multi-node cluster is the operator's: see docs/distributed.md, "Security".
"""

from __future__ import annotations

import contextlib
import importlib.util
import ipaddress
import logging
import os
import secrets
import select
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from grpo_sdk.core.errors import GrpoSdkError

__all__ = ["LocalCluster", "start_local_cluster", "watch"]

log = logging.getLogger(__name__)

AUTH_ENV = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")  # what start_local_cluster may set, and LocalCluster.stop restores
WATCH_INTERVAL_S = 0.5  # how often the watchdog looks for new processes of the cluster, and for the driver


# --- the local cluster: loopback only, token auth, gone with its driver ---------------------------------


class LocalCluster:
    """A Ray cluster this process started (``start_local_cluster``); ``stop`` ends it."""

    def __init__(self, address: str, saved_env: dict[str, str | None], watchdog: subprocess.Popen | None):
        self.address, self.saved_env, self.watchdog = address, saved_env, watchdog

    def stop(self) -> None:
        import ray

        try:
            ray.shutdown()
        finally:
            if self.watchdog is not None:
                self.watchdog.stdin.close()  # the watchdog kills what ray.shutdown left (an agent, a worker)
                try:
                    self.watchdog.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    self.watchdog.kill()
                    self.watchdog.wait(timeout=10)
                self.watchdog = None
            _restore_auth(self.saved_env)


def start_local_cluster(**options: Any) -> LocalCluster:
    """``ray.init(**options)`` of a new single-node cluster that only this process can use.

    * Every server (GCS, raylet, workers, agents) listens on loopback: Ray listens on its node's
      address, so the node's address is loopback. A Ray that will not do that is refused.
    * Token authentication, with a token of this run in the environment (no ``~/.ray/auth_token``
      written), unless the operator set ``RAY_AUTH_MODE`` or a token (``RAY_AUTH_TOKEN[_PATH]``).
    * On Linux a watchdog process kills every process of the cluster once this one is gone: Ray
      kills GCS and raylet with their parent (PDEATHSIG), but its agents outlive them by a minute
      (they report the raylet's death to the dead GCS first, with a 60 s timeout).
    """
    import ray

    saved = _token_auth()
    before = _children(os.getpid())
    # "local": a new cluster, always. Without an address ray.init joins the last cluster started on
    # the machine (/tmp/ray/ray_current_cluster: anyone's `ray start`), with its owner's settings.
    options.setdefault("address", "local")
    try:
        with _loopback_node():
            context = ray.init(**options)
        node_ip = context.address_info["node_ip_address"]
        if not ipaddress.ip_address(node_ip).is_loopback:
            ray.shutdown()
            raise GrpoSdkError(
                f"ray {ray.__version__} started the local cluster on {node_ip}, not on loopback, so it would be "
                "open to the network; refusing to run it. Start a cluster yourself (`ray start --head "
                "--node-ip-address=...`, see docs/distributed.md, Security) and set cluster.address")
    except BaseException:
        _restore_auth(saved)
        raise
    return LocalCluster(context.address_info["gcs_address"], saved,
                        _start_watchdog({pid: start for pid, start in _children(os.getpid()).items()
                                         if before.get(pid) != start}))


def _token_auth() -> dict[str, str | None]:
    """Ray's token auth for the cluster about to start; the environment as it was."""
    saved = {name: os.environ.get(name) for name in AUTH_ENV}
    mode = os.environ.get("RAY_AUTH_MODE")
    if importlib.util.find_spec("ray._private.authentication") is None:
        import ray

        log.warning(f"ray {ray.__version__} has no token authentication: any process on this machine can run "
                    "code in the local cluster (it listens on loopback only); a newer Ray has it")
    elif mode is None or mode.lower() == "token":
        os.environ["RAY_AUTH_MODE"] = "token"
        if not (os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH")):
            os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)  # Ray's own token size; inherited by its processes
    else:
        log.warning(f"RAY_AUTH_MODE={mode}: the local Ray cluster runs without token authentication, so any "
                    "process on this machine can run code in it (it listens on loopback only); unset "
                    "RAY_AUTH_MODE to turn authentication on")
    _refresh_ray_auth()
    return saved


def _refresh_ray_auth() -> None:
    """Make an imported Ray see RAY_AUTH_* as they are now. It reads them once, at import; ray.init()
    refreshes them itself only when RAY_AUTH_MODE is unset (as ``ray.init`` does, config first)."""
    try:
        from ray._raylet import AuthenticationTokenLoader, Config
    except ImportError:  # a Ray without token auth
        return
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def _restore_auth(saved: dict[str, str | None]) -> None:
    # The mode first, then the token: a gRPC thread of the old cluster still draining must not find
    # token mode without a token (a fatal RAY_CHECK in Ray).
    _set_env({"RAY_AUTH_MODE": saved["RAY_AUTH_MODE"]})
    _refresh_ray_auth()
    _set_env(saved)


def _set_env(values: dict[str, str | None]) -> None:
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@contextlib.contextmanager
def _loopback_node():
    """Ray takes its node's address from the route to the internet and turns an explicit 127.0.0.1
    (``_node_ip_address``) into that too; the switch it keeps for Windows and macOS (loopback, for no
    firewall prompts) is what keeps a local cluster on loopback. Checked after ``ray.init``."""
    from ray._private import ray_constants

    if not hasattr(ray_constants, "ENABLE_RAY_CLUSTER"):
        yield
        return
    saved = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved


# --- the watchdog: a process of its own, started by start_local_cluster ----------------------------------


def _processes() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, start time in clock ticks) of every process, from /proc (Linux)."""
    table = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()  # the name, in parentheses, may hold anything
        except OSError:  # gone meanwhile
            continue
        table[int(entry.name)] = (int(fields[1]), int(fields[19]))
    return table


def _children(pid: int) -> dict[int, int]:
    """pid -> start time of the direct children of ``pid`` (none where there is no /proc)."""
    if not os.path.isdir("/proc"):
        return {}
    return {child: start for child, (parent, start) in _processes().items() if parent == pid}


def _start_watchdog(roots: dict[int, int]) -> subprocess.Popen | None:
    if not roots or not sys.platform.startswith("linux"):
        return None
    import grpo_sdk

    source_root = str(Path(grpo_sdk.__file__).resolve().parent.parent)  # also when run from a source tree
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_TOKEN"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [source_root, os.environ.get("PYTHONPATH")]))
    # Its own session: a Ctrl-C to the driver's process group does not stop it before it has cleaned up.
    return subprocess.Popen([sys.executable, "-c", "from grpo_sdk.runtime.local_cluster import watch; watch()",
                             str(os.getpid()), *(f"{pid}:{start}" for pid, start in roots.items())],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env, start_new_session=True)


def watch() -> None:
    """The watchdog: ``python -c ... DRIVER PID:START...``. It follows the given processes and their
    descendants until the driver closes its stdin or dies (the watchdog is then re-parented), then
    SIGKILLs every one still running (same pid and start time: never a reused pid)."""
    driver, known = int(sys.argv[1]), {int(p): int(t) for p, t in (arg.split(":") for arg in sys.argv[2:])}
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        table = _processes()
        grew = True
        while grew:  # every descendant, however deep, of a process known to be the cluster's
            found = {pid: start for pid, (parent, start) in table.items()
                     if pid not in known and parent in known and table.get(parent, (0, -1))[1] == known[parent]}
            known.update(found)
            grew = bool(found)
        ready, _, _ = select.select([sys.stdin], [], [], WATCH_INTERVAL_S)
        if (ready and not os.read(sys.stdin.fileno(), 4096)) or os.getppid() != driver:
            break
    table = _processes()
    for pid, start in known.items():
        if pid != os.getpid() and table.get(pid, (0, -1))[1] == start:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
