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

The local cluster (``cluster.address`` null; ``start_local_cluster``) is this process's alone: every
server of it listens on loopback, it requires a token that this run generates (Ray's token
authentication; ``RAY_AUTH_MODE=disabled`` turns it off, with a warning), and a watchdog kills
what is left of it when this process dies, even by SIGKILL. A multi-node cluster is the
operator's: see docs/distributed.md, "Security".
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import ipaddress
import json
import logging
import math
import os
import secrets
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import attrs

from grpo_sdk.core.capabilities import Capability
from grpo_sdk.core.errors import GrpoSdkError, PluginError
from grpo_sdk.core.files import write_text_atomic
from grpo_sdk.runtime import nodes
from grpo_sdk.runtime.deadlines import Call, WorkerError, WorkerHandle, gather
from grpo_sdk.runtime.groups import (EnvironmentPool, GenerationGroup, PolicyGroup, WorkerGroup, local_methods,
                                    local_sampler_factory)
from grpo_sdk.runtime.workers import ComponentWorker, WorkerSpec

__all__ = ["RayRuntime", "WorkerError", "Placement", "LocalCluster", "start_local_cluster"]

log = logging.getLogger(__name__)

REMOTE_KINDS = ("policy", "generation", "environment")
LOCAL_OBJECT_STORE_BYTES = (256 << 20, 4 << 30)  # a local cluster's object store: 30% of RAM within these
AUTH_ENV = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")  # what start_local_cluster may set, and LocalCluster.stop restores
PLACEMENT_FILE = "placement.json"  # in the run directory: where every worker runs (grpo_sdk.runtime.nodes)
WATCH_INTERVAL_S = 0.5  # how often the watchdog looks for new processes of the cluster, and for the driver


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

    def __init__(self, config: Any, registry: Any):
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
        shuts down with the run (async GRPO's collector: grpo_sdk.trainer.collector_worker). It
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
    return subprocess.Popen([sys.executable, "-c", "from grpo_sdk.runtime.ray_runtime import watch; watch()",
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
