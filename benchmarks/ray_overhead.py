"""The overhead the Ray runtime adds on one machine: step time and tokens/s against the in-process runtime.

One driver process, the built-in recipe (a 2-layer GPT-2 of ~106k parameters learning to reverse
5 digits; 8 prompts x 16 generations = 128 rows per step, 5 new tokens), validation and
checkpoints off, the same seed everywhere. Variants:

* ``in-process``: ``cluster.runtime=local`` (weight sync ``inprocess``), the baseline;
* ``ray pP gG <transport>``: ``cluster.runtime=ray`` with P policy ranks (FSDP2 when P = 2), G
  generation replicas, one environment actor, colocated (the default), and the weight-sync
  transport ``disk``, ``collective`` or ``inprocess`` (through the driver and the object store).

All variants are built first and then interleaved: each round, every variant takes one step, so
all see the same load on a shared machine. After ``--warmup`` rounds, ``--steps`` rounds are
timed. Printed per variant: median step time, tokens/s (generated tokens / step time, over the
timed steps), median per-phase times (``timing/rollout``, ``logprobs``, ``train``, ``weight_sync``)
and the step-time ratio to in-process. One thread everywhere: ``OMP_NUM_THREADS=1`` is set before
torch is imported, ``cluster.num_threads=1``, and the Ray workers get ``OMP_NUM_THREADS=1``.

Run from the repo root::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/ray_overhead.py --steps 30 --warmup 3

Results: docs/distributed.md ("Overhead").
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # must precede `import torch`
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a private local cluster

import torch  # noqa: E402

torch.set_num_threads(1)

PHASES = ("rollout", "logprobs", "train", "weight_sync")
BASE = ["grpo.val_period=0", "grpo.val_at_end=false", "checkpointing.enabled=false", "logger.loggers=[]",
        "cluster.num_threads=1"]
VARIANTS = {
    "in-process": [],
    "ray p1 g1 inprocess": ["cluster.runtime=ray"],
    "ray p1 g1 disk": ["cluster.runtime=ray", "weight_sync.backend=disk"],
    "ray p1 g1 collective": ["cluster.runtime=ray", "weight_sync.backend=collective"],
    "ray p2 g1 disk": ["cluster.runtime=ray", "cluster.policy_workers=2", "weight_sync.backend=disk"],
    "ray p2 g1 collective": ["cluster.runtime=ray", "cluster.policy_workers=2", "weight_sync.backend=collective"],
}


def start_ray(variants: dict[str, list[str]]) -> None:
    """One local cluster for every variant (the runtime uses a cluster that is already up)."""
    import ray

    actors = sum(1 + o.count("cluster.policy_workers=2") + 1 + 1 for name, o in variants.items() if "ray" in name)
    ray.init(num_cpus=max(actors, os.cpu_count() or 1), object_store_memory=512 << 20, include_dashboard=False,
             logging_level=logging.WARNING,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
                                       "HF_HUB_DISABLE_PROGRESS_BARS": "1"}})


def build(name: str, overrides: list[str], work: Path, steps: int):
    from grpo_sdk.config.loading import load_config
    from grpo_sdk.trainer.trainer import GRPOTrainer
    from grpo_sdk.plugins.registry import Registry

    registry = Registry.discover()
    cfg = load_config(None, [*BASE, f"grpo.max_num_steps={steps}", *overrides], registry)
    trainer = GRPOTrainer(cfg, run_dir=work / name.replace(" ", "_"), registry=registry)
    start = time.perf_counter()
    trainer.setup()
    print(f"  {name}: set up in {time.perf_counter() - start:.1f} s", flush=True)
    return trainer


def step(trainer) -> dict[str, float]:
    start = time.perf_counter()
    metrics, _ = trainer.train_step()
    trainer.state.step += 1
    return {**metrics, "wall": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per variant first")
    parser.add_argument("--only", nargs="*", default=None, help="variants to run (in-process always runs)")
    args = parser.parse_args()
    import ray

    variants = {k: v for k, v in VARIANTS.items() if args.only is None or k == "in-process" or k in args.only}
    print(f"torch {torch.__version__}, ray {ray.__version__}, threads {torch.get_num_threads()}, "
          f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}, cpus {os.cpu_count()}, "
          f"load avg {os.getloadavg()[0]:.2f}", flush=True)
    start_ray(variants)
    history: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
    trainers = {}
    setup_sync = {}
    try:
        with tempfile.TemporaryDirectory(prefix="grpo-ray-overhead-") as tmp:
            print("building:", flush=True)
            for name, overrides in variants.items():
                trainers[name] = build(name, overrides, Path(tmp), args.warmup + args.steps)
            for round_ in range(args.warmup + args.steps):
                for name, trainer in trainers.items():
                    metrics = step(trainer)
                    if round_ >= args.warmup:
                        history[name].append(metrics)
                    elif round_ == 0 and hasattr(trainer.components.weight_sync, "setup_seconds"):
                        setup_sync[name] = trainer.components.weight_sync.setup_seconds
                if round_ + 1 == args.warmup or (round_ + 1 - args.warmup) % 10 == 0:
                    print(f"  round {round_ + 1}/{args.warmup + args.steps}, load avg {os.getloadavg()[0]:.2f}",
                          flush=True)
    finally:
        for trainer in trainers.values():
            trainer.shutdown()
        ray.shutdown()

    base = statistics.median(h["wall"] for h in history["in-process"])
    print(f"\n{args.steps} timed steps per variant after {args.warmup} warm-up steps, interleaved; medians; "
          f"load avg at the end {os.getloadavg()[0]:.2f}")
    header = (f"{'variant':<22} {'s/step':>8} {'tokens/s':>9} {'x in-proc':>9}  "
              + " ".join(f"{p:>11}" for p in PHASES))
    print(header)
    print("-" * len(header))
    for name, hist in history.items():
        wall = statistics.median(h["wall"] for h in hist)
        tokens = sum(h["generated_tokens"] for h in hist) / sum(h["wall"] for h in hist)
        phases = " ".join(f"{statistics.median(h[f'timing/{p}'] for h in hist) * 1e3:>9.1f}ms" for p in PHASES)
        print(f"{name:<22} {wall:>8.4f} {tokens:>9,.0f} {wall / base:>9.2f}  {phases}")
    if setup_sync:
        print("\nfirst sync of the collective transport (plan + group), included in warm-up: "
              + ", ".join(f"{name} {seconds * 1e3:.0f} ms" for name, seconds in setup_sync.items()))
    same = all(h["generated_tokens"] == history["in-process"][i]["generated_tokens"]
               for hist in history.values() for i, h in enumerate(hist))
    print(f"every variant generated the same tokens per step as in-process: {same}")


if __name__ == "__main__":
    main()
