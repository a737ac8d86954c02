"""Where the embedded (hf) sampler's rollout time goes: the "before" of issue 35.

Builds a recipe's trainer (default: recipes/smollm2-arithmetic.yaml, the real SmolLM2-135M-Instruct),
collects ``--rounds`` steps' rollouts with it, and prints per round:

* the rows' generated lengths, the longest, and the **decode waste**: the share of row-steps the
  loop decoded for rows that had already finished (``1 - sum(lengths) / (rows x longest)``; today
  every row decodes until the longest one ends);
* prefill and decode forward time (the model), the rest of the rollout (sampling, bookkeeping,
  tokenizing, scoring), and generated tokens/s.

    OMP_NUM_THREADS=1 taskset -c 0 python benchmarks/sampler_waste.py --rounds 3
    python benchmarks/sampler_waste.py -c recipes/tiny_reverse.yaml ...   # another recipe
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-c", "--config", default=str(ROOT / "recipes" / "smollm2-arithmetic.yaml"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. policy.generation.max_new_tokens=256")
    args = parser.parse_args()

    from grpo_sdk.config.loading import load_config
    from grpo_sdk.core.errors import GrpoSdkError
    from grpo_sdk.plugins.registry import Registry
    from grpo_sdk.trainer.trainer import GRPOTrainer

    registry = Registry.discover()
    overrides = ["grpo.val_at_start=false", "grpo.val_period=0", "checkpointing.enabled=false", "logger.loggers=[]",
                 *args.overrides]
    try:
        cfg = load_config([args.config], overrides, registry)
    except GrpoSdkError as exc:
        print(f"sampler_waste.py: {exc}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = GRPOTrainer(cfg, run_dir=run_dir, registry=registry)
        trainer.setup()
        try:
            generation = trainer.components.generation
            forward, calls = generation._forward, []

            def timed(**kwargs):
                tick = time.perf_counter()
                out = forward(**kwargs)
                calls.append((kwargs["input_ids"].shape, time.perf_counter() - tick))
                return out

            generation._forward = timed
            print(f"model {cfg.policy.model_name}, {cfg.grpo.num_prompts_per_step} prompts x "
                  f"{cfg.grpo.num_generations_per_prompt} samples, max_new_tokens {cfg.policy.generation.max_new_tokens}, "
                  f"policy backend {cfg.policy.backend}", flush=True)
            for r in range(args.rounds):
                calls.clear()
                tick = time.perf_counter()
                rollouts, _ = trainer.collect_rollouts()
                wall = time.perf_counter() - tick
                trainer.state.step += 1
                lengths = rollouts.generated_lengths.tolist()
                rows, longest = len(lengths), max(lengths)
                prefill = sum(s for shape, s in calls if shape[1] > 1)
                decode = sum(s for shape, s in calls if shape[1] == 1)
                steps = sum(1 for shape, _ in calls if shape[1] == 1)
                print(f"round {r + 1}: rows {rows}, lengths median {statistics.median(lengths):.0f} longest {longest}, "
                      f"decode waste {1 - sum(lengths) / (rows * longest):.2f}; wall {wall:.2f} s = prefill "
                      f"{prefill:.2f} + decode forwards {decode:.2f} ({steps} steps, {1000 * decode / max(steps, 1):.1f} "
                      f"ms each) + other {wall - prefill - decode:.2f}; {sum(lengths) / wall:.1f} generated tokens/s",
                      flush=True)
        finally:
            trainer.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
