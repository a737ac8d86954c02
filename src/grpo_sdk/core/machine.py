"""This machine as components see it: its device, its network address, a store served on it.

Light to import: torch and ray are imported inside the functions that need them. Plugins get
these as ``grpo_sdk.plugins.toolkit``; the trainer and the Ray runtime use them too.
"""

from __future__ import annotations

import datetime
import os
import socket
from typing import Any

from grpo_sdk.core.errors import GrpoSdkError

# ``Worker.state`` key: port -> a listening socket that ``Worker.store_address`` opened for a TCPStore.
LISTENING = "grpo_sdk.runtime.listening"


def pick_device(requested: str) -> str:
    """``cluster.device`` (``auto``, ``cpu`` or ``cuda``) as the device this process uses."""
    import torch

    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise GrpoSdkError("cluster.device=cuda but torch sees no CUDA device")
    return requested


def node_ip() -> str:
    """This node's address as Ray knows it (what other nodes reach it by); 127.0.0.1 outside Ray."""
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - outside Ray (unit tests)
        return "127.0.0.1"


def free_port() -> int:
    """A TCP port that was free a moment ago (for a rendezvous that binds it itself)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def tcp_store(worker: Any, host: str, port: int, *, is_master: bool, timeout: datetime.timedelta,
              world_size: int | None = None) -> Any:
    """A ``torch.distributed.TCPStore`` at ``host:port``; the master serves it on the socket its
    ``store_address`` opened (``worker`` is a ``grpo_sdk.plugins.Worker``), on the node's address
    only. Left to itself a TCPStore listens on every interface, and anyone who reaches it can read
    and write its keys."""
    import torch.distributed as dist

    sock = worker.state.get(LISTENING, {}).pop(port, None) if is_master else None
    if is_master and sock is None:
        raise RuntimeError(f"no listening socket for port {port} in this worker (pid {os.getpid()}): the master of a "
                           "store must be the worker whose store_address gave its address")
    fd = sock.detach() if sock is not None else None  # the store owns it from here
    return dist.TCPStore(host, port, world_size, is_master, timeout=timeout, wait_for_workers=False,
                         master_listen_fd=fd)
