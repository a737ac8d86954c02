"""The weight-sync transports that run in the Ray workers: ``collective`` (a broadcast over a
torch.distributed group of policy rank 0 and the generation replicas) and ``cuda_ipc`` (GPU only).

* Pure parts, no Ray: bucketing, packing, the config checks, the collective worker code over a
  gloo group of threads, the cuda_ipc protocol over a TCPStore with a stand-in for CUDA IPC.
* On the shared Ray cluster (``helpers.ray_fixtures.ray_cluster``): 2 policy ranks (FSDP2) and 2
  generation replicas, colocated and not: the replicas hold exactly the policy's weights and
  report the version, and the run's results equal the disk transport's exactly; a replica killed
  or stalled mid-broadcast stops the sync with a WorkerError within the deadline.
* ``cuda_ipc`` on a GPU: ``test_cuda_ipc_on_a_gpu`` (marked ``gpu``). It is skipped without a CUDA
  device and HAS NOT BEEN RUN: no GPU was available when the transport was written.
"""

from __future__ import annotations

import datetime
import threading
import time

import attrs
import pytest
import torch

from grpo_sdk.config.loading import load_config
from helpers import bare_trainer, config_problems, train
from grpo_sdk.runtime.deadlines import WorkerError
from grpo_sdk.weight_sync import collective, cuda_ipc
from grpo_sdk.weight_sync.buckets import ALIGN, check_entry, describe, pack_into, plan_buckets, unpack

SHORT = ["grpo.max_num_steps=3", "grpo.val_period=0", "grpo.val_at_end=false", "checkpointing.enabled=false"]
RAY = ["cluster.runtime=ray"]
TWO_BY_TWO = ["cluster.policy_workers=2", "cluster.generation_workers=2"]
needs_ray = pytest.mark.usefixtures("ray_cluster")


def weights(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    """Mixed dtypes, shapes and sizes: a 0-d tensor, an empty one, bools, a tensor larger than a bucket."""
    g = torch.Generator().manual_seed(seed)
    return [
        ("embed", torch.randn(7, 5, generator=g)),
        ("scale", torch.tensor(3.5, dtype=torch.float64)),
        ("half", torch.randn(3, 3, generator=g).to(torch.bfloat16)),
        ("empty", torch.zeros(0, 4)),
        ("ids", torch.arange(11, dtype=torch.int64)),
        ("mask", torch.tensor([True, False, True])),
        ("big", torch.randn(300, generator=g)),  # 1200 bytes
        ("tail", torch.randn(2, 2, generator=g)),
    ]


# --- bucketing and packing -----------------------------------------------------------------------------


def test_buckets_keep_order_align_offsets_and_respect_the_size():
    specs = describe(weights())
    buckets = plan_buckets(specs, 256)
    assert [e.name for b in buckets for e in b.entries] == [name for name, _, _ in specs]
    for bucket in buckets:
        assert all(e.offset % ALIGN == 0 for e in bucket.entries)
        assert bucket.nbytes == bucket.entries[-1].offset + bucket.entries[-1].nbytes
        assert bucket.nbytes <= 256 or len(bucket.entries) == 1  # only a tensor larger than a bucket goes alone
        assert all(a.offset + a.nbytes <= b.offset for a, b in zip(bucket.entries, bucket.entries[1:]))
    big = next(b for b in buckets if any(e.name == "big" for e in b.entries))
    assert [e.name for e in big.entries] == ["big"] and big.nbytes == 1200
    assert len(plan_buckets(specs, 1 << 20)) == 1
    assert [len(b.entries) for b in plan_buckets(specs, 0)] == [1] * len(specs)
    assert plan_buckets([], 1024) == []


def test_a_bucket_packs_and_unpacks_every_dtype_exactly():
    items = weights()
    (bucket,) = plan_buckets(describe(items), 1 << 20)
    buffer = torch.empty(bucket.nbytes, dtype=torch.uint8)
    for entry, (name, tensor) in zip(bucket.entries, items):
        assert check_entry(entry, name, tensor) is None
        pack_into(buffer, entry, tensor)
    out = list(unpack(bucket, buffer))
    assert [name for name, _ in out] == [name for name, _ in items]
    for (_, got), (_, want) in zip(out, items):
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
    entry = bucket.entries[0]
    assert "the plan has (7, 5)" in check_entry(entry, "embed", torch.zeros(5, 7))
    assert "expected 'embed', got 'other'" in check_entry(entry, "other", torch.zeros(7, 5))


def test_the_broadcast_backend_follows_devices_and_placement():
    assert collective.choose_backend("auto", gpus=False, colocated=False) == "gloo"
    assert collective.choose_backend("auto", gpus=True, colocated=False) == "nccl"
    assert collective.choose_backend("auto", gpus=True, colocated=True) == "gloo"  # NCCL: one rank per GPU
    assert collective.choose_backend("gloo", gpus=True, colocated=False) == "gloo"


# --- config checks ---------------------------------------------------------------------------------------


def test_both_transports_are_installed_entry_points(registry):
    for name in ("collective", "cuda_ipc"):
        info = registry.info("weight_sync", name)
        assert info is not None and info.ok, info
        assert info.spec.capabilities == {"ray_workers"}  # what the config checks read
    assert "cuda_ipc" in registry.info("generation", "hf").spec.capabilities


def test_collective_needs_the_ray_runtime(registry):
    found = config_problems(registry, "weight_sync.backend=collective")
    assert "needs cluster.runtime=ray" in found["weight_sync.backend"]
    assert "inprocess" in found["weight_sync.backend"]
    load_config(None, [*RAY, *TWO_BY_TWO, "weight_sync.backend=collective"], registry)  # gloo on CPUs
    load_config(None, [*RAY, "weight_sync.backend=collective", "cluster.gpus_per_node=2",
                       "policy.generation.colocated.enabled=false", "weight_sync.collective.backend=nccl"], registry)


@pytest.mark.parametrize("overrides, text", [
    ([], "nccl needs GPUs"),
    (["cluster.gpus_per_node=2"], "nccl cannot put two ranks on one GPU"),  # colocated by default
])
def test_collective_over_nccl_needs_gpus_that_are_not_shared(registry, overrides, text):
    found = config_problems(registry, *RAY, "weight_sync.backend=collective", "weight_sync.collective.backend=nccl",
                     *overrides)
    assert text in found["weight_sync.collective.backend"]


GPU_COLOCATED = [*RAY, "cluster.gpus_per_node=2", *TWO_BY_TWO, "weight_sync.backend=cuda_ipc"]


@pytest.mark.parametrize("overrides, needs", [
    (["weight_sync.backend=cuda_ipc"], ["cluster.runtime=ray", "GPUs (cluster.gpus_per_node > 0"]),
    ([*RAY, "weight_sync.backend=cuda_ipc"], ["GPUs (cluster.gpus_per_node > 0"]),
    ([*GPU_COLOCATED, "cluster.device=cpu"], ["GPUs (cluster.gpus_per_node > 0 and cluster.device not cpu)"]),
    ([*GPU_COLOCATED, "policy.generation.colocated.enabled=false"], ["policy.generation.colocated.enabled=true"]),
    ([*GPU_COLOCATED, "cluster.policy_workers=1"], ["cluster.generation_workers (2) <= cluster.policy_workers (1)"]),
])
def test_cuda_ipc_is_refused_without_ray_gpus_and_colocation(registry, overrides, needs):
    # Without Ray, two problems: every transport that runs in the Ray workers needs it (the core's
    # check), and what cuda_ipc needs besides (its own check, ComponentSpec.check).
    message = config_problems(registry, *overrides)["weight_sync.backend"]
    assert "'cuda_ipc' shares GPU memory between processes on one GPU; it needs " in message
    for text in needs:
        assert text in message


def test_cuda_ipc_needs_a_generation_backend_that_declares_it(registry, monkeypatch):
    load_config(None, GPU_COLOCATED, registry)  # hf declares cuda_ipc
    info = registry.info("generation", "hf")
    plain = attrs.evolve(info, spec=attrs.evolve(info.spec, capabilities=info.spec.capabilities - {"cuda_ipc"}))
    real = registry.info
    monkeypatch.setattr(registry, "info", lambda kind, name: plain if (kind, name) == ("generation", "hf")
                        else real(kind, name))
    message = config_problems(registry, *GPU_COLOCATED)["weight_sync.backend"]
    assert "a generation backend that declares the cuda_ipc capability ('hf' does not)" in message


# --- the collective worker code, over a gloo group of threads (no Ray) ------------------------------------


class FakeWorker:
    """What the worker code reads of a ComponentWorker."""

    def __init__(self, component, rank=0):
        self.component, self.rank, self.state, self.device = component, rank, {}, "cpu"


class FakePolicy:
    def __init__(self, items):
        self.items = items

    def named_weights(self):
        yield from self.items


class FakeGeneration:
    def __init__(self, fail_after=None):
        self.got, self.version, self.fail_after = {}, 0, fail_after

    def update_weights(self, items, *, version):
        for i, (name, tensor) in enumerate(items):
            if i == self.fail_after:
                raise KeyError(f"no weight named {name!r}")
            self.got[name] = tensor.clone()
        self.version = version


def run_threads(*targets):
    """Run each target in a thread; their results, or the exceptions they raised."""
    results = [None] * len(targets)

    def run(i, target):
        try:
            results[i] = target()
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i, t)) for i, t in enumerate(targets)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a participant hung"
    return results


def collective_group(sender_items, receivers, bucket_bytes):
    """Policy rank 0 and the generation replicas joined to one gloo broadcast group, in threads."""
    from grpo_sdk.runtime.workers import ComponentWorker

    policy = FakeWorker(FakePolicy(sender_items))
    generations = [FakeWorker(gen) for gen in receivers]
    plan = plan_buckets(describe(sender_items), bucket_bytes)
    host, port = ComponentWorker.store_address(policy)  # as the transport asks rank 0 (store_address_op)
    size = 1 + len(generations)
    joins = [lambda w=w, r=r: collective.join_op(w, "g", host, port, r, size, "gloo", 30.0, plan)
             for r, w in enumerate([policy, *generations])]
    assert run_threads(*joins) == ["cpu"] * size
    return policy, generations


def test_collective_send_and_receive_over_a_gloo_group():
    items = weights()
    policy, generations = collective_group(items, [FakeGeneration(), FakeGeneration()], bucket_bytes=128)
    sent, *versions = run_threads(lambda: collective.send_op(policy, "g"),
                                  *[lambda w=w: collective.receive_op(w, "g", 4) for w in generations])
    assert sent == (len(items), sum(t.numel() * t.element_size() for _, t in items))
    assert versions == [4, 4]
    for gen in generations:
        assert gen.component.version == 4
        assert list(gen.component.got) == [name for name, _ in items]
        assert all(torch.equal(gen.component.got[name], t) for name, t in items)


def test_collective_participants_finish_the_broadcast_before_they_raise():
    """A replica whose backend raises, and a policy whose weights no longer match the plan, still take
    part to the end, so the others return instead of hanging."""
    items = weights()
    policy, generations = collective_group(items, [FakeGeneration(fail_after=2), FakeGeneration()], bucket_bytes=64)
    sent, failed, ok = run_threads(lambda: collective.send_op(policy, "g"),
                                   *[lambda w=w: collective.receive_op(w, "g", 1) for w in generations])
    assert sent[0] == len(items) and ok == 1
    assert isinstance(failed, KeyError)

    generations[0].component.fail_after = None
    policy.component.items = [(name, t) for name, t in items if name != "ids"]  # one tensor missing
    sent, *versions = run_threads(lambda: collective.send_op(policy, "g"),
                                  *[lambda w=w: collective.receive_op(w, "g", 2) for w in generations])
    assert isinstance(sent, ValueError) and "expected 'ids', got 'mask'" in str(sent)
    assert versions == [2, 2]  # they return (the run then stops with the policy's error)


# --- the cuda_ipc protocol, with a stand-in for CUDA IPC handles (no GPU) -----------------------------------


class FakeIPC:
    """share() hands out a key to the very tensor (zero-copy, as a CUDA IPC mapping is); open() returns it."""

    def __init__(self):
        self.buffers, self.shared = {}, 0

    def share(self, buffer):
        self.shared += 1
        self.buffers[self.shared] = buffer
        return self.shared

    def open(self, key):
        return self.buffers.pop(key)


class RecordingChannel(cuda_ipc.Channel):
    """The sender's channel, logging what it publishes and which acknowledgements it has seen."""

    def __init__(self, store, prefix, log):
        super().__init__(store, prefix)
        self.log = log

    def publish(self, k, payload):
        self.log.append(("publish", k, payload == cuda_ipc.END))
        super().publish(k, payload)

    def wait_acknowledged(self, k):
        super().wait_acknowledged(k)
        self.log.append(("acknowledged", k, False))


def most_unacknowledged(log):
    outstanding, most = 0, 0
    for event, _, end in log:
        if event == "publish" and not end:
            outstanding += 1
        elif event == "acknowledged":
            outstanding -= 1
        most = max(most, outstanding)
    assert outstanding == 0
    return most


def stores():
    from grpo_sdk.runtime.workers import free_port

    port = free_port()
    timeout = datetime.timedelta(seconds=30)
    master = torch.distributed.TCPStore("127.0.0.1", port, None, True, timeout=timeout, wait_for_workers=False)
    clients = [torch.distributed.TCPStore("127.0.0.1", port, None, False, timeout=timeout) for _ in range(2)]
    return master, clients


@pytest.mark.parametrize("bucket_bytes", [64, 256, 1 << 20])
def test_cuda_ipc_protocol_streams_every_weight_with_at_most_two_buffers(bucket_bytes):
    items = weights()
    ipc, log = FakeIPC(), []
    master, (send_store, receive_store) = stores()
    gen = FakeGeneration()

    def receive():
        received = cuda_ipc.receive_buckets(cuda_ipc.Channel(receive_store, "g/1/0"), open_=ipc.open, device="cpu")
        gen.update_weights(received, version=5)
        return cuda_ipc.finish(received)

    sent, left = run_threads(
        lambda: cuda_ipc.send_buckets(iter(items), RecordingChannel(send_store, "g/1/0", log),
                                      bucket_bytes=bucket_bytes, device="cpu", share=ipc.share),
        receive)
    assert sent == (len(items), sum(t.numel() * t.element_size() for _, t in items)) and left == 0
    assert list(gen.got) == [name for name, _ in items] and gen.version == 5
    assert all(torch.equal(gen.got[name], t) for name, t in items)
    # The same buckets as the collective transport's plan; never more than two buffers unacknowledged.
    buckets = len(plan_buckets(describe(items), bucket_bytes))
    assert sum(1 for event, _, end in log if event == "publish" and not end) == buckets
    assert most_unacknowledged(log) == min(2, buckets)
    assert not ipc.buffers  # every one opened
    assert not any(master.check([f"g/1/0/{kind}/{k}"]) for kind in ("bucket", "done") for k in range(buckets + 1))


def test_a_cuda_ipc_receiver_that_fails_releases_the_sender():
    items = weights()
    ipc = FakeIPC()
    _, (send_store, receive_store) = stores()
    gen = FakeGeneration(fail_after=1)

    def receive():
        received = cuda_ipc.receive_buckets(cuda_ipc.Channel(receive_store, "g/2/0"), open_=ipc.open, device="cpu")
        try:
            gen.update_weights(received, version=1)
        except KeyError:
            return cuda_ipc.finish(received)

    sent, left = run_threads(
        lambda: cuda_ipc.send_buckets(iter(items), cuda_ipc.Channel(send_store, "g/2/0"), bucket_bytes=64,
                                      device="cpu", share=ipc.share),
        receive)
    assert sent[0] == len(items)  # the sender got every acknowledgement and returned
    assert left == len(items) - 2

    def cannot_open(key):
        raise OSError("cudaIpcOpenMemHandle failed")

    def receive_nothing():
        gen.fail_after = None
        gen.update_weights(cuda_ipc.receive_buckets(cuda_ipc.Channel(receive_store, "g/3/0"), open_=cannot_open,
                                                    device="cpu"), version=2)

    sent, received = run_threads(
        lambda: cuda_ipc.send_buckets(iter(items), cuda_ipc.Channel(send_store, "g/3/0"), bucket_bytes=64,
                                      device="cpu", share=ipc.share),
        receive_nothing)
    assert isinstance(received, OSError)
    assert isinstance(sent, RuntimeError)  # told, instead of waiting for an acknowledgement until the timeout
    assert "could not read buffer 0: OSError: cudaIpcOpenMemHandle failed" in str(sent)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@needs_cuda
@needs_ray
def test_cuda_ipc_on_a_gpu(tmp_path):
    """NOT RUN YET (no GPU where it was written). One GPU, colocated: 1 policy rank and 1 replica share it;
    the replica ends with exactly the policy's weights and version, and the per-step results match the
    disk transport's (within 1e-4: GPU kernels need not be bitwise reproducible between runs)."""
    gpu = [*RAY, "cluster.gpus_per_node=1", "cluster.device=cuda"]
    on_disk = train(bare_trainer(tmp_path, "disk", *SHORT, *gpu, "weight_sync.backend=disk"))
    trainer = bare_trainer(tmp_path, "ipc", *SHORT, *gpu, "weight_sync.backend=cuda_ipc")
    try:
        trainer.setup()
        steps = []
        trainer.train(on_step=lambda step, metrics: steps.append(dict(metrics)))
        assert_replicas_hold_the_policy_weights(trainer, version=3)
        stats = trainer.components.weight_sync.sync_weights(trainer.components.policy, trainer.components.generation, version=4)
        assert stats.num_tensors == len(dict(trainer.components.policy.named_weights()))
        assert trainer.components.generation.weight_versions() == [4]
    finally:
        trainer.shutdown()
    assert len(steps) == len(on_disk) == 3
    for ipc_step, disk_step in zip(steps, on_disk):
        for key in ("loss", "reward/mean", "grad_norm"):
            assert abs(ipc_step[key] - disk_step[key]) <= 1e-4, (key, ipc_step[key], disk_step[key])


# --- on the Ray cluster --------------------------------------------------------------------------------------


def results(steps):
    """Every per-step metric but timings and throughput."""
    return [{k: v for k, v in m.items() if not k.startswith(("timing/", "perf/"))} for m in steps]


def assert_replicas_hold_the_policy_weights(trainer, *, version):
    from grpo_sdk.runtime.workers import attribute_op

    policy = dict(trainer.components.policy.named_weights())
    replicas = [{k: v.cpu() for k, v in model.state_dict().items()}  # the models as the replicas hold them
                for model in trainer.components.generation.run(attribute_op, "model")]
    for weights_of_replica in replicas:
        assert set(weights_of_replica) == set(policy)
        for name, tensor in policy.items():
            assert weights_of_replica[name].dtype == tensor.dtype
            assert torch.equal(weights_of_replica[name], tensor), name
    assert trainer.components.generation.weight_versions() == [version] * len(replicas)


@needs_ray
@pytest.mark.parametrize("layout", [
    pytest.param([], id="colocated"),
    pytest.param(["policy.generation.colocated.enabled=false"], id="not-colocated"),
])
def test_collective_gives_replicas_the_policy_weights_and_the_disk_results(tmp_path, layout):
    args = [*SHORT, *RAY, *TWO_BY_TWO, *layout]
    trainer = bare_trainer(tmp_path, "collective", *args, "weight_sync.backend=collective",
                          "weight_sync.collective.bucket_mb=0.1")  # several buckets
    try:
        trainer.setup()
        steps = []
        trainer.train(on_step=lambda step, metrics: steps.append(dict(metrics)))
        assert [m["generation/weight_version"] for m in steps] == [0.0, 1.0, 2.0]
        assert_replicas_hold_the_policy_weights(trainer, version=3)
        assert len(trainer.components.weight_sync.plan) > 1
        stats = trainer.components.weight_sync.sync_weights(trainer.components.policy, trainer.components.generation, version=7)
        policy = dict(trainer.components.policy.named_weights())
        assert (stats.version, stats.num_tensors) == (7, len(policy))
        assert stats.num_bytes == sum(t.numel() * t.element_size() for t in policy.values())
        assert trainer.components.generation.weight_versions() == [7, 7]
    finally:
        trainer.shutdown()
    on_disk = train(bare_trainer(tmp_path, "disk", *args, "weight_sync.backend=disk"))
    assert results(steps) == results(on_disk)  # exactly: the same bytes reach the replicas


def install_fault(kind: str, after: int):
    """A function for ``generation.run``: the replica's update_weights dies (SIGKILL) or hangs after
    ``after`` tensors, in the middle of the broadcast. Defined in a function, so Ray pickles it by value."""

    def install(worker):
        import os
        import signal
        import time

        original = worker.component.update_weights

        def update_weights(items, *, version):
            def faulty():
                for i, item in enumerate(items):
                    if i == after:
                        if kind == "kill":
                            os.kill(os.getpid(), signal.SIGKILL)
                        time.sleep(120)
                    yield item

            original(faulty(), version=version)

        worker.component.update_weights = update_weights

    return install


@needs_ray
@pytest.mark.parametrize("kind", ["kill", "stall"])
def test_a_replica_lost_mid_broadcast_stops_the_sync_with_a_worker_error(tmp_path, kind):
    trainer = bare_trainer(tmp_path, kind, *SHORT, *RAY, *TWO_BY_TWO, "grpo.max_num_steps=1",
                          "weight_sync.backend=collective", "weight_sync.collective.bucket_mb=0.001",
                          "weight_sync.collective.timeout_s=8")
    try:
        trainer.setup()
        trainer.train()  # the first sync forms the group
        assert trainer.components.generation.weight_versions() == [1, 1]
        trainer.components.generation.run(install_fault(kind, after=3), ranks=[1])
        victim = trainer.components.generation.workers[1].label
        start = time.monotonic()
        with pytest.raises(WorkerError) as info:
            trainer.components.weight_sync.sync_weights(trainer.components.policy, trainer.components.generation, version=2)
        elapsed = time.monotonic() - start
    finally:
        trainer.shutdown()
    if kind == "kill":
        assert info.value.worker == victim
        assert str(info.value).startswith(f"{victim} died during collective_receive() after ")
        assert elapsed < 30
    else:
        assert victim in str(info.value) and "within 8.0 s (weight_sync.collective.timeout_s)" in str(info.value)
        assert 8 <= elapsed < 30  # the deadline ended it, not the 120 s sleep
