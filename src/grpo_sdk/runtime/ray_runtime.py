"""The Ray runtime (``cluster.runtime: ray``): the policy, generation and environments as Ray actors.

What the loop gets back from ``build`` implements the same protocols as the in-process
components, so the loop does not know which runtime it drives:

* ``policy`` -> ``PolicyGroup``: ``cluster.policy_workers`` ranks joined by torch.distributed
  (gloo on CPU, NCCL on GPU); the backend shards with FSDP2 when ``context.world_size > 1``.
  A second ``policy`` build (the on-policy-distillation teacher) is a group of its own.
* ``generation`` -> ``GenerationGroup``: ``cluster.generation_workers`` replicas.
* ``environment`` -> ``EnvironmentPool``: ``cluster.env_workers`` actors, each running at most
  ``cluster.env_max_concurrency`` calls at once, with ``cluster.cpus_per_worker`` CPUs and
  ``cluster.env_gpus_per_worker`` GPUs (a reward model's; outside the placement groups below).
* everything else (estimator, weight sync, loggers) is built in the driver, as in-process.

Placement (one bundle per rank or replica; ``{"CPU": cpus_per_worker}``, plus ``{"GPU": 1}``
when ``cluster.gpus_per_node > 0``):

* which node: on one node (``cluster.num_nodes`` 1) the placement groups are ``STRICT_PACK`` and Ray
  picks the node; with ``num_nodes = N > 1`` the run's bundles are cut into N contiguous blocks and
  block j is pinned to node j (``grpo_sdk.runtime.nodes``: a per-bundle node selector; fewer alive
  nodes than N is an error naming ``cluster.num_nodes``). ``<run dir>/placement.json`` records the
  node every worker reported from its own process;
* colocated (``policy.generation.colocated.enabled``, the default): one placement group of
  ``max(policy_workers, generation_workers)`` bundles that the policy ranks and the generation
  replicas share, each actor taking an equal fraction of its bundle (half; a third with a
  teacher); the policy is offloaded around every round of generation;
* non-colocated: a placement group for the policy ranks (and the teacher) and a separate one
  for the generation replicas.

Deadlines: startup (actors scheduled, processes started, models loaded) must finish within
``cluster.startup_timeout_s``; every later call within ``cluster.call_timeout_s``. A worker that
dies or misses its deadline stops the run with a ``WorkerError`` naming the worker, the call and
the elapsed time; after that the runtime makes no more remote calls (``shutdown`` only kills).

The local cluster (``cluster.address`` null; ``grpo_sdk.runtime.local_cluster``) is this process's alone:
every server of it listens on loopback, it requires a token that this run generates (Ray's token
authentication; ``RAY_AUTH_MODE=disabled`` turns it off, with a warning), and a watchdog kills
what is left of it when this process dies, even by SIGKILL. A multi-node cluster is the
operator's: see docs/distributed.md, "Security".
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import logging
import math
import os
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from grpo_sdk.core.capabilities import Capability
from grpo_sdk.core.errors import GrpoSdkError, PluginError
from grpo_sdk.core.files import write_text_atomic
from grpo_sdk.runtime import nodes
from grpo_sdk.runtime.deadlines import Call, WorkerError, WorkerHandle, gather
from grpo_sdk.runtime.groups import (EnvironmentPool, GenerationGroup, PolicyGroup, WorkerGroup, local_methods,
                                    local_sampler_factory)
from grpo_sdk.runtime.local_cluster import LocalCluster, start_local_cluster
from grpo_sdk.runtime.workers import ComponentWorker, WorkerSpec

if TYPE_CHECKING:
    from grpo_sdk.config.schema import MasterConfig

__all__ = ["RayRuntime", "WorkerError", "Placement"]

log = logging.getLogger(__name__)

REMOTE_KINDS = ("policy", "generation", "environment")
LOCAL_OBJECT_STORE_BYTES = (256 << 20, 4 << 30)  # a local cluster's object store: 30% of RAM within these
PLACEMENT_FILE = "placement.json"  # in the run directory: where every worker runs (grpo_sdk.runtime.nodes)


def _quantity(amount: float) -> float:
    """A resource amount Ray accepts: fractions below 1 (4 decimals), whole numbers above."""
    return round(amount, 4) if amount <= 1 else float(math.floor(amount))


def environment_actor_options(cluster: Any) -> dict[str, Any]:
    """What each environment actor asks Ray for: ``cluster.cpus_per_worker`` CPUs, and
    ``cluster.env_gpus_per_worker`` GPUs when set (not in a placement group: an environment is
    not colocated with the policy)."""
    options: dict[str, Any] = {"num_cpus": _quantity(cluster.cpus_per_worker),
                               "max_concurrency": cluster.env_max_concurrency}
    if cluster.env_gpus_per_worker > 0 and cluster.device != "cpu":
        options["num_gpus"] = _quantity(cluster.env_gpus_per_worker)
    return options


@attrs.define
class Placement:
    """Where each role's actors go: a placement group, and the fraction of a bundle each actor takes."""

    groups: dict[str, Any]  # role -> placement group
    shares: dict[str, float]  # role -> fraction of its bundle
    bundle: dict[str, float]  # resources of one bundle
    sizes: dict[str, int]  # role -> bundles in its placement group


class RayRuntime:
    """Builds the remote components of a run on a Ray cluster; see the module docstring."""

    def __init__(self, config: MasterConfig, registry: Any):
        self.config = config
        self.cluster = config.cluster
        self.registry = registry
        self.call_timeout = float(self.cluster.call_timeout_s)
        self.startup_timeout = float(self.cluster.startup_timeout_s)
        self.colocated = bool(config.policy.generation.colocated.enabled)
        a = config.grpo.async_grpo
        self.in_flight = bool(a.enabled and a.in_flight_weight_updates)
        self.failure: WorkerError | None = None
        self.groups: list[WorkerGroup] = []
        self.policy_group: PolicyGroup | None = None
        self.placement: Placement | None = None
        self.nodes: list[str] | None = None  # with cluster.num_nodes > 1: the node ids used, block j on node j
        self.run_dir: Path | None = None  # where placement.json goes; known from the first build
        self.owns_ray = False
        self.local: LocalCluster | None = None
        self._actor_class: Any = None
        wanted = [("policy", config.policy.backend), ("generation", config.policy.generation.backend),
                  ("environment", config.env.name)]
        if config.on_policy_distillation.teacher_model:
            wanted.append(("policy", config.on_policy_distillation.teacher_backend))
        for kind, name in wanted:  # before any actor starts
            self._check_remote_component(kind, name)
        self._connect()

    # --- the cluster ----------------------------------------------------------------------------

    def _connect(self) -> None:
        import ray

        if ray.is_initialized():  # the caller's own cluster (tests, notebooks): used as is, never shut down
            return
        options: dict[str, Any] = {"logging_level": logging.WARNING, "log_to_driver": True}
        if self.cluster.address:
            self._probe(self.cluster.address)
            ray.init(address=self.cluster.address, **options)
        else:
            self.local = start_local_cluster(num_cpus=max(os.cpu_count() or 1, math.ceil(self._cpus_needed())),
                                             object_store_memory=_object_store_bytes(), include_dashboard=False,
                                             **options)
        self.owns_ray = True

    def _probe(self, address: str) -> None:
        """Fail fast on a host:port nothing listens on (ray.init would retry for minutes)."""
        host, _, port = address.rpartition(":")
        if "://" in address or not port.isdigit():  # "auto", ray:// client addresses: Ray's own checks
            return
        try:
            socket.create_connection((host or "127.0.0.1", int(port)), timeout=min(30.0, self.startup_timeout)).close()
        except OSError as exc:
            raise GrpoSdkError(f"cannot reach the Ray cluster at {address} (cluster.address): {exc}; start one with "
                               "`ray start --head`, or unset cluster.address to start a local cluster") from exc

    def _cpus_needed(self) -> float:
        c = self.cluster
        bundles = (max(c.policy_workers, c.generation_workers) if self.colocated
                   else c.policy_workers + c.generation_workers)
        return (bundles + c.env_workers) * c.cpus_per_worker

    def _placement(self) -> Placement:
        """Reserve every bundle of the run at once (or fail naming what is missing)."""
        if self.placement is not None:
            return self.placement
        import ray
        from ray.util.placement_group import placement_group

        c = self.cluster
        gpu = c.gpus_per_node > 0 and c.device != "cpu"
        bundle = {"CPU": float(c.cpus_per_worker), **({"GPU": 1.0} if gpu else {})}
        teacher = bool(self.config.on_policy_distillation.teacher_model)
        if self.colocated:
            size = max(c.policy_workers, c.generation_workers)
            sizes = {"shared": size}
            share = 1.0 / (2 + teacher)
            shares = {"policy": share, "teacher": share, "generation": share}
        else:
            sizes = {"train": c.policy_workers, "generation": c.generation_workers}
            shares = {"policy": 1.0 / (1 + teacher), "teacher": 1.0 / (1 + teacher), "generation": 1.0}
        total = {k: v * sum(sizes.values()) for k, v in bundle.items()}
        available = ray.cluster_resources()
        short = [f"{k} {total[k]:g} (the cluster has {available.get(k, 0):g})" for k in total
                 if total[k] > available.get(k, 0) + 1e-9]
        if short:
            raise GrpoSdkError(f"the Ray cluster is too small for this run: it needs {', '.join(short)} "
                               f"for {sum(sizes.values())} bundles of {bundle} ("
                               + ("colocated: max(policy_workers, generation_workers)" if self.colocated else
                                  "non-colocated: policy_workers + generation_workers")
                               + "); lower cluster.* workers or cluster.cpus_per_worker, or add nodes")
        selectors = self._node_selectors(bundle, sizes)
        strategy = "STRICT_PACK" if c.num_nodes == 1 else "PACK"  # PACK: the selectors say which node
        pgs = {name: placement_group([dict(bundle) for _ in range(n)], strategy=strategy,
                                     **({"bundle_label_selector": selectors[name]} if selectors else {}))
               for name, n in sizes.items()}
        try:
            ray.get([pg.ready() for pg in pgs.values()], timeout=self.startup_timeout)
        except Exception as exc:  # GetTimeoutError: the bundles cannot be placed (fragmented, nodes busy)
            for pg in pgs.values():
                _remove_placement_group(pg)
            where = f" on nodes {', '.join(map(nodes.short, self.nodes or []))}" if self.nodes else ""
            raise GrpoSdkError(f"could not reserve {sum(sizes.values())} bundles of {bundle} ({strategy}{where}) "
                               f"within cluster.startup_timeout_s={self.startup_timeout:g} s: {type(exc).__name__}; "
                               f"available now: {ray.available_resources()}") from exc
        if self.colocated:
            groups = {"policy": pgs["shared"], "teacher": pgs["shared"], "generation": pgs["shared"]}
            role_sizes = {role: sizes["shared"] for role in groups}
        else:
            groups = {"policy": pgs["train"], "teacher": pgs["train"], "generation": pgs["generation"]}
            role_sizes = {"policy": sizes["train"], "teacher": sizes["train"], "generation": sizes["generation"]}
        self.placement = Placement(groups=groups, shares=shares, bundle=bundle, sizes=role_sizes)
        return self.placement

    def _node_selectors(self, bundle: dict[str, float], sizes: dict[str, int]) -> dict[str, list[dict[str, str]]]:
        """With cluster.num_nodes > 1: the node of every bundle, as a label selector per bundle of each
        placement group (grpo_sdk.runtime.nodes: contiguous blocks, one per node; self.nodes records
        the nodes). Nothing on one node, where STRICT_PACK lets Ray pick it."""
        import ray
        from ray.util.placement_group import placement_group

        n = self.cluster.num_nodes
        if n == 1:
            return {}
        if "bundle_label_selector" not in inspect.signature(placement_group).parameters:
            raise GrpoSdkError(f"cluster.num_nodes={n} needs per-bundle node selectors in placement groups, which "
                               f"ray {ray.__version__} lacks; install a newer Ray (pip install -U 'grpo-sdk[ray]')")
        node_of = nodes.node_of_bundles(sum(sizes.values()), n)
        self.nodes = nodes.choose_nodes(ray.nodes(), nodes.block_resources(bundle, node_of, n),
                                        driver_node=ray.get_runtime_context().get_node_id(),
                                        address=self.cluster.address)
        selectors, start = {}, 0
        for name, size in sizes.items():  # the groups' bundles in order: policy ranks first, then replicas
            selectors[name] = [{nodes.NODE_LABEL: self.nodes[node_of[start + i]]} for i in range(size)]
            start += size
        return selectors

    def _record_placement(self) -> None:
        """``<run dir>/placement.json``: every worker's node, as the worker reported it (nodes.placement_record)."""
        if self.run_dir is None:
            return
        record = nodes.placement_record(self.cluster.num_nodes, self.nodes,
                                        [w for group in self.groups for w in group.workers])
        try:
            write_text_atomic(Path(self.run_dir) / PLACEMENT_FILE, json.dumps(record, indent=2) + "\n")
        except OSError as exc:  # a record, not the run: the checkpoints report a full disk themselves
            log.warning(f"could not write {PLACEMENT_FILE}: {exc}")

    # --- building components --------------------------------------------------------------------

    def build(self, kind: str, name: str, config: Any, context: Any) -> Any:
        if kind not in REMOTE_KINDS or (kind == "environment" and self._runs_agents(name)):
            # An agent environment only starts agents, which reach the policy over HTTP (the
            # rollout endpoint, served where the rollouts are collected): it needs no actors.
            return self.registry.load_impl(kind, name)(config, context)
        self._check_remote_component(kind, name)
        self.run_dir = self.run_dir or getattr(context, "run_dir", None)
        self.registry.get(kind, name)  # a clear PluginError (unknown, missing extra) before any actor starts
        if kind == "policy":
            return self._build_policy(name, config, context)
        if kind == "generation":
            return self._build_generation(name, config, context)
        return self._build_environment(name, config, context)

    def _runs_agents(self, name: str) -> bool:
        return Capability.RUNS_AGENTS in self.registry.get("environment", name).capabilities

    def _build_policy(self, name: str, config: Any, context: Any) -> PolicyGroup:
        role = "policy" if self.policy_group is None else "teacher"
        n = self.cluster.policy_workers
        workers = self._start_actors(role, n)
        group = PolicyGroup(self, workers, role=role)
        self._setup(group, [self._spec("policy", name, config, context, rank=r, world_size=n) for r in range(n)],
                    rendezvous=n > 1)
        if role == "policy":
            self.policy_group = group
        return group

    def _build_generation(self, name: str, config: Any, context: Any) -> GenerationGroup:
        m = self.cluster.generation_workers
        workers = self._start_actors("generation", m)
        colocated_policy = self.policy_group if self.colocated else None
        group = GenerationGroup(self, workers, tokenizer_path=context.tokenizer_path, colocated_policy=colocated_policy,
                                pad_token_id=context.pad_token_id)
        self._setup(group, [self._spec("generation", name, config, attrs.evolve(context, seed=context.seed + i))
                            for i in range(m)])
        return group

    def _build_environment(self, name: str, config: Any, context: Any) -> EnvironmentPool:
        k = self.cluster.env_workers
        self._check_environment_gpus()
        workers = self._start_actors("environment", k)
        impl = self.registry.load_impl("environment", name)
        group = EnvironmentPool(self, workers, max_concurrency=self.cluster.env_max_concurrency,
                                local_factory=local_sampler_factory(impl, config, context),
                                local_methods=local_methods(impl))
        self._setup(group, [self._spec("environment", name, config, context) for _ in range(k)])
        return group

    def _check_environment_gpus(self) -> None:
        """Environment actors with GPUs are placed outside the placement groups: fail now, naming the
        key, when the GPUs left cannot hold them (Ray would keep them pending until the startup deadline)."""
        import ray

        c = self.cluster
        wanted = c.env_workers * environment_actor_options(c).get("num_gpus", 0.0)
        left = ray.available_resources().get("GPU", 0.0)
        if wanted > left + 1e-9:
            raise GrpoSdkError(f"the environment actors need {wanted:g} GPUs (cluster.env_workers={c.env_workers} x "
                               f"cluster.env_gpus_per_worker={c.env_gpus_per_worker:g}), but the Ray cluster has "
                               f"{left:g} left beside the policy and generation bundles; lower them or add GPUs")

    def start_actor_on_driver_node(self, worker_class: type, group_class: type, *, role: str, spec: Any,
                                   max_concurrency: int) -> Any:
        """One ``worker_class`` actor (a ``ComponentWorker``) on the driver's node, so files read the
        same, set up from ``spec`` within cluster.startup_timeout_s, behind a ``group_class`` proxy that
        shuts down with the run (async GRPO's collector: grpo_sdk.rollouts.collector_worker). It
        reserves no CPU: such an actor coordinates other workers, and a cluster sized for them must
        take it. ``max_concurrency``: calls that run at once (its own threads are extra)."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        options = {"max_restarts": 0, "max_task_retries": 0, "num_cpus": 0, "max_concurrency": max_concurrency,
                   "scheduling_strategy": NodeAffinitySchedulingStrategy(
                       node_id=ray.get_runtime_context().get_node_id(), soft=False)}
        handle = WorkerHandle(actor=ray.remote(worker_class).options(**options).remote(), role=role, index=0,
                              show_node=self.cluster.num_nodes > 1)
        group = group_class(self, [handle])
        self._setup(group, [spec])
        return group

    def hook_modules(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The hook plugins the driver loaded by module name (``grpoctl run -p``) and the sys.path
        roots they were found under: workers load them too."""
        modules = tuple(p.module for p in self.registry.hook_plugins if p.status == "ok" and p.dist is None and p.module)
        return modules, tuple(_module_roots(modules))

    def _start_actors(self, role: str, count: int) -> list[WorkerHandle]:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        c = self.cluster
        if self._actor_class is None:
            self._actor_class = ray.remote(ComponentWorker)
        actor_class = self._actor_class
        handles = []
        for i in range(count):
            options: dict[str, Any] = {"max_restarts": 0, "max_task_retries": 0}
            if role == "environment":
                options.update(environment_actor_options(c))
            else:
                if role == "generation" and self.in_flight:  # a weight update runs while generate() is in flight
                    options["max_concurrency"] = 2
                placement = self._placement()
                share = placement.shares[role]
                options.update(
                    num_cpus=_quantity(placement.bundle["CPU"] * share),
                    num_gpus=_quantity(placement.bundle.get("GPU", 0.0) * share),
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=placement.groups[role],
                        placement_group_bundle_index=i % placement.sizes[role]))
            handles.append(WorkerHandle(actor=actor_class.options(**options).remote(), role=role, index=i,
                                        show_node=c.num_nodes > 1))
        return handles

    def _setup(self, group: WorkerGroup, specs: list[WorkerSpec], *, rendezvous: bool = False) -> None:
        """Start the group's workers and build their components within cluster.startup_timeout_s."""
        deadline = time.monotonic() + self.startup_timeout
        workers = group.workers

        def left() -> float:
            return max(0.001, deadline - time.monotonic())

        try:
            key = "cluster.startup_timeout_s"
            infos = gather([Call(w, "start", w.actor.ping.remote()) for w in workers], timeout=left(),
                           deadline_key=key)
            for worker, info in zip(workers, infos):
                worker.pid, worker.node, worker.node_id = info["pid"], info["node"], info.get("node_id")
            if rendezvous:
                addr, port = gather([Call(workers[0], "store_address", workers[0].actor.store_address.remote())],
                                    timeout=left(), deadline_key=key)[0]
                specs = [attrs.evolve(s, master_addr=addr, master_port=port) for s in specs]
            infos = gather([Call(w, "setup", w.actor.setup.remote(s)) for w, s in zip(workers, specs)],
                           timeout=left(), on_app_error="kill", deadline_key=key)
        except BaseException:
            for worker in workers:
                worker.kill()
            raise
        group.methods = set.intersection(*(set(info["methods"]) for info in infos))
        group.specs = specs
        self.groups.append(group)
        log.info(f"{group.workers[0].role} workers on nodes "
                 + ", ".join(f"{w.index}: {nodes.short(w.node_id)}" for w in workers))
        self._record_placement()

    def _spec(self, kind: str, name: str, config: Any, context: Any, *, rank: int = 0,
              world_size: int = 1) -> WorkerSpec:
        modules, roots = self.hook_modules()
        return WorkerSpec(kind=kind, name=name, config=config, context=attrs.evolve(context, registry=None),
                          rank=rank, world_size=world_size, hook_modules=modules, sys_path=roots)

    def _check_remote_component(self, kind: str, name: str) -> None:
        """A component registered in-process (PluginHost.register) cannot be rebuilt in a worker."""
        info = self.registry.info(kind, name)
        if info is None or not (info.dist or "").startswith("hook:"):
            return
        plugin = info.dist.split(":", 1)[1]
        hook = next((p for p in self.registry.hook_plugins if p.name == plugin), None)
        if hook is None or not hook.module:
            raise PluginError(
                f"{kind} {name!r} is registered in this process by hook plugin {plugin!r} (PluginHost.register), "
                "so Ray workers cannot build it: they discover components from installed entry points and "
                "`grpoctl run -p MODULE` modules. Install it as a package with an entry point, load it with -p, "
                "or use cluster.runtime=local")

    # --- failures and shutdown ------------------------------------------------------------------

    def record_failure(self, error: WorkerError) -> None:
        """After the first lost worker the runtime makes no more remote calls (``shutdown`` only kills)."""
        if self.failure is None:
            self.failure = error

    def shutdown(self) -> None:
        for group in reversed(self.groups):
            group.shutdown()
        self.groups = []
        if self.placement is not None:
            for pg in {id(pg): pg for pg in self.placement.groups.values()}.values():
                _remove_placement_group(pg)
            self.placement = None
        if self.owns_ray:
            import ray

            if self.local is not None:
                self.local.stop()
                self.local = None
            else:
                ray.shutdown()
            self.owns_ray = False


def _remove_placement_group(pg: Any) -> None:
    from ray.util.placement_group import remove_placement_group

    try:
        remove_placement_group(pg)
    except Exception:  # noqa: BLE001 - already removed, or the cluster is gone
        pass


def _object_store_bytes() -> int:
    low, high = LOCAL_OBJECT_STORE_BYTES
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return low
    return int(min(high, max(low, 0.3 * total)))


def _module_roots(modules: tuple[str, ...]) -> list[str]:
    """The sys.path entries the driver found these hook modules under (workers add them)."""
    roots = []
    for module in modules:
        top = module.split(":")[0].split(".")[0]
        try:
            spec = importlib.util.find_spec(top)
        except (ImportError, ValueError):
            continue
        if spec is None or not spec.origin or spec.origin in ("built-in", "frozen"):
            continue
        origin = Path(spec.origin)
        root = origin.parent.parent if origin.name == "__init__.py" else origin.parent
        if str(root) not in roots:
            roots.append(str(root))
    return roots
