"""The collective transport when the engine receives the broadcast itself (``ReceivesBroadcast``).

An inference server (SGLang, TensorRT-LLM with its collective extension, a Dynamo deployment) has
its own weight-update route: its workers join a process group whose rank 0 is the trainer and
receive one broadcast per tensor, told beforehand the names, shapes and dtypes to expect. The
transport then plays rank 0 that way instead of packing byte buckets for its own receivers:

* the group is built the engines' way (``toolkit.join_process_group``), named uniquely per
  transport instance, at the first sync: rank 0 joins while each generation replica's
  ``join_broadcast`` makes its engine join at its rank offset (replica i's ranks follow replica
  i-1's ``broadcast_ranks()``);
* the plan (the tensors of ``named_weights`` in order, cut into batches of at most ``bucket_mb``)
  is made then too; each sync, for each batch, every replica's ``receive_broadcast(batch)`` is in
  flight while rank 0 broadcasts the batch's tensors one by one; the last batch says
  ``last=True``, so the engine flushes its cache and takes the new version.

Where rank 0 runs: in the local runtime the driver holds the policy and is rank 0, and a thread per
sync carries the engine's (blocking, HTTP) receive calls; on Ray policy rank 0 is, and each
generation worker calls its component. Either way every call has the sync's deadline and the group
the same timeout, so a dead or stuck engine fails the sync with its own error, never a hang.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import time
import uuid
from typing import Any, Iterator, Sequence

from grpo_sdk.plugins import PluginError, ReceivesBroadcast, SyncStats
from grpo_sdk.plugins.toolkit import free_port, host_store, join_process_group, node_ip, tcp_store
from grpo_sdk.weight_sync.buckets import check_entry, describe, plan_buckets

STATE_KEY = "grpo_sdk.weight_sync.engine_broadcast"


def dtype_name(dtype: Any) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``: how the engines' routes spell a dtype."""
    return str(dtype).removeprefix("torch.")


def batch_specs(batch: Any) -> list[tuple[str, tuple[int, ...], str]]:
    return [(entry.name, entry.shape, dtype_name(entry.dtype)) for entry in batch.entries]


def engine_receivers(generation: Any) -> bool:
    """Whether ``generation`` (a component, or a Ray worker group of them) receives broadcasts itself."""
    methods = getattr(generation, "methods", None)
    if methods is not None and hasattr(generation, "workers"):  # a worker group: what its components have
        return "receive_broadcast" in methods
    return isinstance(generation, ReceivesBroadcast)


# --- rank 0's end of the group, in the engine's kind ----------------------------------------------------

PEERS = ("torch", "vllm")


def peer_of(component: Any) -> str:
    """Which kind of group the engine's workers build (``ReceivesBroadcast.broadcast_peer``)."""
    peer = getattr(component, "broadcast_peer", "torch")
    if peer not in PEERS:
        raise ValueError(f"broadcast_peer must be one of {', '.join(PEERS)}, got {peer!r}")
    return peer


class TorchSender:
    """A torch group built as SGLang's ``init_custom_process_group`` builds it (the toolkit's)."""

    def __init__(self, *, backend: str, address: str, port: int, world_size: int, group_name: str,
                 timeout_s: float, store: Any):
        import torch

        self.group = join_process_group(backend=backend, master_address=address, master_port=port,
                                        world_size=world_size, rank=0, group_name=group_name, timeout_s=timeout_s,
                                        store=store)
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")

    def broadcast(self, tensor: Any) -> None:
        import torch.distributed as dist

        dist.broadcast(tensor.detach().to(self.device).contiguous(), src=0, group=self.group)


class VLLMSender:
    """vLLM's trainer end: a ``StatelessProcessGroup`` (its own store keys) and a ``PyNcclCommunicator``,
    what vLLM's NCCL weight-transfer engine on the workers (Dynamo's ``dynamo.vllm``) joins.
    NOT RUN HERE: it needs CUDA and vllm on the trainer; the vLLM lane pins the calls against
    vLLM's signatures (tests/backends/test_vllm.py)."""

    def __init__(self, *, address: str, port: int, world_size: int, **_: Any):
        try:
            from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
            from vllm.distributed.utils import StatelessProcessGroup
        except ImportError:
            raise PluginError("the generation engine's workers build vLLM's weight-transfer group, so the trainer's "
                              "rank 0 needs vllm installed: pip install 'grpo-sdk[vllm]'") from None
        import torch

        self.device = torch.device("cuda", torch.cuda.current_device())
        group = StatelessProcessGroup.create(host=address, port=port, rank=0, world_size=world_size)
        self.comm = PyNcclCommunicator(group, device=self.device)

    def broadcast(self, tensor: Any) -> None:
        import torch

        self.comm.broadcast(tensor.detach().to(self.device).contiguous(), src=0, stream=torch.cuda.current_stream())


def open_sender(peer: str, **kwargs: Any) -> Any:
    return VLLMSender(**kwargs) if peer == "vllm" else TorchSender(**kwargs)


def broadcast_plan(plan: Sequence[Any], weights: Iterator[tuple[str, Any]], sender: Any) -> tuple[int, int]:
    """Rank 0: broadcast each tensor of the plan, in order, from ``weights``; (tensors, bytes)."""
    tensors = num_bytes = 0
    for batch in plan:
        for entry in batch.entries:
            item = next(weights, None)
            problem = f"it ended before {entry.name!r}" if item is None else check_entry(entry, *item)
            if problem is not None:
                raise ValueError(f"collective weight sync: policy rank 0's named_weights() no longer matches the plan "
                                 f"made at the first sync ({problem}); a policy backend must yield the same names, "
                                 "shapes and dtypes at every sync")
            sender.broadcast(item[1])
            tensors += 1
            num_bytes += entry.nbytes
    return tensors, num_bytes


def receive_plan(component: Any, plan: Sequence[Any], group_name: str, version: int) -> None:
    """A generation replica: its engine receives the plan's batches, the last one finishing the update."""
    for i, batch in enumerate(plan):
        component.receive_broadcast(batch_specs(batch), group_name=group_name, version=version,
                                    last=i == len(plan) - 1)


# --- the local runtime: the driver is rank 0 ---------------------------------------------------------


class LocalEngineBroadcast:
    """Rank 0 in this process. Rank 0's part and the engine's (blocking, HTTP) part run on two
    threads, and the first to fail ends the sync: an engine that answers 400 is reported at once,
    not after rank 0's broadcast has timed out waiting for it."""

    def __init__(self, *, backend: str, bucket_bytes: int, timeout_s: float, master_address: str | None):
        self.backend, self.bucket_bytes, self.timeout_s = backend, bucket_bytes, timeout_s
        self.master_address = master_address
        self.sender: Any = None
        self.group_name = ""
        self.plan: list[Any] = []
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="grpo-engine-broadcast")

    def sync_weights(self, policy: Any, generation: Any, *, version: int) -> SyncStats:
        start = time.perf_counter()
        if self.sender is None:
            self._form_group(policy, generation)
        sending = self.pool.submit(broadcast_plan, self.plan, iter(policy.named_weights()), self.sender)
        receiving = self.pool.submit(receive_plan, generation, self.plan, self.group_name, version)
        tensors, num_bytes = self._both(sending, receiving, "receive the weights")
        return SyncStats(version=version, num_tensors=tensors, num_bytes=num_bytes,
                         seconds=time.perf_counter() - start)

    def _both(self, rank0: concurrent.futures.Future, engine: concurrent.futures.Future, what: str) -> Any:
        """rank 0's result once both parts are done; the first error (the engine's first) otherwise."""
        done, _ = concurrent.futures.wait([rank0, engine], timeout=self.timeout_s,
                                          return_when=concurrent.futures.FIRST_EXCEPTION)
        for future in (engine, rank0):
            if future in done and future.exception() is not None:
                self.sender = None  # a broken group is never reused: the run fails here anyway
                raise future.exception()
        if len(done) < 2:
            self.sender = None
            who = "the generation engine" if engine not in done else "policy rank 0"
            raise TimeoutError(f"collective weight sync: {who} did not {what} within {self.timeout_s:g} s "
                               "(weight_sync.collective.timeout_s, default cluster.call_timeout_s)")
        return rank0.result()

    def _form_group(self, policy: Any, generation: Any) -> None:
        plan = plan_buckets(describe(policy.named_weights()), self.bucket_bytes)
        address = self.master_address or node_ip()
        name = f"grpo_sdk_weights_{uuid.uuid4().hex[:12]}"
        world_size = 1 + int(generation.broadcast_ranks())
        peer = peer_of(generation)
        # vLLM's group makes its own store (rank 0 binds the port); ours listens on `address` only.
        store, port = (None, free_port()) if peer == "vllm" else host_store(address, world_size=world_size,
                                                                              timeout_s=self.timeout_s)
        joining = self.pool.submit(generation.join_broadcast, master_address=address, master_port=port, rank_offset=1,
                                   world_size=world_size, group_name=name, backend=self.backend)
        hosting = self.pool.submit(open_sender, peer, backend=self.backend, address=address, port=port,
                                   world_size=world_size, group_name=name, timeout_s=self.timeout_s, store=store)
        self.sender = self._both(hosting, joining, "join the weight-update group")
        self.plan, self.group_name = plan, name

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


# --- Ray: policy rank 0 and the generation workers (module functions: Ray pickles them by reference) ---


def address_op(worker: Any, peer: str) -> tuple[str, int]:
    """Policy rank 0: where the engines reach it (a socket on this node's address, kept for its store;
    for vLLM's group, which binds its own, a port free a moment ago)."""
    return (node_ip(), free_port()) if peer == "vllm" else worker.store_address()


def peer_op(worker: Any) -> str:
    return peer_of(worker.component)


def ranks_op(worker: Any) -> int:
    return int(worker.component.broadcast_ranks())


def join_sender_op(worker: Any, peer: str, group_name: str, address: str, port: int, world_size: int, backend: str,
                   timeout_s: float, plan: list[Any]) -> None:
    store = None if peer == "vllm" else tcp_store(worker, address, port, is_master=True, world_size=world_size,
                                                  timeout=datetime.timedelta(seconds=timeout_s))  # node address only
    sender = open_sender(peer, backend=backend, address=address, port=port, world_size=world_size,
                         group_name=group_name, timeout_s=timeout_s, store=store)
    worker.state[STATE_KEY] = {"name": group_name, "sender": sender, "plan": plan}


def join_receiver_op(worker: Any, group_name: str, address: str, port: int, rank_offset: int, world_size: int,
                     backend: str) -> None:
    worker.component.join_broadcast(master_address=address, master_port=port, rank_offset=rank_offset,
                                    world_size=world_size, group_name=group_name, backend=backend)


def send_op(worker: Any, group_name: str) -> tuple[int, int] | None:
    """Policy ranks: all drain ``named_weights`` (a collective under FSDP2); rank 0 broadcasts."""
    weights = iter(worker.component.named_weights())
    try:
        if worker.rank != 0:
            return None
        state = worker.state.get(STATE_KEY)
        if state is None or state["name"] != group_name:
            raise RuntimeError(f"collective weight sync: policy rank 0 is not in the engines' group {group_name}")
        return broadcast_plan(state["plan"], weights, state["sender"])
    finally:
        for _ in weights:
            pass


def receive_op(worker: Any, group_name: str, plan: list[Any], version: int) -> int:
    receive_plan(worker.component, plan, group_name, version)
    return version
