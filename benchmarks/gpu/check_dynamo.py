"""GPU check of the dynamo backend against a REAL Dynamo deployment. NOT YET RUN (written 2026-12
against ai-dynamo 1.3.0.post1 with its pinned vLLM 0.23.0, the pair NeMo-RL uses; the CPU tests
use a stand-in, see docs/dynamo.md). Dynamo wants Python 3.12 and its own vLLM, so give it its own
environment and point the check at that interpreter::

    python3.12 -m venv /opt/dynamo_venv && /opt/dynamo_venv/bin/pip install 'ai-dynamo[vllm]==1.3.0.post1'
    pip install -e .   # grpo-sdk, in this environment (torch with CUDA)
    python benchmarks/gpu/check_dynamo.py --dynamo-python /opt/dynamo_venv/bin/python     # a few minutes

It starts a one-worker deployment on GPU 0 without etcd or NATS (``--discovery-backend file``,
``--request-plane tcp``, ``--event-plane zmq``), the worker with ``--enable-rl`` and
``--weight-transfer-config '{"backend": "nccl"}'``, a tiny Llama built locally (no model hub), then:

1. logprob agreement: the backend's generation (token ids in, processed logprobs out) against the
   hf policy on CUDA, token_mult_prob_error within 2e-3 of 1, at temperature 1 and with
   top-k/top-p; and the generation time of 64 rows x 48 tokens;
2. drain pause/resume: a running generate finishes before ``pause_generation`` returns, a new one
   waits until ``resume_generation``; ``keep_in_flight=True`` is refused (the seed's rule);
3. refit (needs 2 GPUs: NCCL cannot put the trainer's rank and the worker's on one GPU): rank 0 is
   vLLM's own ``NCCLWeightTransferEngine.trainer_init`` on GPU 1 (run by --dynamo-python, which
   has vLLM), the worker joins through the backend's ``join_broadcast`` and receives perturbed
   weights through ``receive_broadcast``; generation then agrees with the perturbed hf policy and
   the worker reports the version. This checks the backend's routes, not grpo-sdk's transport;
4. 5 GRPO steps with ``weight_sync.backend=collective`` (2 GPUs): the transport's rank 0 plays
   vLLM's peer (``StatelessProcessGroup`` + ``PyNcclCommunicator``, the backend's
   ``broadcast_peer = "vllm"``), so this environment needs vllm installed too, the deployment's
   version (``pip install vllm==0.23.0`` for ai-dynamo 1.3.0.post1); SKIP without it.

Colocated sleep/wake is not checked: the backend refuses colocation (the seed does too). One
PASS/FAIL/SKIP line per check; exits non-zero on a failure.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from check_vllm import build_llama, check  # noqa: E402 - the same tiny Llama and report lines

START_S = 600


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_deployment(python: str, model: Path, tmp: Path) -> tuple[list[subprocess.Popen], str, str]:
    """Frontend + one worker on GPU 0; returns (processes, frontend URL, worker system URL)."""
    http, system = free_port(), free_port()
    env = {**os.environ, "DYN_FILE_KV": str(tmp / "kv"), "CUDA_VISIBLE_DEVICES": "0"}
    planes = ["--discovery-backend", "file", "--request-plane", "tcp", "--event-plane", "zmq"]
    frontend = subprocess.Popen([python, "-m", "dynamo.frontend", "--http-host", "127.0.0.1", "--http-port", str(http),
                                 *planes], env=env, stdout=(tmp / "frontend.log").open("w"), stderr=subprocess.STDOUT)
    worker = subprocess.Popen([python, "-m", "dynamo.vllm", "--model", str(model), "--served-model-name", "tiny",
                               "--enable-rl", "--weight-transfer-config", '{"backend": "nccl"}', "--dtype", "float32",
                               "--gpu-memory-utilization", "0.2", "--enforce-eager", "--seed", "0", *planes],
                              env={**env, "DYN_SYSTEM_PORT": str(system)}, stdout=(tmp / "worker.log").open("w"),
                              stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{http}/v1"
    deadline = time.time() + START_S
    while time.time() < deadline:
        if frontend.poll() is not None or worker.poll() is not None:
            raise RuntimeError(f"the deployment exited; see {tmp}/frontend.log and {tmp}/worker.log")
        try:
            with urllib.request.urlopen(url + "/models", timeout=5) as reply:
                if any(m.get("id") == "tiny" for m in json.loads(reply.read()).get("data", [])):
                    return [frontend, worker], url, f"http://127.0.0.1:{system}"
        except OSError:
            pass
        time.sleep(2)
    raise RuntimeError(f"the frontend did not serve the model within {START_S} s")


def components(model: Path, frontend: str, worker: str, device: str = "cuda"):
    """The backend, the tokenizer, and ``policy_for(sampling)``: an hf policy whose logprobs apply the
    same temperature, top-k and top-p (what the loss compares generation logprobs with)."""
    from grpo_sdk.backends.dynamo.config import DynamoConfig
    from grpo_sdk.backends.dynamo.generation import DynamoGeneration
    from grpo_sdk.backends.hf.policy import HFPolicy
    from grpo_sdk.config.loading import load_config
    from grpo_sdk.config.context import RunContext
    from grpo_sdk.plugins.registry import Registry
    from grpo_sdk.plugins.toolkit import load_tokenizer

    tokenizer = load_tokenizer(str(model))
    registry = Registry.discover()

    def context_for(sampling=None) -> RunContext:
        overrides = [f"policy.model_name={model}", f"cluster.device={device}"]
        if sampling is not None:
            overrides += [f"policy.generation.temperature={sampling.temperature}",
                          f"policy.generation.top_p={sampling.top_p}", f"policy.generation.top_k={sampling.top_k or 0}"]
        return RunContext(config=load_config(None, overrides, registry), run_dir=model, model_path=str(model),
                          tokenizer_path=str(model), device=device, seed=0, needs_reference=False,
                          eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)

    generation = DynamoGeneration(DynamoConfig(frontend_url=frontend, worker_urls=[worker], model_name="tiny"),
                                  context_for())
    return generation, tokenizer, lambda sampling: HFPolicy(None, context_for(sampling))


def mult_prob_error(generation, policy, tokenizer, sampling, rows: int = 16) -> float:
    import torch

    from grpo_sdk.core.records import GenerationInput, TrainBatch

    ids = [tokenizer(f"{i * 7919 % 100000:05d}>")["input_ids"] for i in range(rows)]
    width = max(map(len, ids))
    inputs = GenerationInput(input_ids=torch.tensor([[tokenizer.pad_token_id] * (width - len(r)) + r for r in ids]),
                             attention_mask=torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in ids]))
    out = generation.generate(inputs, sampling)
    mask = (torch.arange(out.response_ids.shape[1])[None] < out.response_lengths[:, None]).long()
    batch = TrainBatch(input_ids=torch.cat([inputs.input_ids, out.response_ids], 1),
                       attention_mask=torch.cat([inputs.attention_mask, mask], 1),
                       token_mask=torch.cat([torch.zeros_like(inputs.input_ids), mask], 1).float(),
                       sample_mask=torch.ones(rows), generation_logprobs=torch.cat([torch.zeros(inputs.input_ids.shape),
                                                                                    out.logprobs], 1),
                       group_ids=torch.arange(rows), rewards=torch.zeros(rows))
    policy_logprobs = policy.logprobs(batch).float().cpu()
    on = batch.token_mask.bool()  # padding may be -inf under top-k for the policy: keep it out of the sum
    return float((policy_logprobs[on] - batch.generation_logprobs[on]).abs().exp().mean())


RANK0 = textwrap.dedent("""
    import sys, torch
    from safetensors.torch import load_file
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine
    torch.cuda.set_device(0)  # CUDA_VISIBLE_DEVICES=1
    group = NCCLWeightTransferEngine.trainer_init(dict(master_address="127.0.0.1", master_port=int(sys.argv[1]),
                                                       world_size=2))
    weights = load_file(sys.argv[2], device="cuda")
    NCCLWeightTransferEngine.trainer_send_weights(iter(weights.items()), dict(group=group, packed=False))
    torch.cuda.synchronize()
""")


def check_refit(python: str, generation, policy, tokenizer, sampling, tmp: Path, failures: list[str]) -> None:
    import torch
    from safetensors.torch import save_file

    with torch.no_grad():
        for param in policy.model.parameters():
            param.add_(torch.randn_like(param) * 0.02)
    named = [(n, t.detach().contiguous()) for n, t in policy.named_weights()]
    save_file({n: t.cpu() for n, t in named}, str(tmp / "new.safetensors"))
    port = free_port()
    rank0 = subprocess.Popen([python, "-c", RANK0, str(port), str(tmp / "new.safetensors")],
                             env={**os.environ, "CUDA_VISIBLE_DEVICES": "1"})
    start = time.time()
    generation.join_broadcast(master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=2,
                              group_name="unused", backend="nccl")
    spec = [(n, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in named]
    generation.receive_broadcast(spec, group_name="unused", version=1, last=True)
    ok = rank0.wait(timeout=300) == 0
    error = mult_prob_error(generation, policy, tokenizer, sampling)
    check("refit through vLLM's trainer group (NCCL)", ok and abs(error - 1) < 2e-3 and generation.weight_version == 1,
          f"token_mult_prob_error {error:.6f} after the update, version {generation.weight_version}, "
          f"{time.time() - start:.1f} s", failures)


def main() -> int:
    import torch

    from grpo_sdk.plugins import PluginError, SamplingParams

    parser = argparse.ArgumentParser()
    parser.add_argument("--dynamo-python", default=sys.executable)
    args = parser.parse_args()
    assert torch.cuda.is_available(), "this check needs a CUDA device"
    failures: list[str] = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model = build_llama(tmp / "llama")
        processes, frontend, worker = start_deployment(args.dynamo_python, model, tmp)
        try:
            generation, tokenizer, policy_for = components(model, frontend, worker)
            plain = SamplingParams(max_new_tokens=32)
            policy = policy_for(plain)
            for label, sampling in [("logprobs, temperature 1", plain),
                                    ("logprobs, top-k/top-p", SamplingParams(max_new_tokens=32, temperature=0.8,
                                                                             top_k=8, top_p=0.9))]:
                error = mult_prob_error(generation, policy_for(sampling), tokenizer, sampling)
                check(label, abs(error - 1) < 2e-3, f"token_mult_prob_error {error:.6f}", failures)
            start = time.time()
            mult_prob_error(generation, policy, tokenizer, SamplingParams(max_new_tokens=48), rows=64)
            print(f"INFO  generation + policy scoring of 64 rows x 48 tokens: {time.time() - start:.2f} s")

            results: dict = {}
            running = threading.Thread(target=lambda: results.update(a=mult_prob_error(
                generation, policy, tokenizer, SamplingParams(max_new_tokens=64))))
            running.start()
            time.sleep(0.1)
            generation.pause_generation(keep_in_flight=False)
            drained = not running.is_alive()
            held = threading.Thread(target=lambda: results.update(b=generation.generate(*_one(tokenizer))))
            held.start()
            time.sleep(1.0)
            waited = held.is_alive()
            generation.resume_generation(recompute_kv_cache=False)
            held.join(timeout=60)
            try:
                generation.pause_generation(keep_in_flight=True)
                refused = False
            except PluginError:
                refused = True
            check("drain pause/resume, in-flight refused", drained and waited and "b" in results and refused,
                  f"drained {drained}, new request held {waited}, resumed {'b' in results}, in-flight refused {refused}",
                  failures)

            if torch.cuda.device_count() >= 2:
                check_refit(args.dynamo_python, generation, policy, tokenizer, plain, tmp, failures)
                run_grpo(model, frontend, worker, tmp, failures)
            else:
                print("SKIP  refit and GRPO steps: NCCL needs a second GPU for the trainer's rank")
        finally:
            for process in processes:
                process.terminate()
            for process in processes:
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    process.kill()
    print(f"\n{len(failures)} failed" if failures else "\nall checks passed")
    return 1 if failures else 0


def _one(tokenizer):
    import torch

    from grpo_sdk.core.records import GenerationInput
    from grpo_sdk.plugins import SamplingParams

    ids = tokenizer("12345>")["input_ids"]
    return (GenerationInput(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long)),
            SamplingParams(max_new_tokens=4))


def run_grpo(model: Path, frontend: str, worker: str, tmp: Path, failures: list[str]) -> None:
    """Module docstring, 4: rank 0 is vLLM's kind of group, so vllm must be importable here."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        print("SKIP  5 GRPO steps, collective transport: rank 0 needs vllm in this environment "
              "(pip install vllm==0.23.0, the deployment's version)")
        return
    run = tmp / "grpo"
    start = time.time()
    result = subprocess.run([sys.executable, "-m", "grpo_sdk.cli.app", "run", "--run-dir", str(run),
                             f"policy.model_name={model}", "grpo.max_num_steps=5", "grpo.val_period=0",
                             "cluster.device=cuda", "cluster.gpus_per_node=1", "policy.generation.backend=dynamo",
                             "policy.generation.colocated.enabled=false", f"policy.generation.dynamo.frontend_url={frontend}",
                             f"policy.generation.dynamo.worker_urls=[{worker}]", "policy.generation.dynamo.model_name=tiny",
                             "weight_sync.backend=collective", "weight_sync.collective.backend=nccl"],
                            capture_output=True, text=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": "1"})
    if result.returncode != 0:
        check("5 GRPO steps, collective transport", False, result.stderr[-1500:], failures)
        return
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    errors = [r["token_mult_prob_error"] for r in rows]
    check("5 GRPO steps, collective transport", max(abs(e - 1) for e in errors) < 2e-3,
          f"token_mult_prob_error {[round(e, 5) for e in errors]}, {(time.time() - start) / 5:.1f} s/step", failures)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
