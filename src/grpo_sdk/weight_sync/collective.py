"""Collective weight sync (Ray runtime): policy rank 0 broadcasts the weights to the generation replicas.

The transport has its own torch.distributed group, separate from the policy's FSDP group: policy
rank 0 is its rank 0, generation replica i its rank i + 1. Each participant builds it directly
(a ``TCPStore`` that policy rank 0 hosts, then ``ProcessGroupGloo`` or ``ProcessGroupNCCL`` on it),
so neither the policy's default group nor the generation replicas' lack of one is touched. The
group is built at the first sync and kept in ``worker.state``.

The first sync also fixes the plan (``weight_sync.buckets``): the names, shapes and dtypes
``named_weights`` yields, packed in that order into flat byte buckets of at most ``bucket_mb`` MiB
(every tensor at a 64-byte aligned offset, so a byte slice views as any dtype). Every participant
holds the plan, so a sync sends nothing but the buckets. Each sync, all together and under one deadline:

* every policy rank iterates ``named_weights()`` (a collective under FSDP2: all ranks drain it);
  rank 0 copies the tensors into the current bucket and broadcasts it as soon as it is full,
  filling the next one while the broadcast is in flight (at most two buckets in memory);
* each generation replica receives the buckets into fresh buffers, the next one while the backend
  copies the current one out, and hands ``update_weights`` an iterator of views into them (names,
  shapes and dtypes from the plan), with the new version.

Failures: a participant's own error is raised after it has finished its part of the broadcast
(so the others end normally); a participant that dies is reported as the WorkerError naming it;
one that stalls misses the sync's deadline (``timeout_s``, default ``cluster.call_timeout_s``)
and is stopped. The group's own timeout is 60 s longer, so the driver's deadline fires first.

Example::

    sync = CollectiveWeightSync(CollectiveWeightSyncConfig(bucket_mb=16), context)
    stats = sync.sync_weights(policy_group, generation_group, version=3)
"""

from __future__ import annotations

import datetime
import os
import time
import uuid
from typing import Any, Iterator

from grpo_sdk.plugins import SyncStats, WorkerGroup
from grpo_sdk.plugins.toolkit import node_ip, store_address_op, tcp_store
from grpo_sdk.weight_sync import engine_broadcast
from grpo_sdk.weight_sync.buckets import Bucket, check_entry, describe, pack_into, plan_buckets, unpack
from grpo_sdk.weight_sync.driver import SyncDeadline, require_worker_groups, send_and_receive
from grpo_sdk.weight_sync.specs import CollectiveWeightSyncConfig

STATE_KEY = "grpo_sdk.weight_sync.collective"


def choose_backend(requested: str, *, gpus: bool, colocated: bool) -> str:
    """``gloo`` or ``nccl`` for ``weight_sync.collective.backend`` (see its help)."""
    if requested != "auto":
        return requested
    return "nccl" if gpus and not colocated else "gloo"


# --- the worker side (module functions: Ray pickles them by reference) -------------------------------


def _broadcast_options() -> Any:
    import torch.distributed as dist

    options = dist.BroadcastOptions()
    options.rootRank, options.rootTensor = 0, 0
    return options


def _state(worker: Any, group_id: str) -> dict[str, Any]:
    state = worker.state.get(STATE_KEY)
    if state is None or state["id"] != group_id:
        raise RuntimeError(f"collective weight sync: this worker (pid {os.getpid()}) is not in "
                           f"broadcast group {group_id}; it was never joined or was replaced")
    return state


def describe_op(worker: Any) -> list[tuple[str, tuple[int, ...], Any]] | None:
    """Policy ranks: rank 0's ``(name, shape, dtype)`` list; every rank drains ``named_weights`` (a collective)."""
    specs = describe(worker.component.named_weights())
    return specs if worker.rank == 0 else None


def join_op(worker: Any, group_id: str, host: str, port: int, rank: int, size: int, backend: str,
            timeout_s: float, plan: list[Bucket]) -> str:
    """Join the transport's broadcast group as ``rank`` of ``size`` (rank 0 hosts the store)."""
    import torch
    import torch.distributed as dist

    worker.state.pop(STATE_KEY, None)  # another transport instance's group: dropped
    timeout = datetime.timedelta(seconds=timeout_s)
    store = tcp_store(worker, host, port, is_master=rank == 0, world_size=size, timeout=timeout)  # node address only
    prefixed = dist.PrefixStore(f"grpo_sdk/weight_sync/{group_id}", store)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        group = dist.ProcessGroupNCCL(prefixed, rank, size, options)
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=node_ip())]
        group = dist.ProcessGroupGloo(prefixed, rank, size, options)
        device = torch.device("cpu")
    probe = torch.zeros(1, dtype=torch.uint8, device=device)  # NCCL builds its communicator on the first call
    group.broadcast([probe], _broadcast_options()).wait()
    worker.state[STATE_KEY] = {"id": group_id, "group": group, "store": store, "device": device, "plan": plan,
                               "rank": rank}
    return str(device)


def _finish_work(work: Any, device: Any) -> None:
    """Wait for a broadcast on the host. NCCL's ``wait`` only orders the current CUDA stream after it;
    the host must wait too, or it would run ahead and allocate a buffer for every bucket at once."""
    work.wait()
    if device.type == "cuda":
        import torch

        torch.cuda.current_stream(device).synchronize()


def send_op(worker: Any, group_id: str) -> tuple[int, int] | None:
    """Policy ranks: all drain ``named_weights``; rank 0 broadcasts it bucket by bucket. (tensors, bytes)."""
    weights = iter(worker.component.named_weights())
    try:
        if worker.rank == 0:
            return _send(_state(worker, group_id), weights)
        return None
    finally:
        for _ in weights:  # every rank drains the collective iterator, after an error too
            pass


def _send(state: dict[str, Any], weights: Iterator[tuple[str, Any]]) -> tuple[int, int]:
    import torch

    group, device, plan = state["group"], state["device"], state["plan"]
    options = _broadcast_options()
    problem: str | None = None
    in_flight: tuple[Any, Any] | None = None  # (work, buffer): the buffer lives until its broadcast ends
    tensors = num_bytes = 0
    for bucket in plan:
        buffer = torch.empty(bucket.nbytes, dtype=torch.uint8, device=device)
        for entry in bucket.entries:
            if problem is None:
                item = next(weights, None)
                problem = (f"it ended before {entry.name!r}" if item is None else check_entry(entry, *item))
                if problem is None:
                    pack_into(buffer, entry, item[1])
                    tensors += 1
                    num_bytes += entry.nbytes
                    continue
            buffer[entry.offset:entry.offset + entry.nbytes].zero_()  # the protocol completes regardless
        if in_flight is not None:
            _finish_work(in_flight[0], device)
        in_flight = (group.broadcast([buffer], options), buffer)
    if in_flight is not None:
        _finish_work(in_flight[0], device)
    if problem is None:
        extra = next(weights, None)
        if extra is not None:
            problem = f"it yields {extra[0]!r} beyond the {tensors} tensors of the plan"
    if problem is not None:
        raise ValueError(f"collective weight sync: policy rank 0's named_weights() no longer matches the plan made "
                         f"at the first sync ({problem}); the generation replicas received zeros from there on. A "
                         "policy backend must yield the same names, shapes and dtypes at every sync")
    return tensors, num_bytes


def receive_op(worker: Any, group_id: str, version: int) -> int:
    """Generation replicas: receive the buckets and stream views of them into ``update_weights``."""
    import torch

    state = _state(worker, group_id)
    group, device, plan = state["group"], state["device"], state["plan"]
    options = _broadcast_options()

    def start(bucket: Bucket) -> tuple[Any, Any]:
        # A fresh buffer per bucket: a backend may keep what it was given until update_weights returns.
        buffer = torch.empty(bucket.nbytes, dtype=torch.uint8, device=device)
        return buffer, group.broadcast([buffer], options)

    def stream() -> Iterator[tuple[str, Any]]:
        incoming = start(plan[0]) if plan else None
        for i, bucket in enumerate(plan):
            buffer, work = incoming
            _finish_work(work, device)
            # The next bucket arrives while the backend copies this one (at most two buffers).
            incoming = start(plan[i + 1]) if i + 1 < len(plan) else None
            yield from unpack(bucket, buffer)

    received = stream()
    try:
        worker.component.update_weights(received, version=version)
    except BaseException:
        _finish(received)  # rank 0 and the other replicas are in the broadcast: take part to the end
        raise
    if _finish(received):
        raise RuntimeError("collective weight sync: the generation backend's update_weights returned without "
                           "reading every weight it was given")
    if device.type == "cuda":
        torch.cuda.synchronize()
    return version


def _finish(received: Iterator[Any]) -> int:
    """Receive what is left of a broadcast (discarding it); how many tensors that was."""
    left = 0
    try:
        for _ in received:
            left += 1
    except Exception:  # noqa: BLE001 - the group is broken: the error that got us here is the one to report
        pass
    return left


# --- the driver side ------------------------------------------------------------------------------------


class CollectiveWeightSync:
    """Broadcasts policy rank 0's weights to the generation replicas (Ray runtime), or to engines that
    receive it themselves (``ReceivesBroadcast``, also in the local runtime: engine_broadcast.py)."""

    def __init__(self, config: CollectiveWeightSyncConfig | None, context: Any):
        self.config = config = config or CollectiveWeightSyncConfig()
        cluster = context.config.cluster
        gpus = cluster.gpus_per_node > 0 and cluster.device != "cpu"
        self.backend = choose_backend(config.backend, gpus=gpus,
                                      colocated=context.config.policy.generation.colocated.enabled)
        self.deadline = SyncDeadline.of("collective", config.timeout_s, cluster.call_timeout_s)
        self.group_id: str | None = None
        self.plan: list[Bucket] = []
        self.bucket_bytes = int(config.bucket_mb * (1 << 20))
        self.local: engine_broadcast.LocalEngineBroadcast | None = None  # an engine's group, this process rank 0

    def sync_weights(self, policy: Any, generation: Any, *, version: int) -> SyncStats:
        start = time.perf_counter()
        if engine_broadcast.engine_receivers(generation):  # an inference server's own weight-update group
            return self._sync_engines(policy, generation, version, start)
        require_worker_groups("weight_sync.backend=collective broadcasts between Ray workers", policy, generation,
                              ". In one process use weight_sync.backend=inprocess")
        if self.group_id is None:
            self._form_group(policy, generation)
        return send_and_receive(policy, generation, self.deadline, name="collective", version=version, start=start,
                                send=(send_op, self.group_id), receive=(receive_op, self.group_id, version))

    def _sync_engines(self, policy: Any, generation: Any, version: int, start: float) -> SyncStats:
        if not isinstance(policy, WorkerGroup):  # the local runtime: the driver is rank 0
            if self.local is None:
                self.local = engine_broadcast.LocalEngineBroadcast(
                    backend=self.backend, bucket_bytes=self.bucket_bytes, timeout_s=self.deadline.timeout,
                    master_address=self.config.master_address)
            return self.local.sync_weights(policy, generation, version=version)
        if self.group_id is None:
            self._form_engine_group(policy, generation)
        calls = (policy.submit(engine_broadcast.send_op, self.group_id, name="collective_send")
                 + [call for i in range(len(generation.workers))
                    for call in generation.submit(engine_broadcast.receive_op, self.group_id, self.plan, version,
                                                  ranks=[i], name="collective_receive")])
        num_tensors, num_bytes = self.deadline.wait(policy, calls)[0]
        return SyncStats(version=version, num_tensors=num_tensors, num_bytes=num_bytes,
                         seconds=time.perf_counter() - start)

    def _form_engine_group(self, policy: Any, generation: Any) -> None:
        """Policy rank 0 hosts the engines' kind of group; replica i's engine joins after replica i-1's ranks."""
        wait = self.deadline.wait
        specs = wait(policy, policy.submit(describe_op, name="collective_describe"))[0]
        plan = plan_buckets(specs, self.bucket_bytes)
        peers = set(wait(generation, generation.submit(engine_broadcast.peer_op, name="collective_peer")))
        if len(peers) != 1:
            raise ValueError(f"collective weight sync: the generation replicas' engines build different kinds of "
                             f"weight-update group ({', '.join(sorted(peers))}); one group needs one kind")
        peer = peers.pop()
        address, port = wait(policy, policy.submit(engine_broadcast.address_op, peer, ranks=[0],
                                                   name="collective_address"))[0]
        ranks = wait(generation, generation.submit(engine_broadcast.ranks_op, name="collective_ranks"))
        offsets = [1 + sum(ranks[:i]) for i in range(len(ranks))]
        name, world_size = f"grpo_sdk_weights_{uuid.uuid4().hex[:12]}", 1 + sum(ranks)
        calls = (policy.submit(engine_broadcast.join_sender_op, peer, name, address, port, world_size, self.backend,
                               self.deadline.group_timeout, plan, ranks=[0], name="collective_join")
                 + [call for i, offset in enumerate(offsets)
                    for call in generation.submit(engine_broadcast.join_receiver_op, name, address, port, offset,
                                                  world_size, self.backend, ranks=[i], name="collective_join")])
        wait(policy, calls)
        self.plan, self.group_id = plan, name

    def shutdown(self) -> None:
        if self.local is not None:
            self.local.shutdown()

    def _form_group(self, policy: Any, generation: Any) -> None:
        """The plan from rank 0's ``named_weights``, then every participant joins the broadcast group."""
        wait, timeout = self.deadline.wait, self.deadline.group_timeout
        specs = wait(policy, policy.submit(describe_op, name="collective_describe"))[0]
        plan = plan_buckets(specs, self.bucket_bytes)
        host, port = wait(policy, policy.submit(store_address_op, ranks=[0], name="collective_address"))[0]
        group_id = uuid.uuid4().hex[:12]
        size = 1 + len(generation.workers)
        args = (group_id, host, port)
        calls = (policy.submit(join_op, *args, 0, size, self.backend, timeout, plan, ranks=[0],
                               name="collective_join")
                 + [call for i in range(len(generation.workers))
                    for call in generation.submit(join_op, *args, i + 1, size, self.backend, timeout,
                                                  plan, ranks=[i], name="collective_join")])
        wait(policy, calls)
        self.plan, self.group_id = plan, group_id
