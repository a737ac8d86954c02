"""The process group an inference engine's weight-update route joins, built the way the engines build it.

SGLang's ``init_weights_update_group``, vLLM's and Dynamo's ``init_weights_update_group`` and
NeMo-RL's TensorRT-LLM collective extension all form their side of the trainer's broadcast group
with the same few calls (SGLang's ``init_custom_process_group``, copied by OpenRLHF, AReaL,
NeMo-RL, SkyRL): a torch ``rendezvous`` at ``tcp://master_address:master_port`` whose rank 0 (the
trainer) hosts the store, the store prefixed with the group's name, then torch's
``_new_process_group_helper``. Policy rank 0 must build its side exactly so, or the two ends wait
for keys the other never writes; this is that one construction, used by the ``collective``
transport (rank 0), by the engine side of backends that run their own receiver (TensorRT-LLM's
worker extension) and by the test servers that stand in for the engines (tests/engine_servers).
Public through ``grpo_sdk.plugins.toolkit``.
"""

from __future__ import annotations

import datetime
import inspect
import socket
from typing import Any


def host_store(address: str, *, world_size: int, timeout_s: float) -> tuple[Any, int]:
    """Rank 0's store, listening on ``address`` only (a rendezvous's store listens on every
    interface, and anyone who reaches it can write its keys), on a port chosen now: ``(store, port)``.
    The engines connect to it as the clients of their rendezvous do."""
    import torch.distributed as dist

    sock = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((address, 0))
    sock.listen(1024)
    port = int(sock.getsockname()[1])
    store = dist.TCPStore(address, port, world_size, True, timeout=datetime.timedelta(seconds=timeout_s),
                          wait_for_workers=False, master_listen_fd=sock.detach())
    return store, port


def join_process_group(*, backend: str, master_address: str, master_port: int, world_size: int, rank: int,
                       group_name: str, timeout_s: float, store: Any = None) -> Any:
    """Join the group and return it; every rank must call this within ``timeout_s``. ``store``: rank
    0's own (``host_store``); without it, the rendezvous the engines do (rank 0 then hosts it)."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store, rank, world_size = next(rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size,
                                                  timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    # torch 2.6 renamed pg_options to backend_options; the engines pass whichever their torch has.
    options = "backend_options" if "backend_options" in inspect.signature(_new_process_group_helper).parameters \
        else "pg_options"
    group, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=group_name,
                                         timeout=timeout, **{options: None})
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def leave_process_group(group: Any) -> None:
    """Tear the group down (a later sync may build a new one under another name)."""
    import torch.distributed as dist

    try:
        dist.destroy_process_group(group)
    except (AssertionError, RuntimeError, ValueError):  # not registered as torch expects: drop it
        pass
