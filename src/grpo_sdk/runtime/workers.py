"""The worker side of the Ray runtime: one actor process holding one component.

A ``ComponentWorker`` is a plain class; the runtime turns it into a Ray actor class with
``ray.remote``. ``setup`` builds the component exactly as the local runtime would,
``Impl(config, context)``, after

* pinning torch's threads (``cluster.num_threads``),
* joining the worker group's torch.distributed group when it has more than one rank (gloo on
  CPU, NCCL on GPU; ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
  ``MASTER_PORT`` are set too, for backends that read them),
* discovering its own component registry from the installed entry points (a registry is not
  picklable; the driver sends names, and the hook modules loaded with ``grpoctl run -p``).

Then the driver calls ``call(method, *args)`` (a protocol method) or ``run(fn, *args)``: a
generic operation, ``fn(worker, *args)``, which weight-sync transports use to run their own
code next to the component (``worker.component``, ``worker.rank``, ``worker.world_size``,
``worker.device``, and ``worker.state``, a dict a transport may keep things in between calls).
"""

from __future__ import annotations

import datetime
import os
import socket
import types
from pathlib import Path
from collections.abc import Iterator
from typing import Any, Callable

import attrs

from grpo_sdk.core.machine import LISTENING, free_port, node_ip, tcp_store
from grpo_sdk.core.protocols import (
    OPTIONAL_PROTOCOLS,
    SupportsShutdown,
    WeightFileLoader,
    WeightFileWriter,
    protocol_methods,
)
from grpo_sdk.runtime.allocator import fix_mmap_threshold
from grpo_sdk.runtime.deadlines import await_with_deadline


def optional_methods(component: Any) -> list[str]:
    """The methods of the optional protocols ``component`` implements (``isinstance``), sorted: what a
    worker reports, and so what the driver's proxy exposes (``grpo_sdk.runtime.groups``)."""
    return sorted({m for p in OPTIONAL_PROTOCOLS if isinstance(component, p) for m in protocol_methods(p)})


@attrs.frozen(kw_only=True)
class WorkerSpec:
    """What a worker needs to build its component (everything picklable)."""

    kind: str
    name: str
    config: Any  # the component's structured config block
    context: Any  # the RunContext, with registry=None (the worker discovers its own)
    rank: int = 0
    world_size: int = 1
    master_addr: str | None = None  # torch.distributed rendezvous, world_size > 1
    master_port: int | None = None
    hook_modules: tuple[str, ...] = ()  # hook plugins the driver loaded by module name (grpoctl run -p)
    sys_path: tuple[str, ...] = ()  # directories the driver prepended to sys.path for them


def worker_registry(hook_modules: tuple[str, ...] = (), sys_path: tuple[str, ...] = ()) -> Any:
    """The registry a worker builds: installed entry points plus the driver's ``-p`` hook modules."""
    import sys

    from grpo_sdk.plugins.host import PluginHost
    from grpo_sdk.plugins.registry import Registry

    for path in reversed(sys_path):
        if path not in sys.path:
            sys.path.insert(0, path)
    host = PluginHost()
    host.load_entry_points()
    for module in hook_modules:
        host.load_module(module)
    return Registry.discover(host=host)


def worker_device(requested: str) -> str:
    import torch

    if requested == "cpu":
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    if requested == "cuda":
        raise RuntimeError("cluster.device=cuda but this Ray worker sees no CUDA device "
                           f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
    return "cpu"


def _gpus_assigned() -> bool:
    """Whether Ray gave this actor a GPU (or a share of one)."""
    try:
        import ray

        return bool(ray.get_gpu_ids())
    except Exception:  # noqa: BLE001 - not in a Ray worker: whatever torch sees is ours
        return True


class ComponentWorker:
    """One component in its own process. Every method is called by the driver with a deadline."""

    def __init__(self) -> None:
        self.component: Any = None
        self.spec: WorkerSpec | None = None
        self.rank = 0
        self.world_size = 1
        self.device = "cpu"
        self.state: dict[str, Any] = {}  # scratch space for weight-sync transports

    # --- startup --------------------------------------------------------------------------------

    def ping(self) -> dict[str, Any]:
        import ray

        return {"pid": os.getpid(), "node": node_ip(), "node_id": ray.get_runtime_context().get_node_id()}

    def free_address(self) -> tuple[str, int]:
        """An address on this worker's node where a rendezvous can listen (rank 0 of a group)."""
        return node_ip(), free_port()

    def store_address(self) -> tuple[str, int]:
        """The address of a TCPStore this worker will serve (``tcp_store(..., is_master=True)``): a
        socket listening on the node's address only, kept until then (so no other process takes the port)."""
        host = node_ip()
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.bind((host, 0))
        sock.listen(1024)
        port = int(sock.getsockname()[1])
        self.state.setdefault(LISTENING, {})[port] = sock
        return host, port

    def setup(self, spec: WorkerSpec) -> dict[str, Any]:
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # as the CLI does in the driver
        import random

        import torch

        self.spec = spec
        self.rank, self.world_size = spec.rank, spec.world_size
        cluster = spec.context.config.cluster
        if cluster.num_threads:
            torch.set_num_threads(cluster.num_threads)
        if spec.kind == "policy":  # it only trains; a sampler pays for mapping every block (allocator.py)
            fix_mmap_threshold(cluster.malloc_mmap_threshold)
        # As the loop seeds the driver before it builds anything: a component that draws from the
        # global RNGs while it is built draws the same numbers in a worker.
        random.seed(spec.context.config.grpo.seed)
        torch.manual_seed(spec.context.config.grpo.seed)
        self.device = worker_device(cluster.device)
        if spec.kind == "environment" and self.device == "cuda" and not _gpus_assigned():
            # Ray leaves every GPU visible to an actor that reserved none: an environment given no
            # GPU (cluster.env_gpus_per_worker=0) must not take one from the policy.
            self.device = "cpu"
        if self.world_size > 1:
            self._join_process_group(spec, cluster)
        registry = worker_registry(spec.hook_modules, spec.sys_path)
        from grpo_sdk.core.errors import PluginError

        if registry.info(spec.kind, spec.name) is None:
            raise PluginError(
                f"{spec.kind} {spec.name!r} is not installed where the Ray worker runs (pid {os.getpid()} on "
                f"{node_ip()}): workers discover components through installed entry points. A component registered "
                "in-process (PluginHost.register) exists only in the driver; install its package on every node")
        impl = registry.load_impl(spec.kind, spec.name)
        context = attrs.evolve(spec.context, registry=registry, rank=spec.rank, world_size=spec.world_size,
                               device=self.device)
        self.component = impl(spec.config, context)
        return {"pid": os.getpid(), "node": node_ip(), "device": self.device,
                "methods": optional_methods(self.component)}

    def _join_process_group(self, spec: WorkerSpec, cluster: Any) -> None:
        import torch
        import torch.distributed as dist

        os.environ.update({"RANK": str(spec.rank), "WORLD_SIZE": str(spec.world_size), "LOCAL_RANK": "0",
                           "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": str(spec.master_addr),
                           "MASTER_PORT": str(spec.master_port)})
        backend = "nccl" if self.device == "cuda" else "gloo"
        if self.device == "cuda":
            torch.cuda.set_device(0)  # Ray hands each rank its own GPU as device 0
        # Longer than the driver's deadline, which fires first and names the stuck rank.
        timeout = datetime.timedelta(seconds=cluster.call_timeout_s + 60)
        store = tcp_store(self, str(spec.master_addr), int(spec.master_port), is_master=spec.rank == 0,
                          world_size=spec.world_size, timeout=timeout)
        dist.init_process_group(backend, store=store, rank=spec.rank, world_size=spec.world_size, timeout=timeout)

    # --- calls ----------------------------------------------------------------------------------

    def call(self, method: str, *args: Any, _want_result: bool = True, **kwargs: Any) -> Any:
        """``component.method(*args, **kwargs)``; an iterator result is drained here (every rank of a
        group must drain a collective iterator such as an FSDP2 ``named_weights``)."""
        self._pin_threads()
        result = getattr(self.component, method)(*args, **kwargs)
        # An async def method (an environment's step): awaited here, as a coroutine cannot be returned;
        # the driver's deadline bounds it (it kills an actor that does not answer).
        result = await_with_deadline(result, timeout=None, what=f"{method}()")
        if isinstance(result, (types.GeneratorType, Iterator)):
            result = list(result)
        return result if _want_result else None

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """A generic operation: ``fn(self, *args, **kwargs)`` in this worker (weight-sync transports)."""
        self._pin_threads()
        return fn(self, *args, **kwargs)

    def _pin_threads(self) -> None:
        """cluster.num_threads in the thread this call runs in: an actor with max_concurrency > 1
        runs calls on a thread pool, and OpenMP's thread count is per thread (a new one starts at
        the default, which collapses on a busy machine)."""
        threads = self.spec.context.config.cluster.num_threads if self.spec is not None else None
        if threads:
            import torch

            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)

    def teardown(self) -> None:
        try:
            if isinstance(self.component, SupportsShutdown):
                self.component.shutdown()
        finally:
            self.component = None
            try:
                import torch.distributed as dist

                if dist.is_available() and dist.is_initialized():
                    dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - the worker is about to be killed anyway
                pass


# --- generic operations the groups run in workers (module functions: picklable by reference) -------


def save_weights_op(worker: ComponentWorker, path: str) -> tuple[int, int] | None:
    """Every rank drains ``named_weights`` (a collective under FSDP2); rank 0 writes the file.

    A policy backend that is a ``WeightFileWriter`` writes it itself (every rank calls it)."""
    component = worker.component
    if isinstance(component, WeightFileWriter):
        return component.save_weights(path)
    from grpo_sdk.core.weights import write_weights

    if worker.rank == 0:
        return write_weights(component.named_weights(), Path(path))
    for _ in component.named_weights():
        pass
    return None


def named_weights_op(worker: ComponentWorker) -> list[tuple[str, Any]] | None:
    """Rank 0's ``named_weights`` as CPU tensors (a driver without a GPU can hold them); the other
    ranks drain theirs (a collective) and return nothing."""
    pairs = ((name, tensor.detach().cpu()) for name, tensor in worker.component.named_weights())
    if worker.rank == 0:
        return list(pairs)
    for _ in pairs:
        pass
    return None


def load_weights_op(worker: ComponentWorker, path: str, version: int) -> None:
    """Load a weights file into the generation backend (itself, when it is a ``WeightFileLoader``)."""
    component = worker.component
    if isinstance(component, WeightFileLoader):
        component.load_weights(path, version=version)
        return
    from grpo_sdk.core.weights import read_weights

    component.update_weights(read_weights(Path(path)), version=version)


def address_op(worker: ComponentWorker) -> tuple[str, int]:
    """An ``(ip, free port)`` on this worker's node, for a rendezvous (e.g. a weight-broadcast group)."""
    return worker.free_address()


def store_address_op(worker: ComponentWorker) -> tuple[str, int]:
    """The address of a TCPStore this worker will serve on its node's address only (``tcp_store``)."""
    return worker.store_address()


def attribute_op(worker: ComponentWorker, name: str) -> Any:
    return getattr(worker.component, name)
