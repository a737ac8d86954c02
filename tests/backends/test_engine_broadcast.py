"""The collective transport driving an engine's own weight-update group (``ReceivesBroadcast``), in
the local runtime: the driver is rank 0, the engine a stand-in server in another process
(tests/engine_servers/refit_server.py: a real model, a real gloo group built the engines' way,
real HTTP). What this proves: the transport's side of the protocol (group formation at rank
offsets, one broadcast per listed tensor in the listed order, the last call finishing the update,
errors and deadlines). What it does not: that a real SGLang / TensorRT-LLM / Dynamo worker joins
our rank 0 (the stand-in uses the same construction as their source, core/process_groups.py)."""

from __future__ import annotations

import time

import pytest
from engine_servers.base import start_server

from grpo_sdk.config.loading import load_config
from grpo_sdk.plugins.toolkit import HTTPClient
from grpo_sdk.weight_sync.collective import CollectiveWeightSync
from grpo_sdk.weight_sync.specs import CollectiveWeightSyncConfig

from helpers import perturbed_policy


class RefitClient:
    """Test-only ReceivesBroadcast generation: the transport's counterpart, speaking refit_server's routes."""

    def __init__(self, url: str, timeout_s: float = 30):
        self.http = HTTPClient(url, timeout_s=timeout_s, what="refit_server")

    def broadcast_ranks(self) -> int:
        return 1

    def join_broadcast(self, *, master_address, master_port, rank_offset, world_size, group_name, backend):
        self.http.post("/join", dict(master_address=master_address, master_port=master_port, rank_offset=rank_offset,
                                     world_size=world_size, group_name=group_name, backend=backend))

    def receive_broadcast(self, tensors, *, group_name, version, last):
        self.http.post("/receive", {"names": [n for n, _, _ in tensors], "shapes": [list(s) for _, s, _ in tensors],
                                    "dtypes": [d for _, _, d in tensors], "group_name": group_name,
                                    "version": version, "last": last})


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    server = start_server("refit_server", tiny_model_dir)
    yield server
    server.stop()


def assert_engine_has(server, policy, version):
    digest = HTTPClient(server.url, timeout_s=30, what="refit_server").get("/digest")
    assert digest["version"] == version
    sums = {name: float(t.double().sum()) for name, t in policy.named_weights()}
    shared = set(sums) & set(digest["sums"])
    assert len(shared) >= len(sums) - 1  # every weight the policy sends is one the engine has
    for name in shared:
        assert digest["sums"][name] == pytest.approx(sums[name], rel=1e-6, abs=1e-6), name


def test_the_engine_receives_every_tensor_in_small_batches_and_joins_once(server, context):
    # bucket_mb tiny: many receive calls per sync, the last one finishing the update.
    sync = CollectiveWeightSync(CollectiveWeightSyncConfig(bucket_mb=0.05, timeout_s=60), context)
    client = RefitClient(server.url)
    for version, seed in ((1, 1), (2, 2)):
        policy = perturbed_policy(context, seed, 0.01)
        stats = sync.sync_weights(policy, client, version=version)
        assert stats.version == version and stats.num_tensors == len(list(policy.named_weights()))
        assert stats.num_bytes == sum(t.numel() * t.element_size() for _, t in policy.named_weights())
        assert_engine_has(server, policy, version)
    assert len(sync.local.plan) > 3  # several batches
    assert HTTPClient(server.url, timeout_s=10, what="x").get("/joins") == 1  # the group is formed once
    sync.shutdown()


def test_an_engine_that_rejects_an_update_fails_the_sync_at_once_with_its_message(server, context):
    sync = CollectiveWeightSync(CollectiveWeightSyncConfig(timeout_s=60), context)
    client = RefitClient(server.url)
    policy = perturbed_policy(context, 3, 0.01)
    sync.sync_weights(policy, client, version=1)
    HTTPClient(server.url, timeout_s=10, what="x").post("/fail_next")
    start = time.monotonic()
    with pytest.raises(Exception, match=r"/receive failed: HTTP 400: .*rejected the update of"):
        sync.sync_weights(policy, client, version=2)
    assert time.monotonic() - start < 20  # the engine's error, not rank 0's broadcast timing out (60 s)
    sync.shutdown()


def test_an_engine_that_never_answers_is_a_deadline_not_a_hang(context, tiny_model_dir):
    sync = CollectiveWeightSync(CollectiveWeightSyncConfig(timeout_s=3), context)
    dead = start_server("refit_server", tiny_model_dir)
    dead.process.send_signal(19)  # SIGSTOP: the socket accepts, nothing answers
    try:
        start = time.monotonic()
        with pytest.raises(Exception, match=r"no answer from POST .*/join within|did not join the weight-update "
                                            r"group within 3 s"):
            sync.sync_weights(perturbed_policy(context, 4, 0.01), RefitClient(dead.url, timeout_s=3), version=1)
        assert time.monotonic() - start < 15
    finally:
        dead.process.kill()
        dead.process.wait(timeout=10)
        sync.shutdown()


RECEIVER_SPEC = '''
from grpo_sdk.plugins import ComponentSpec

GENERATION = ComponentSpec(name="acme", kind="generation", impl="acme_gen.spec:Nothing",
                           capabilities={"receives_broadcast"})
'''


def test_collective_needs_ray_unless_the_engine_receives_the_broadcast_itself(fake_site):
    fake_site.add("acme-gen", entry_points={"grpo_sdk.generation": {"acme": "acme_gen.spec:GENERATION"}},
                  files={"acme_gen/__init__.py": "", "acme_gen/spec.py": RECEIVER_SPEC})
    engine = fake_site.grpoctl("config", "validate", "policy.generation.backend=acme", "weight_sync.backend=collective")
    assert engine.returncode == 0, engine.stdout + engine.stderr
    hf = fake_site.grpoctl("config", "validate", "weight_sync.backend=collective")
    assert hf.returncode == 2 and "'collective' moves weights between Ray workers" in hf.stderr


@pytest.fixture(scope="module")
def dynamo_workers(tiny_model_dir):
    servers = [start_server("dynamo_server", tiny_model_dir, "--model-name", "tiny") for _ in range(2)]
    yield servers
    for server in servers:
        server.stop()


def test_on_ray_policy_rank_0_broadcasts_into_the_engines_group(ray_cluster, dynamo_workers, tmp_path):
    """The Ray side of the same protocol, end to end: two FSDP2 policy ranks (both drain
    named_weights, rank 0 hosts the group and broadcasts), one generation worker whose dynamo
    backend makes two stand-in engine workers join at ranks 1 and 2; three GRPO steps, each
    sampling with the weights of the step before (the version and token_mult_prob_error say so)."""
    from grpo_sdk.plugins.registry import Registry
    from grpo_sdk.trainer.trainer import GRPOTrainer

    frontend, other = dynamo_workers
    registry = Registry.discover()
    cfg = load_config(None, [
        "grpo.max_num_steps=3", "grpo.val_period=0", "grpo.val_at_end=false", "checkpointing.enabled=false",
        "cluster.runtime=ray", "cluster.policy_workers=2", "cluster.generation_workers=1",
        "policy.generation.backend=dynamo", f"policy.generation.dynamo.frontend_url={frontend.url}/v1",
        f"policy.generation.dynamo.worker_urls=[{frontend.url},{other.url}]", "policy.generation.dynamo.model_name=tiny",
        "policy.generation.dynamo.weight_transfer_backend=gloo", "policy.generation.colocated.enabled=false",
        "weight_sync.backend=collective", "weight_sync.collective.backend=gloo",
        "weight_sync.collective.bucket_mb=0.05"], registry)
    trainer = GRPOTrainer(cfg, run_dir=tmp_path / "run", registry=registry)
    steps = []
    try:
        trainer.setup()
        trainer.train(on_step=lambda step, metrics: steps.append(dict(metrics)))
    finally:
        trainer.shutdown()
    assert [m["generation/weight_version"] for m in steps] == [0.0, 1.0, 2.0]
    for m in steps[1:]:
        assert abs(m["token_mult_prob_error"] - 1) < 1e-3, m["token_mult_prob_error"]


class VLLMPeerStub(RefitClient):
    """Test-only: an engine whose workers would build vLLM's kind of group (Dynamo's)."""

    broadcast_peer = "vllm"

    def join_broadcast(self, **kwargs):
        pass  # nothing to reach: rank 0 fails first


@pytest.mark.skipif(__import__("importlib").util.find_spec("vllm") is not None, reason="vllm is installed here")
def test_an_engine_with_vllms_kind_of_group_needs_vllm_on_the_trainer(context):
    sync = CollectiveWeightSync(CollectiveWeightSyncConfig(timeout_s=30), context)
    start = time.monotonic()
    with pytest.raises(Exception, match=r"rank 0 needs vllm installed: pip install 'grpo-sdk\[vllm\]'"):
        sync.sync_weights(perturbed_policy(context, 5, 0.01), VLLMPeerStub("http://127.0.0.1:9"), version=1)
    assert time.monotonic() - start < 10
    sync.shutdown()


def test_an_unknown_kind_of_group_is_refused(context):
    stub = VLLMPeerStub("http://127.0.0.1:9")
    stub.broadcast_peer = "mpi"
    sync = CollectiveWeightSync(CollectiveWeightSyncConfig(timeout_s=30), context)
    with pytest.raises(ValueError, match="broadcast_peer must be one of torch, vllm, got 'mpi'"):
        sync.sync_weights(perturbed_policy(context, 6, 0.01), stub, version=1)
    sync.shutdown()


@pytest.mark.parametrize("backend", ["sglang", "trtllm"])
def test_a_server_mode_drives_one_server_from_one_generation_worker(registry, backend):
    from helpers import config_problems

    found = config_problems(registry, "cluster.runtime=ray", "cluster.generation_workers=2",
                            f"policy.generation.backend={backend}", f"policy.generation.{backend}.mode=server",
                            f"policy.generation.{backend}.url=http://127.0.0.1:9")
    assert "every generation worker would drive the same server" in found["cluster.generation_workers"]
