"""CUDA IPC weight sync (Ray runtime, GPUs, colocated generation): no copy through host memory.

NOT RUN YET: this module has never been run on a GPU. Its config checks and its protocol (with a
stand-in for the CUDA IPC handles, on the CPU) are tested; the GPU test
(``tests/backends/test_weight_sync_transports.py``, marked ``gpu``) is skipped where there is no CUDA device.

With colocated generation, policy rank i and generation replica i share bundle i, and so one GPU.
Each sync, every policy rank drains ``named_weights()`` (a collective under FSDP2: every rank gets
the full tensors), and each rank i that has a replica on its GPU packs the tensors, in order, into
flat uint8 GPU buffers of ``bucket_mb`` MiB (a larger tensor gets a buffer of its own; the same
bucketing rule as the collective transport), and publishes each buffer as a CUDA IPC handle
with the names, shapes, dtypes and offsets of its tensors. Replica i opens the handle (a tensor on
the sender's memory, no copy), hands views of it to its backend's ``update_weights``
(which copies them into its parameters), waits for those copies, drops the views and
acknowledges. The sender keeps a buffer alive until its acknowledgement, and holds at most two.

The handles and acknowledgements travel through a ``TCPStore`` that policy rank 0 hosts on its
node's address only (``grpo_sdk.plugins.toolkit.tcp_store``; keys ``<group>/<sync>/<pair>/bucket/<k>`` and
``.../done/<k>``); every blocking store call has the
store's timeout, 60 s beyond the sync's deadline, so the driver's deadline, which names the stuck
worker, fires first. At the first sync every participant reports its node and GPU UUID, and the
transport refuses to run unless replica i and policy rank i are on the same GPU.

Wire format: nothing read from the store is unpickled (anyone who can reach its port could write to
it). A bucket is JSON: ``{"format", "handle", "entries"}``. The handle is the plain data of
``torch.multiprocessing.reductions.reduce_tensor`` (integers, booleans, and the CUDA handles as
base64 bytes); the receiver checks every field's type and range, refuses anything else with an
error naming the field, and rebuilds the tensor with ``rebuild_cuda_tensor`` and classes of its
own choosing (a plain ``torch.Tensor`` of uint8), never a function or class named by the payload.

Caveats: CUDA IPC does not work with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` on
torch versions that cannot export such segments; each GPU's memory must hold, during a sync, the
policy's gathered tensors, two buffers and the generation weights.
"""

from __future__ import annotations

import base64
import datetime
import functools
import json
import math
import os
import time
import uuid
from typing import Any, Callable, Iterable, Iterator

from grpo_sdk.plugins import GrpoSdkError, SyncStats
from grpo_sdk.plugins.toolkit import node_ip, store_address_op, tcp_store
from grpo_sdk.weight_sync.buckets import Entry, align_up, pack_into, starts_new_bucket
from grpo_sdk.weight_sync.driver import SyncDeadline, require_worker_groups, send_and_receive
from grpo_sdk.weight_sync.specs import CudaIPCWeightSyncConfig

STATE_KEY = "grpo_sdk.weight_sync.cuda_ipc"
END = b"end"
FORMAT = "grpo_sdk.cuda_ipc/1"
MAX_HANDLE_BYTES = 4096  # a CUDA IPC memory or event handle is 64 bytes, a ref-counter name far less than this


# --- CUDA IPC handles (the only GPU-specific part) ----------------------------------------------------

# ``rebuild_cuda_tensor``'s data arguments, in order, after the six the receiver fixes itself (tensor
# class, size, stride, offset, storage class, dtype: a flat uint8 buffer): (name, kind). "?" allows
# null: torch's ``_share_cuda_`` leaves the handles and the event flag None for an empty storage.
HANDLE_FIELDS = (("storage_device", "int"), ("storage_handle", "bytes?"), ("storage_size_bytes", "int"),
                 ("storage_offset_bytes", "int"), ("requires_grad", "bool"), ("ref_counter_handle", "bytes?"),
                 ("ref_counter_offset", "int"), ("event_handle", "bytes?"), ("event_sync_required", "bool?"))


def share_cuda(buffer: Any) -> dict[str, Any]:
    """The CUDA IPC handle of a flat uint8 CUDA buffer, as JSON data; the sender keeps ``buffer`` alive."""
    import torch
    from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

    rebuild, args = reduce_tensor(buffer)
    if (rebuild is not rebuild_cuda_tensor or len(args) != 6 + len(HANDLE_FIELDS) or args[0] is not torch.Tensor
            or args[4] is not torch.storage.TypedStorage or args[5] != torch.uint8 or list(args[2]) != [1]):
        raise RuntimeError(f"cuda_ipc: torch {torch.__version__} shares this buffer as {rebuild.__name__} with "
                           f"{len(args)} arguments; this transport knows rebuild_cuda_tensor with "
                           f"{6 + len(HANDLE_FIELDS)} (a flat torch.Tensor of uint8 on a TypedStorage)")
    return encode_handle(int(args[1][0]), args[3], args[6:])


def encode_handle(length: int, offset: int, fields: tuple[Any, ...]) -> dict[str, Any]:
    """JSON data for a flat buffer of ``length`` bytes at ``offset`` of its storage, and the
    ``HANDLE_FIELDS`` values (bytes as base64)."""
    handle: dict[str, Any] = {"length": length, "offset": offset}
    for (name, _), value in zip(HANDLE_FIELDS, fields, strict=True):
        handle[name] = base64.b64encode(value).decode("ascii") if isinstance(value, bytes) else value
    return handle


def decode_handle(handle: Any) -> tuple[Any, ...]:
    """``rebuild_cuda_tensor``'s arguments from a received handle, every field checked; ValueError if not."""
    import torch

    where = "cuda_ipc weight sync: a received CUDA IPC handle"
    expected = {"length", "offset", *(name for name, _ in HANDLE_FIELDS)}
    if not isinstance(handle, dict) or set(handle) != expected:
        found = sorted(handle) if isinstance(handle, dict) else type(handle).__name__
        raise ValueError(f"{where} has fields {found}; expected exactly {sorted(expected)}; refusing it")
    fields = {name: _field(kind, handle[name], f"{where}: {name!r}") for name, kind in HANDLE_FIELDS}
    length, offset = (_field("int", handle[name], f"{where}: {name!r}") for name in ("length", "offset"))
    if fields["requires_grad"]:
        raise ValueError(f"{where}: requires_grad is true; the sender shares plain buffers")
    if offset + length > fields["storage_size_bytes"]:
        raise ValueError(f"{where}: bytes {offset}..{offset + length} lie outside its storage of "
                         f"{fields['storage_size_bytes']} bytes")
    return (torch.Tensor, torch.Size([length]), (1,), offset, torch.storage.TypedStorage, torch.uint8,
            *fields.values())


def _field(kind: str, value: Any, where: str) -> Any:
    """``value`` if it is of ``kind`` (``HANDLE_FIELDS``; base64 text decoded to bytes), else ValueError."""
    if value is None and kind.endswith("?"):
        return None
    if kind == "int" and isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value  # (a JSON true would pass isinstance(int): Python's bool is an int)
    if kind.startswith("bool") and isinstance(value, bool):
        return value
    if kind.startswith("bytes") and isinstance(value, str):
        try:
            raw = base64.b64decode(value, validate=True)
        except ValueError as exc:
            raise ValueError(f"{where} is not base64 ({exc}); refusing it") from None
        if len(raw) <= MAX_HANDLE_BYTES:
            return raw
    wanted = {"int": "a non-negative integer", "bool": "true or false", "bytes": f"base64 of at most "
              f"{MAX_HANDLE_BYTES} bytes"}[kind.rstrip("?")] + (" or null" if kind.endswith("?") else "")
    raise ValueError(f"{where} is {_short(value)}; expected {wanted}; refusing it")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def open_cuda(handle: Any) -> Any:
    """The sender's buffer, mapped into this process (no copy), on this process's current CUDA device.

    The storage's device index is the sender's; under Ray both processes see their shared GPU as
    device 0, and the first sync checked that it is the same GPU (by UUID)."""
    import torch
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    args = list(decode_handle(handle))
    args[6] = torch.cuda.current_device()
    return rebuild_cuda_tensor(*args)


# --- the bucket payload: JSON, checked field by field --------------------------------------------------


def encode_bucket(handle: Any, entries: list[Entry]) -> bytes:
    """A bucket's payload: the handle (JSON data from ``share``) and where each tensor lies in it."""
    return json.dumps({"format": FORMAT, "handle": handle, "entries": [
        {"name": e.name, "shape": list(e.shape), "dtype": str(e.dtype).removeprefix("torch."), "offset": e.offset,
         "nbytes": e.nbytes} for e in entries]}).encode()


def decode_bucket(payload: bytes) -> tuple[Any, list[Entry]]:
    """``(handle, entries)`` of a payload, every entry checked; ValueError naming what is wrong."""
    where = "cuda_ipc weight sync: a received bucket"
    try:
        data = json.loads(payload)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{where} is not JSON ({exc}); refusing it") from None
    if not isinstance(data, dict) or set(data) != {"format", "handle", "entries"} or data["format"] != FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"{where} is not a {FORMAT} payload (format {found!r}); refusing it")
    if not isinstance(data["entries"], list):
        raise ValueError(f"{where}: 'entries' is not a list")
    return data["handle"], [_entry(item, f"{where}, entry {i}") for i, item in enumerate(data["entries"])]


def _entry(item: Any, where: str) -> Entry:
    keys = {"name", "shape", "dtype", "offset", "nbytes"}
    if not isinstance(item, dict) or set(item) != keys:
        raise ValueError(f"{where} is not an object with exactly the fields {sorted(keys)}; refusing it")
    name, shape = item["name"], item["shape"]
    if not isinstance(name, str):
        raise ValueError(f"{where}: 'name' is {_short(name)}; expected text; refusing it")
    where = f"{where} ({_short(name)})"
    dtype = _dtypes().get(item["dtype"]) if isinstance(item["dtype"], str) else None
    if dtype is None:
        raise ValueError(f"{where}: dtype {_short(item['dtype'])} is not a torch dtype; refusing it")
    if not isinstance(shape, list):
        raise ValueError(f"{where}: shape {_short(shape)} is not a list; refusing it")
    dims = tuple(_field("int", d, f"{where}: a dimension") for d in shape)
    offset, nbytes = (_field("int", item[key], f"{where}: {key!r}") for key in ("offset", "nbytes"))
    if nbytes != math.prod(dims) * dtype.itemsize:
        raise ValueError(f"{where}: {nbytes} bytes do not hold a {list(dims)} {dtype} tensor; refusing it")
    return Entry(name=name, shape=dims, dtype=dtype, offset=offset, nbytes=nbytes)


@functools.cache
def _dtypes() -> dict[str, Any]:
    """torch's dtypes by name ("float32", "bfloat16", ...): a payload names one, never any other object."""
    import torch

    return {str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)}


# --- the protocol (pure apart from the share/open functions; tested on the CPU) -----------------------


class Channel:
    """Handles and acknowledgements of one sender-receiver pair in one sync, through a store."""

    def __init__(self, store: Any, prefix: str):
        self.store, self.prefix = store, prefix

    def _key(self, kind: str, k: int) -> str:
        return f"{self.prefix}/{kind}/{k}"

    def publish(self, k: int, payload: bytes) -> None:
        self.store.set(self._key("bucket", k), payload)

    def receive(self, k: int) -> bytes:
        key = self._key("bucket", k)
        payload = self.store.get(key)  # blocks until the sender publishes (or the store's timeout)
        self.store.delete_key(key)
        return payload

    def acknowledge(self, k: int, *, failure: str | None = None) -> None:
        """Buffer ``k`` has been read; or, with ``failure``, could not be (the sender then stops)."""
        self.store.set(self._key("done", k), b"1" if failure is None else b"failed: " + failure.encode())

    def wait_acknowledged(self, k: int) -> None:
        key = self._key("done", k)
        value = self.store.get(key)  # blocks until the receiver answers (or the store's timeout)
        self.store.delete_key(key)
        if value != b"1":
            raise RuntimeError(f"cuda_ipc weight sync: the generation replica could not read buffer {k}: "
                               f"{value.decode(errors='replace').removeprefix('failed: ')}")


def _synchronize(device: Any) -> None:
    if getattr(device, "type", str(device)) == "cuda":
        import torch

        torch.cuda.current_stream(device).synchronize()


def send_buckets(weights: Iterable[tuple[str, Any]], channel: Channel, *, bucket_bytes: int, device: Any,
                 share: Callable[[Any], Any] = share_cuda) -> tuple[int, int]:
    """Pack ``weights`` into buffers on ``device`` and publish each (at most two alive); (tensors, bytes).

    Each tensor is copied into the current buffer as it arrives, so a gathered tensor can be freed
    at once. Returns after the receiver has acknowledged every buffer.
    """
    import torch

    held: dict[int, Any] = {}  # bucket index -> buffer, until acknowledged
    index = -1
    buffer: Any = None
    entries: list[Entry] = []
    end = tensors = num_bytes = 0

    def publish() -> None:
        _synchronize(device)  # the packing copies are done before the receiver reads (also for a reused block)
        channel.publish(index, encode_bucket(share(buffer), entries))
        held[index] = buffer

    for name, tensor in weights:
        nbytes = tensor.numel() * tensor.element_size()
        if buffer is None or starts_new_bucket(len(entries), end, nbytes, bucket_bytes):
            if buffer is not None:
                publish()
            index += 1
            if index >= 2:  # at most two buffers alive: the one two back must have been read
                channel.wait_acknowledged(index - 2)
                held.pop(index - 2)
            buffer = torch.empty(max(bucket_bytes, nbytes), dtype=torch.uint8, device=device)
            entries, end = [], 0
        entry = Entry(name=name, shape=tuple(tensor.shape), dtype=tensor.dtype, offset=align_up(end), nbytes=nbytes)
        pack_into(buffer, entry, tensor)
        entries.append(entry)
        end = entry.offset + nbytes
        tensors += 1
        num_bytes += nbytes
    if buffer is not None:
        publish()
    channel.publish(index + 1, END)
    for k in sorted(held):
        channel.wait_acknowledged(k)
    held.clear()
    return tensors, num_bytes


def receive_buckets(channel: Channel, *, open_: Callable[[Any], Any] = open_cuda, device: Any = None
                    ) -> Iterator[tuple[str, Any]]:
    """Views of each published buffer, in order; a buffer is acknowledged once the consumer has asked
    for the tensor after its last one (so its copies were issued) and they have completed."""
    k = 0
    while True:
        payload = channel.receive(k)
        if payload == END:
            return
        try:
            handle, entries = decode_bucket(payload)
            buffer = open_(handle)
            outside = next((e for e in entries if e.offset + e.nbytes > buffer.numel()), None)
            if outside is not None:
                raise ValueError(f"cuda_ipc weight sync: {outside.name!r} at bytes {outside.offset}.."
                                 f"{outside.offset + outside.nbytes} lies outside buffer {k} ({buffer.numel()} bytes)")
            views = [(entry.name, buffer[entry.offset:entry.offset + entry.nbytes].view(entry.dtype).view(entry.shape))
                     for entry in entries]
        except Exception as exc:
            channel.acknowledge(k, failure=f"{type(exc).__name__}: {exc}")  # the sender stops instead of waiting
            raise
        del buffer
        yield from views
        del views
        _synchronize(device)  # the consumer's copies out of the sender's memory have finished
        channel.acknowledge(k)
        k += 1


def finish(received: Iterator[Any]) -> int:
    """Read and acknowledge what is left (the sender waits for every acknowledgement); how many tensors."""
    left = 0
    try:
        for _ in received:
            left += 1
    except Exception:  # noqa: BLE001 - the channel is broken: the error that got us here is the one to report
        pass
    return left


# --- the worker side ------------------------------------------------------------------------------------


def _state(worker: Any, group_id: str) -> dict[str, Any]:
    state = worker.state.get(STATE_KEY)
    if state is None or state["id"] != group_id:
        raise RuntimeError(f"cuda_ipc weight sync: this worker (pid {os.getpid()}) never joined group {group_id}")
    return state


def join_op(worker: Any, group_id: str, host: str, port: int, is_master: bool, timeout_s: float, pair: int
            ) -> tuple[str, str | None]:
    """Connect to the transport's store (policy rank 0 hosts it) as pair ``pair`` (a policy rank, or the
    replica index); (node, GPU UUID) for the placement check."""
    import torch

    if worker.device != "cuda" or not torch.cuda.is_available():
        raise RuntimeError(f"weight_sync.backend=cuda_ipc needs every worker on CUDA; this one (pid {os.getpid()}) "
                           f"runs on {worker.device}")
    worker.state.pop(STATE_KEY, None)
    store = tcp_store(worker, host, port, is_master=is_master, timeout=datetime.timedelta(seconds=timeout_s))
    worker.state[STATE_KEY] = {"id": group_id, "store": store, "pair": pair}
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    gpu = str(props.uuid) if getattr(props, "uuid", None) is not None else None
    return node_ip(), gpu


def send_op(worker: Any, group_id: str, sync: int, replicas: int, bucket_bytes: int) -> tuple[int, int] | None:
    """Policy ranks: all drain ``named_weights``; rank i < replicas shares it with replica i."""
    import torch

    weights = iter(worker.component.named_weights())
    try:
        if worker.rank >= replicas:
            return None
        state = _state(worker, group_id)
        channel = Channel(state["store"], f"{group_id}/{sync}/{worker.rank}")
        device = torch.device("cuda", torch.cuda.current_device())
        result = send_buckets(weights, channel, bucket_bytes=bucket_bytes, device=device)
        torch.cuda.ipc_collect()  # free buffers the receiver has released
        return result
    finally:
        for _ in weights:  # every rank drains the collective iterator, after an error too
            pass


def receive_op(worker: Any, group_id: str, sync: int, version: int) -> int:
    """Generation replica i: copy the weights out of policy rank i's buffers with ``update_weights``."""
    import torch

    state = _state(worker, group_id)
    channel = Channel(state["store"], f"{group_id}/{sync}/{state['pair']}")
    received = receive_buckets(channel, device=torch.device("cuda", torch.cuda.current_device()))
    try:
        worker.component.update_weights(received, version=version)
    except BaseException:
        finish(received)
        raise
    if finish(received):
        raise RuntimeError("cuda_ipc weight sync: the generation backend's update_weights returned without "
                           "reading every weight it was given")
    return version


# --- the driver side ------------------------------------------------------------------------------------


class CudaIPCWeightSync:
    """Each generation replica copies the weights of the policy rank on its GPU through CUDA IPC handles."""

    def __init__(self, config: CudaIPCWeightSyncConfig | None, context: Any):
        self.config = config = config or CudaIPCWeightSyncConfig()
        self.bucket_bytes = int(config.bucket_mb * (1 << 20))
        self.deadline = SyncDeadline.of("cuda_ipc", config.timeout_s, context.config.cluster.call_timeout_s)
        self.group_id: str | None = None
        self.syncs = 0

    def sync_weights(self, policy: Any, generation: Any, *, version: int) -> SyncStats:
        start = time.perf_counter()
        require_worker_groups("weight_sync.backend=cuda_ipc shares GPU memory between Ray workers", policy, generation)
        replicas = len(generation.workers)
        if replicas > len(policy.workers):
            raise ValueError(f"cuda_ipc: {replicas} generation replicas but {len(policy.workers)} policy ranks; every "
                             "replica needs a policy rank on its GPU (cluster.generation_workers <= policy_workers)")
        if self.group_id is None:
            self._connect(policy, generation)
        self.syncs += 1
        return send_and_receive(policy, generation, self.deadline, name="cuda_ipc", version=version, start=start,
                                send=(send_op, self.group_id, self.syncs, replicas, self.bucket_bytes),
                                receive=(receive_op, self.group_id, self.syncs, version))

    def _connect(self, policy: Any, generation: Any) -> None:
        host, port = self.deadline.wait(policy, policy.submit(store_address_op, ranks=[0], name="cuda_ipc_address"))[0]
        group_id = uuid.uuid4().hex[:12]
        ranks = len(policy.workers)
        calls = [call for group, count in ((policy, ranks), (generation, len(generation.workers)))
                 for i in range(count)
                 for call in group.submit(join_op, group_id, host, port, group is policy and i == 0,
                                          self.deadline.group_timeout, i, ranks=[i], name="cuda_ipc_join")]
        places = self.deadline.wait(policy, calls)
        senders, receivers = places[:ranks], places[ranks:]
        for i, (sender, receiver) in enumerate(zip(senders, receivers)):
            if sender != receiver or sender[1] is None:
                raise GrpoSdkError(
                    f"cuda_ipc: generation replica {i} ({generation.workers[i].label}) is on GPU {receiver[1]} of "
                    f"{receiver[0]}, but policy rank {i} ({policy.workers[i].label}) is on GPU {sender[1]} of "
                    f"{sender[0]}; CUDA IPC needs them on one GPU (policy.generation.colocated.enabled=true)")
        self.group_id = group_id
