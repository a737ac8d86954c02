"""Driver-side proxies that implement the protocols over Ray actors.

* ``PolicyGroup``: the policy as a worker group of N ranks joined by torch.distributed. Every
  call goes to every rank at once with the same arguments (the policy backend's data-parallel
  contract: each rank gets the full batch, every rank calls every method, collectives such as
  ``named_weights`` and ``save_checkpoint`` included) and returns rank 0's result.
* ``GenerationGroup``: M independent replicas; ``generate`` gives each a contiguous share of
  the rows and concatenates what they return; ``update_weights`` sends the weights to all.
* ``EnvironmentPool``: K environment actors, each running up to ``env_max_concurrency`` calls at
  once; ``step`` splits the batch into chunks and gathers them in order. ``sample_prompts`` runs
  on a local instance, so the driver's ``random.Random`` advances exactly as in-process.

A proxy has the optional protocol methods its remote component has, and only those (``methods``,
what the workers report), so ``isinstance`` against the optional protocols of
``grpo_sdk.core.protocols`` answers for the proxy as for the component. The policy group is always
a ``WeightFileWriter`` and the generation group a ``WeightFileLoader``: they do the ``disk``
transport's file work in the workers themselves, with the component's own method when it has one.

Every remote call has a deadline (``grpo_sdk.runtime.deadlines``). Transports and tools can run
their own code in the workers with ``group.run(fn, *args)`` (``fn(worker, *args)`` on every
worker, results in order) or, to overlap calls on two groups (a broadcast needs the sender and the
receivers in flight together), ``group.submit(...)`` on each and one ``group.wait(calls)``.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import attrs

from grpo_sdk.core.protocols import SupportsShutdown
from grpo_sdk.runtime.deadlines import Call, WorkerError, WorkerHandle, gather
from grpo_sdk.runtime.workers import attribute_op, load_weights_op, named_weights_op, save_weights_op

# --- splitting and merging (pure; unit-tested without Ray) ------------------------------------------


def split_rows(rows: int, parts: int) -> list[tuple[int, int]]:
    """Contiguous ``(start, stop)`` ranges of ``rows`` in at most ``parts`` non-empty chunks whose sizes
    differ by at most one (the first ones are the larger)."""
    parts = max(1, min(parts, rows))
    size, extra = divmod(rows, parts)
    out, start = [], 0
    for i in range(parts):
        stop = start + size + (1 if i < extra else 0)
        out.append((start, stop))
        start = stop
    return out if rows else []


def pad_right(tensor: Any, width: int, value: float) -> Any:
    import torch

    missing = width - tensor.shape[1]
    return torch.nn.functional.pad(tensor, (0, missing), value=value) if missing > 0 else tensor


def merge_generation_outputs(outputs: Sequence[Any], pad_token_id: int) -> Any:
    """One GenerationOutput from the replicas' outputs, in row order; responses re-padded to one width.

    ``weight_version`` is the oldest; ``token_weight_versions`` stays None when no replica reported
    any (each sampled with one version), else a replica without them is filled with its
    ``weight_version`` and padding with the replica's oldest version, as a backend pads its own."""
    import torch

    from grpo_sdk.core.records import GenerationOutput

    if len(outputs) == 1:
        return outputs[0]
    width = max(int(o.response_ids.shape[1]) for o in outputs)
    versions = None
    if any(o.token_weight_versions is not None for o in outputs):
        versions = torch.cat([
            pad_right(o.token_weight_versions if o.token_weight_versions is not None
                      else torch.full(tuple(o.response_ids.shape), o.weight_version, dtype=torch.long),
                      width, o.weight_version)
            for o in outputs])
    return GenerationOutput(
        response_ids=torch.cat([pad_right(o.response_ids, width, pad_token_id) for o in outputs]),
        response_lengths=torch.cat([o.response_lengths for o in outputs]),
        logprobs=torch.cat([pad_right(o.logprobs, width, 0.0) for o in outputs]),
        truncated=torch.cat([o.truncated for o in outputs]),
        weight_version=min(o.weight_version for o in outputs),
        token_weight_versions=versions,
    )


def merge_environment_returns(returns: Sequence[Any], sizes: Sequence[int],
                              metadata: Sequence[Sequence[dict[str, Any]]]) -> Any:
    """One EnvironmentReturn from the chunks' returns, in row order.

    Rewards are concatenated per component (every chunk must return the same components);
    metrics are averaged weighted by chunk size, which gives the in-process value for per-sample
    means (an accuracy, a fraction). ``done``/``observations``/``metadata``/``flags`` are None when every
    chunk left them None, else filled per chunk with their defaults (done, no observation, the
    metadata as sent, no flags).
    """
    from grpo_sdk.core.records import EnvironmentReturn

    if len(returns) == 1:
        return returns[0]
    names = set(returns[0].rewards)
    for i, ret in enumerate(returns):
        if not isinstance(ret, EnvironmentReturn):
            raise TypeError(f"step() returned {type(ret).__name__}, not an EnvironmentReturn (chunk {i})")
        if set(ret.rewards) != names:
            raise ValueError(f"environment chunks returned different reward components: {sorted(names)} "
                             f"and {sorted(ret.rewards)} (chunk {i})")
    rewards = {name: [v for ret in returns for v in ret.rewards[name]] for name in returns[0].rewards}
    keys = {k for ret in returns for k in ret.metrics}
    metrics = {}
    for key in sorted(keys):
        pairs = [(ret.metrics[key], n) for ret, n in zip(returns, sizes) if key in ret.metrics]
        weight = sum(n for _, n in pairs)
        metrics[key] = sum(float(v) * n for v, n in pairs) / weight if weight else float("nan")

    def merged(field: str, default: Callable[[int, int], list[Any]]) -> list[Any] | None:
        values = [getattr(ret, field) for ret in returns]
        if all(v is None for v in values):
            return None
        return [x for i, (v, n) in enumerate(zip(values, sizes)) for x in (default(i, n) if v is None else v)]

    return EnvironmentReturn(
        rewards=rewards,
        done=merged("done", lambda i, n: [True] * n),
        observations=merged("observations", lambda i, n: [None] * n),
        metadata=merged("metadata", lambda i, n: list(metadata[i])),
        flags=merged("flags", lambda i, n: [()] * n),
        metrics=metrics,
    )


# --- the groups ---------------------------------------------------------------------------------------


class WorkerGroup:
    """Actors of one role, the deadlines of calls to them, and their shutdown."""

    role = "worker"

    def __init__(self, runtime: Any, workers: list[WorkerHandle], *, collective: bool = False):
        self.runtime = runtime
        self.workers = workers
        self.collective = collective  # ranks of one torch.distributed group: one failing stops the others
        self._in_flight = 0  # calls being waited for; rollouts' scoring threads wait concurrently
        # += is a read and a write. CPython 3.11's GIL happens not to switch between them (8 threads x 20k
        # waits kept the count without the lock), but a free-threaded Python would lose counts.
        self._in_flight_lock = threading.Lock()
        self._closed = False
        self._broken: str | None = None
        self.methods = ()  # the runtime sets what the workers report once they are set up
        self.specs: list[Any] = []  # what the workers were built from (the runtime sets it too)

    # Optional protocol methods --------------------------------------------------------------------

    def _optional_methods(self) -> dict[str, Callable[..., Any]]:
        """The optional protocol methods this proxy forwards, by name. Each is an attribute of the proxy
        only when every worker's component has it (``methods``), so ``isinstance(proxy, Checkpointable)``
        answers as for the component (``grpo_sdk.core.protocols``)."""
        return {}

    @property
    def methods(self) -> frozenset[str]:
        """The optional protocol methods every worker's component has, as the workers reported them."""
        return self._methods

    @methods.setter
    def methods(self, names: Iterable[str]) -> None:
        self._methods = frozenset(names)
        for name, method in self._optional_methods().items():
            if name in self._methods:
                setattr(self, name, method)
            else:
                self.__dict__.pop(name, None)

    # The generic interface (transports, tools) ------------------------------------------------------

    def submit(self, fn: Callable[..., Any], *args: Any, ranks: Sequence[int] | None = None,
               name: str | None = None, **kwargs: Any) -> list[Call]:
        """Start ``fn(worker, *args, **kwargs)`` on the given workers (default all); ``wait`` them."""
        self._check_usable()
        label = name or getattr(fn, "__name__", "run")
        targets = self.workers if ranks is None else [self.workers[r] for r in ranks]
        return [Call(w, label, w.actor.run.remote(fn, *args, **kwargs)) for w in targets]

    def run(self, fn: Callable[..., Any], *args: Any, ranks: Sequence[int] | None = None,
            timeout: float | None = None, name: str | None = None, **kwargs: Any) -> list[Any]:
        """``fn(worker, *args, **kwargs)`` on every worker (or ``ranks``), results in order, with a deadline."""
        return self.wait(self.submit(fn, *args, ranks=ranks, name=name, **kwargs), timeout=timeout)

    def wait(self, calls: Sequence[Call], *, timeout: float | None = None, on_app_error: str | None = None,
             deadline_key: str | None = None) -> list[Any]:
        """Gather calls (possibly from several groups) within ``timeout`` (default cluster.call_timeout_s).

        ``on_app_error`` (``"wait"``/``"kill"``, see ``deadlines.gather``) defaults to ``"kill"`` for the
        ranks of one torch.distributed group and ``"wait"`` otherwise. A transport whose worker code
        finishes its collectives before it raises passes ``"wait"``: the others then end normally, and a
        peer that died is reported as the WorkerError naming it rather than as its peers' errors.
        ``deadline_key`` is the setting a missed deadline names (default cluster.call_timeout_s)."""
        self._count_in_flight(+1)
        try:
            results = gather(calls, timeout=timeout or self.runtime.call_timeout,
                             on_app_error=on_app_error or ("kill" if self.collective else "wait"),
                             on_failure=self.runtime.record_failure,
                             deadline_key=deadline_key or "cluster.call_timeout_s")
        except Exception as exc:
            self._count_in_flight(-1)  # every call has ended (answered, raised, or its worker was killed)
            if self.collective and not isinstance(exc, WorkerError):
                # One rank raised and the others were stopped: the group cannot take another call.
                self._broken = f"a {self.role} rank raised {type(exc).__name__}: {exc}"
            raise
        # A KeyboardInterrupt leaves the count up: calls may still be running, and shutdown kills
        # the workers instead of queueing a teardown behind them.
        self._count_in_flight(-1)
        return results

    def _count_in_flight(self, delta: int) -> None:
        with self._in_flight_lock:
            self._in_flight += delta

    # Protocol calls ------------------------------------------------------------------------------------

    def _call_all(self, method: str, *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        """``method`` on every worker with the same arguments; rank 0's result."""
        self._check_usable()
        calls = [Call(w, method, w.actor.call.remote(method, *args, _want_result=(i == 0), **kwargs))
                 for i, w in enumerate(self.workers)]
        return self.wait(calls, timeout=timeout)[0]

    def _check_usable(self) -> None:
        if self._closed:
            raise WorkerError(f"the {self.role} workers were shut down")
        if self._broken is not None:
            raise WorkerError(f"not calling the {self.role} workers: {self._broken}; the other ranks were stopped")
        failure = self.runtime.failure
        if failure is not None:
            raise WorkerError(f"not calling the {self.role} workers: the run already lost a worker ({failure})",
                              worker=failure.worker, call=failure.call, elapsed=failure.elapsed)

    def shutdown(self) -> None:
        """The component's own shutdown (bounded), then the actors are killed; never hangs."""
        if self._closed:
            return
        self._closed = True
        healthy = self.runtime.failure is None and self._broken is None and self._in_flight == 0
        try:
            if healthy:
                calls = [Call(w, "shutdown", w.actor.teardown.remote()) for w in self.workers]
                gather(calls, timeout=min(self.runtime.call_timeout, 60.0), on_app_error="wait")
        except Exception as exc:  # noqa: BLE001 - shutting down: report, then kill regardless
            print(f"grpo-sdk: {self.role} workers did not shut down cleanly: {exc}", flush=True)
        finally:
            for worker in self.workers:
                worker.kill()


class PolicyGroup(WorkerGroup):
    """The Policy protocol over N ranks; each call runs on every rank, rank 0 answers."""

    def __init__(self, runtime: Any, workers: list[WorkerHandle], role: str = "policy"):
        super().__init__(runtime, workers, collective=len(workers) > 1)
        self.role = role

    def _put(self, batch: Any) -> Any:
        import attrs
        import ray

        # The episodes (messages, metadata) stay with the driver: the policy trains on tensors.
        batch = attrs.evolve(batch, message_logs=(), metadata=()) if hasattr(batch, "message_logs") else batch
        return ray.put(batch) if len(self.workers) > 1 else batch  # one copy in the object store for N ranks

    def logprobs(self, batch: Any) -> Any:
        return self._call_all("logprobs", self._put(batch))

    def reference_logprobs(self, batch: Any) -> Any:
        return self._call_all("reference_logprobs", self._put(batch))

    def train(self, batch: Any, loss_fn: Any) -> dict[str, float]:
        return self._call_all("train", self._put(batch), loss_fn)

    def named_weights(self) -> Iterator[tuple[str, Any]]:
        """Rank 0's full tensors, on the CPU, brought to the driver (every rank drains its iterator: a
        collective under FSDP2)."""
        return iter(self.run(named_weights_op, name="named_weights")[0])

    def save_weights(self, path: str) -> tuple[int, int]:
        """Rank 0 writes ``named_weights`` to one safetensors file (the disk transport); (tensors, bytes)."""
        return self.run(save_weights_op, path, name="save_weights")[0]

    def save_checkpoint(self, path: str) -> None:
        self._call_all("save_checkpoint", path)

    def load_checkpoint(self, path: str) -> None:
        self._call_all("load_checkpoint", path)

    def offload(self) -> None:
        self._call_all("offload")

    def onload(self) -> None:
        self._call_all("onload")


class GenerationGroup(WorkerGroup):
    """The Generation protocol over M replicas, each sampling a contiguous share of every batch.

    Replica i samples with seed ``grpo.seed + i``, so one replica samples exactly as in-process.
    ``PausesForRefit`` is forwarded to every replica when every replica has it. With colocated generation, ``colocated_policy`` is offloaded before each round of generation
    and onloaded after it (the coordination NeMo-RL does around refit and generation).
    """

    role = "generation"

    def __init__(self, runtime: Any, workers: list[WorkerHandle], *, tokenizer_path: str,
                 colocated_policy: PolicyGroup | None = None, pad_token_id: int | None = None):
        super().__init__(runtime, workers)
        self.tokenizer_path = tokenizer_path
        self.colocated_policy = colocated_policy
        self._pad_token_id = pad_token_id  # RunContext.pad_token_id; loaded from the tokenizer when not given

    @property
    def pad_token_id(self) -> int:
        if self._pad_token_id is None:
            from grpo_sdk.core.models import load_tokenizer

            self._pad_token_id = int(load_tokenizer(self.tokenizer_path).pad_token_id)
        return self._pad_token_id

    def generate(self, prompts: Any, sampling: Any) -> Any:
        from grpo_sdk.core.records import GenerationInput

        self._check_usable()
        rows = int(prompts.input_ids.shape[0])
        calls = []
        for i, (start, stop) in enumerate(split_rows(rows, len(self.workers))):
            budgets, seeds = prompts.max_new_tokens, prompts.seeds  # per row: they travel with their rows
            chunk = GenerationInput(input_ids=prompts.input_ids[start:stop],
                                    attention_mask=prompts.attention_mask[start:stop],
                                    max_new_tokens=budgets[start:stop] if budgets is not None else None,
                                    seeds=seeds[start:stop] if seeds is not None else None)
            params = sampling
            if sampling.seed is not None and i > 0:  # a fixed-seed call (validation): a distinct stream per replica
                params = attrs.evolve(sampling, seed=sampling.seed + 1_000_003 * i)
            worker = self.workers[i]
            calls.append(Call(worker, "generate", worker.actor.call.remote("generate", chunk, params)))
        if not calls:
            first = self.workers[0]
            calls = [Call(first, "generate", first.actor.call.remote("generate", prompts, sampling))]
        outputs = self.wait(calls)
        return merge_generation_outputs(outputs, self.pad_token_id)

    def update_weights(self, weights: Any, *, version: int) -> None:
        import ray

        self._check_usable()
        ref = ray.put(list(weights))  # materialised once, one copy in the object store for every replica
        self.wait([Call(w, "update_weights", w.actor.call.remote("update_weights", ref, version=version))
                   for w in self.workers])

    def load_weights(self, path: str, *, version: int) -> None:
        """Every replica loads a weights file the policy wrote (the disk transport)."""
        self.run(load_weights_op, path, version, name="load_weights")

    def prepare_for_generation(self) -> None:
        if self.colocated_policy is not None:
            self.colocated_policy.offload()
        self._call_all("prepare_for_generation")

    def finish_generation(self) -> None:
        self._call_all("finish_generation")
        if self.colocated_policy is not None:
            self.colocated_policy.onload()

    def weight_versions(self) -> list[int]:
        """Each replica's current weight version (monitoring, tests)."""
        return self.run(attribute_op, "weight_version", name="weight_version")

    def _optional_methods(self) -> dict[str, Callable[..., Any]]:
        return {"save_checkpoint": self._save_checkpoint, "load_checkpoint": self._load_checkpoint,
                "pause_generation": self._pause_generation, "resume_generation": self._resume_generation}

    def _pause_generation(self, *, keep_in_flight: bool) -> None:
        """Every replica pauses (``PausesForRefit``); returns once all have."""
        self._call_all("pause_generation", keep_in_flight=keep_in_flight)

    def _resume_generation(self, *, recompute_kv_cache: bool) -> None:
        self._call_all("resume_generation", recompute_kv_cache=recompute_kv_cache)

    def _save_checkpoint(self, path: str) -> None:
        """Replica 0's state in ``path`` (the in-process layout, so either runtime resumes it), replica
        i's in ``path/replica_i``."""
        self._check_usable()
        self.wait([Call(w, "save_checkpoint", w.actor.call.remote("save_checkpoint", _replica_dir(path, i)))
                   for i, w in enumerate(self.workers)])

    def _load_checkpoint(self, path: str) -> None:
        """Each replica loads its own state; replicas the checkpoint has none for keep their fresh state."""
        self._check_usable()
        calls = [Call(w, "load_checkpoint", w.actor.call.remote("load_checkpoint", _replica_dir(path, i)))
                 for i, w in enumerate(self.workers) if Path(_replica_dir(path, i)).is_dir()]
        self.wait(calls)


def _replica_dir(path: str, index: int) -> str:
    return str(path) if index == 0 else str(Path(path) / f"replica_{index}")


class EnvironmentPool(WorkerGroup):
    """The Environment protocol over K actors; ``sample_prompts`` and ``tool_schemas`` (when the
    environment has them) run on a local instance, so the driver's prompt stream is exactly the
    in-process one and prompts are rendered with the tools without a remote call."""

    role = "environment"

    def __init__(self, runtime: Any, workers: list[WorkerHandle], *, max_concurrency: int,
                 local_factory: Callable[[], Any] | None, local_methods: Sequence[str] = ("sample_prompts",)):
        super().__init__(runtime, workers)
        self.max_concurrency = max_concurrency
        self._local_factory = local_factory
        self._local: Any = None
        if local_factory is not None:  # only environments that have them have these
            if "sample_prompts" in local_methods:
                self.sample_prompts = self._sample_prompts
            if "tool_schemas" in local_methods:
                self.tool_schemas = lambda: self._local_instance().tool_schemas()

    def _local_instance(self) -> Any:
        if self._local is None:
            self._local = self._local_factory()
        return self._local

    def _sample_prompts(self, num_prompts: int, rng: Any) -> Any:
        return self._local_instance().sample_prompts(num_prompts, rng)

    def step(self, message_logs: Sequence[Any], metadata: Sequence[dict[str, Any]]) -> Any:
        self._check_usable()
        rows = len(message_logs)
        ranges = split_rows(rows, len(self.workers) * self.max_concurrency) or [(0, 0)]
        calls, sizes, metas = [], [], []
        for i, (start, stop) in enumerate(ranges):
            worker = self.workers[i % len(self.workers)]  # round robin: at most max_concurrency chunks each
            logs, meta = list(message_logs[start:stop]), list(metadata[start:stop])
            calls.append(Call(worker, "step", worker.actor.call.remote("step", logs, meta)))
            sizes.append(stop - start)
            metas.append(meta)
        return merge_environment_returns(self.wait(calls), sizes, metas)

    def shutdown(self) -> None:
        try:
            super().shutdown()
        finally:
            self.close_local()

    def close_local(self) -> None:
        """Shut down the local instance ``sample_prompts`` uses (the actors are ``shutdown``'s)."""
        local, self._local = self._local, None
        if isinstance(local, SupportsShutdown):
            local.shutdown()


def local_methods(impl: Any) -> tuple[str, ...]:
    """The methods of ``impl`` an EnvironmentPool runs on a local instance: ``sample_prompts``
    (``PromptSampler``) and ``tool_schemas`` (``DeclaresTools``)."""
    from grpo_sdk.core.multi_turn import DeclaresTools
    from grpo_sdk.core.protocols import PromptSampler

    if not isinstance(impl, type):
        return ()
    return tuple(name for name, protocol in (("sample_prompts", PromptSampler), ("tool_schemas", DeclaresTools))
                 if issubclass(impl, protocol))


def local_sampler_factory(impl: Any, config: Any, context: Any) -> Callable[[], Any] | None:
    """What builds an environment's local instance (``local_methods``); None when it needs none."""
    return (lambda: impl(config, context)) if local_methods(impl) else None
