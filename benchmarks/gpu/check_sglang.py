"""GPU check of the SGLang backend against a REAL SGLang: run on a machine with an NVIDIA GPU and
``sglang`` installed. NOT YET RUN (written 2026-12 against SGLang 0.5.23; the CPU tests use a
stand-in server and a fake module, see docs/sglang.md)::

    pip install -e '.[sglang]'  &&  python benchmarks/gpu/check_sglang.py      # a few minutes

A tiny Llama built locally (no model hub) trains 5 GRPO steps with the hf policy on CUDA and SGLang
generating, once per path; every run must keep generation and policy logprobs together
(token_mult_prob_error within 2e-3 of 1 at every step) and sample with the last synced weights
(generation/weight_version 0..4):

1. server mode, ``inprocess`` transport: CUDA tensors as IPC handles in flattened buckets to
   ``/update_weights_from_tensor`` (the server shares the GPU with the policy);
2. server mode, ``disk`` transport: ``/update_weights_from_disk``;
3. server mode, ``collective`` transport (gloo: one GPU cannot hold two NCCL ranks):
   ``/init_weights_update_group`` + ``/update_weights_from_distributed``;
4. server mode, colocated sleep/wake (``needs_offload``: ``/release_memory_occupation`` /
   ``/resume_memory_occupation`` around every training phase);
5. async GRPO, one step off, twice: refits draining the server, and in-flight updates
   (``/pause_generation`` in_place, the update, ``/continue_generation``; per-token versions from
   ``meta_info.weight_versions``); both must finish their 5 steps (their token_mult_prob_error is
   printed, not bounded: the policy trains on rollouts up to a step stale);
6. engine mode: ``sglang.Engine`` in this process, ``inprocess`` transport.

Each run prints its step time (mean wall seconds per step). One PASS/FAIL line per check; exits
non-zero on a failure. ``SGLANG_CHECK_SERVER_ARGS`` adds launch_server arguments.
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
from grpo_runs import check_run, start_server  # noqa: E402 - the GRPO-run check the engine checks share

ASYNC = ["grpo.async_grpo.enabled=true", "grpo.async_grpo.max_trajectory_age_steps=1",
         "loss_fn.use_importance_sampling_correction=true"]
SERVER_START_S = 600


def launch_server(model: Path, log: Path) -> tuple[subprocess.Popen, str]:
    from grpo_sdk.plugins.toolkit import free_port

    port = free_port()
    args = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model), "--host", "127.0.0.1",
            "--port", str(port), "--skip-tokenizer-init", "--enable-memory-saver", "--dtype", "float32",
            "--mem-fraction-static", "0.3", "--random-seed", "0",
            *shlex.split(os.environ.get("SGLANG_CHECK_SERVER_ARGS", ""))]
    url = f"http://127.0.0.1:{port}"
    process = start_server(args, log, url + "/health_generate", name="sglang.launch_server",
                           timeout_s=SERVER_START_S)
    return process, url


def main() -> int:
    import torch

    failures: list[str] = []
    assert torch.cuda.is_available(), "this check needs a CUDA device"
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = build_llama(tmp / "llama")
        base = [f"policy.model_name={model}", "cluster.device=cuda", "grpo.val_period=0",
                "policy.max_total_sequence_length=64", "policy.generation.backend=sglang"]
        process, url = launch_server(model, tmp / "server.log")
        try:
            server = [*base, f"policy.generation.sglang.url={url}"]
            runs = [("server, inprocess (CUDA IPC buckets)", ["weight_sync.backend=inprocess"]),
                    ("server, disk", ["weight_sync.backend=disk"]),
                    ("server, collective (SGLang's update group, gloo)",
                     ["weight_sync.backend=collective", "weight_sync.collective.backend=gloo"]),
                    ("server, colocated sleep/wake", ["policy.generation.sglang.needs_offload=true"]),
                    ("server, async GRPO one step off (draining refits)", ASYNC),
                    ("server, async GRPO with in-flight updates",
                     [*ASYNC, "grpo.async_grpo.schedule=newest", "grpo.async_grpo.in_flight_weight_updates=true"])]
            for i, (label, extra) in enumerate(runs):
                check_run(label, tmp / f"run{i}", server, extra, failures)
        except RuntimeError as exc:
            check("sglang.launch_server", False, str(exc), failures)
        finally:
            process.terminate()
            process.wait(60)
        check_run("engine mode, inprocess", tmp / "engine", base,
                  ["policy.generation.sglang.mode=engine", "policy.generation.sglang.dtype=float32",
                   "policy.generation.sglang.mem_fraction_static=0.3"], failures)
    print(f"\n{len(failures)} failed" if failures else "\nall checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
