"""GPU check of the TensorRT-LLM backend against a REAL TensorRT-LLM: run on a machine with an NVIDIA GPU
and ``tensorrt-llm`` installed from NVIDIA's index. NOT YET RUN (written 2026-12 against TensorRT-LLM
main as stored in the index: ``llmapi/rlhf_utils.py`` 04762f3b, ``serve/openai_server.py`` e7f7345e;
the CPU tests use a stand-in trtllm-serve and a FAKE module, see docs/trtllm.md)::

    pip install -e '.[trtllm]' --extra-index-url https://pypi.nvidia.com
    python benchmarks/gpu/check_trtllm.py            # ~10 minutes: one engine start per run

A tiny Llama built locally (check_vllm.build_llama, no model hub) trains 5 GRPO steps with the hf
policy on CUDA and TensorRT-LLM generating, once per path. Each run must keep the generation and
policy logprobs together (token_mult_prob_error within 2e-3 of 1 at every step: this is what shows
LogprobMode.PROCESSED reaches the engine) and sample with the last synced weights
(generation/weight_version 0..4); each prints its step time:

1. engine mode, ``inprocess``: CUDA tensors as IPC handles through upstream's
   ``WorkerExtension.update_weights`` + the finalising call;
2. engine mode, ``disk``: the ``load_file`` command of grpo-sdk's worker extension;
3. engine mode, ``collective`` (gloo: one GPU cannot hold two NCCL ranks): the extension joins the
   transport's group and receives every tensor;
4. engine mode, colocated sleep/wake (``enable_sleep``: ``llm.release`` / ``llm.resume`` around training);
5. engine mode, async GRPO one step off (draining refits); an in-flight update is refused by the
   config check (exit 2), checked too;
6. server mode: ``trtllm-serve`` started with grpo-sdk's extension (``--extra_llm_api_options``),
   ``inprocess`` (IPC handles over ``/update_weights``) and ``disk``.

One PASS/FAIL line per check; exits non-zero on a failure. ``TRTLLM_CHECK_SERVE`` replaces the
server command's prefix (default ``trtllm-serve serve``), ``TRTLLM_CHECK_SERVE_ARGS`` adds arguments.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from check_vllm import build_llama, check  # noqa: E402 - the same tiny Llama and report lines
from grpo_runs import check_run, grpo_run, start_server  # noqa: E402 - the GRPO-run check the engine checks share

SERVER_START_S = 900
EXTENSION = "grpo_sdk.backends.trtllm.worker_extension.GrpoWorkerExtension"


def launch_server(model: Path, tmp: Path) -> tuple[subprocess.Popen, str]:
    from grpo_sdk.plugins.toolkit import free_port

    port = free_port()
    options = tmp / "extra_llm_api_options.yaml"
    options.write_text(f"orchestrator_type: ray\nray_worker_extension_cls: {EXTENSION}\nenable_sleep: true\n"
                       "kv_cache_config:\n  free_gpu_memory_fraction: 0.3\n")
    prefix = shlex.split(os.environ.get("TRTLLM_CHECK_SERVE", "trtllm-serve serve"))
    args = [*prefix, str(model), "--host", "127.0.0.1", "--port", str(port), "--backend", "pytorch",
            "--extra_llm_api_options", str(options), *shlex.split(os.environ.get("TRTLLM_CHECK_SERVE_ARGS", ""))]
    url = f"http://127.0.0.1:{port}"
    process = start_server(args, tmp / "server.log", url + "/health", name=" ".join(prefix), timeout_s=SERVER_START_S)
    return process, url


def main() -> int:
    import torch

    failures: list[str] = []
    assert torch.cuda.is_available(), "this check needs a CUDA device"
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = build_llama(tmp / "llama")
        base = [f"policy.model_name={model}", "cluster.device=cuda", "grpo.val_period=0",
                "policy.max_total_sequence_length=64", "policy.generation.backend=trtllm",
                "policy.generation.trtllm.precision=float32", "policy.generation.trtllm.gpu_memory_utilization=0.3"]
        engine = [*base, "policy.generation.trtllm.mode=engine"]
        runs = [("engine, inprocess (CUDA IPC handles)", ["weight_sync.backend=inprocess"]),
                ("engine, disk (load_file command)", ["weight_sync.backend=disk"]),
                ("engine, collective (extension joins the group, gloo)",
                 ["weight_sync.backend=collective", "weight_sync.collective.backend=gloo"]),
                ("engine, colocated sleep/wake", ["policy.generation.colocated.enabled=true",
                                                  "policy.generation.trtllm.enable_sleep=true"]),
                ("engine, async GRPO one step off (draining refits)",
                 ["grpo.async_grpo.enabled=true", "grpo.async_grpo.max_trajectory_age_steps=1"])]
        for i, (label, extra) in enumerate(runs):
            check_run(label, tmp / f"run{i}", engine, extra, failures)
        refused, _ = grpo_run(tmp / "refused", engine, ["grpo.async_grpo.enabled=true",
                                                        "grpo.async_grpo.schedule=newest",
                                                        "grpo.async_grpo.in_flight_weight_updates=true"])
        check("in-flight update refused by the config check", refused.returncode == 2, f"exit {refused.returncode}",
              failures)
        # One fresh server per run: trtllm-serve keeps no weight version, so a reused one would start
        # the next run with the last run's weights.
        for i, (label, transport) in enumerate([("server, inprocess (IPC handles over /update_weights)", "inprocess"),
                                                ("server, disk (load_file over /update_weights)", "disk")]):
            try:
                process, url = launch_server(model, tmp)
            except RuntimeError as exc:
                check(label, False, str(exc), failures)
                continue
            try:
                server = [*base, "policy.generation.trtllm.mode=server", f"policy.generation.trtllm.url={url}"]
                check_run(label, tmp / f"server{i}", server, [f"weight_sync.backend={transport}"], failures)
            finally:
                process.terminate()
                process.wait(60)
    print(f"\n{len(failures)} failed" if failures else "\nall checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
