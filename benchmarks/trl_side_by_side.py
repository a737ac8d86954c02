"""Side-by-side step time of TRL's GRPOTrainer and grpo-sdk, and grpo-sdk's sampler vs a bare loop.

One process, one thread, the same tiny model for everything:

* a 2-layer Llama (d_model 128, ~427k parameters) with a locally trained ByteLevel BPE tokenizer
  (vocab 384), built into a temp dir (no hub access: HF_HUB_OFFLINE=1);
* 8 prompts x 4 generations per step, 32 new tokens, temperature 1.0, no KL (beta 0), lr 1e-4,
  reward ``c.count("cat") - 0.01 * len(c)``;
* TRL: ``GRPOTrainer`` with HF ``generate`` rollouts (``use_vllm=False``), each step timed by a
  ``TrainerCallback`` (on_step_begin .. on_step_end). It runs twice: with TRL's defaults (they turn
  gradient checkpointing on; this is the setup that measured 0.16 s/step) and with it off;
* grpo-sdk: ``GRPOTrainer`` on the same model dir and prompts, the reward as an in-process
  environment registered through the ``grpo_components`` hook, each ``train_step()`` timed;
* a bare hand-written GRPO step (sample with a KV cache, reward, group-normalise, one fwd/bwd,
  AdamW) as the floor for this model;
* generation alone: a bare KV-cache sampling loop vs ``HFGeneration.generate`` on the same model
  object and the same 32 left-padded prompts, 32 decode steps each (tokens/s counts rows x decode
  steps; the run checks that neither side stopped early).

The machine is shared, so the trainers are interleaved: after each TRL step (outside its timed
window) grpo-sdk and the bare loop each take one step, and all three see the same load. Step times
are medians after dropping the warm-up steps. Run from the repo root (bench venv)::

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 .venv-bench/bin/python benchmarks/trl_side_by_side.py --steps 20

The model, the reward environment, both trainers and the bare loop come from ``_common.py``
(shared with ``scale.py``). grpo-sdk's recipe turns validation off (no validation set; TRL
validates nothing either).

Targets (the benchmark issue): grpo-sdk s/step <= 0.6 x TRL's; bare-loop tok/s / grpo-sdk tok/s <= 1.2.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import warnings
from pathlib import Path

from _common import (  # also sets one torch thread and the offline hub, before torch is imported
    BareGRPO,
    bare_sample,
    build_model,
    build_sdk,
    build_trl,
    cat_reward,
    median_after,
    sdk_step,
)

import torch  # noqa: E402  (after _common: one thread)

P, G, NEW_TOKENS, LR = 8, 4, 32, 1e-4


def make_sdk(model_dir: Path, work: Path, steps: int, compile_decode: bool = False):
    name = "sdk-compiled" if compile_decode else "sdk"
    trainer = build_sdk(model_dir, work, name=name, steps=steps, prompts=P, generations=G, new_tokens=NEW_TOKENS,
                        lr=LR, environment="cat_count", compile_decode=compile_decode)
    if compile_decode:  # compile before timing: a one-time cost per (rows, prompt width) shape
        start = time.perf_counter()
        sdk_step(trainer)
        trainer.state.step -= 1
        print(f"grpo-sdk with policy.generation.hf.compile=true: compile warm-up step {time.perf_counter() - start:.1f} s")
    return trainer


def run_trl(model_dir: Path, work: Path, steps: int, gradient_checkpointing: bool, between_steps):
    from transformers import TrainerCallback

    class Timer(TrainerCallback):
        def __init__(self):
            self.times: list[float] = []

        def on_step_begin(self, args, state, control, **kw):
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.times.append(time.perf_counter() - self.t)
            between_steps()  # outside TRL's timed window

    timer = Timer()
    trainer = build_trl(model_dir, work, steps=steps, prompts=P, generations=G, new_tokens=NEW_TOKENS, lr=LR,
                        reward=cat_reward, gradient_checkpointing=gradient_checkpointing, callbacks=[timer])
    trainer.train()
    lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    return timer.times, statistics.mean(lengths)


def bench_generation(trainer, reps: int, warmup: int) -> tuple[float, float]:
    """tokens/s of the bare loop and of HFGeneration.generate, interleaved, same model and inputs."""
    from grpo_sdk.core.records import GenerationInput, SamplingParams
    from grpo_sdk.plugins.tensors import left_pad
    from grpo_sdk.rollouts.rollout import tokenize_prompts

    gen = trainer.components.generation
    ids = tokenize_prompts(trainer.components.tokenizer, trainer.components.prompts.next_prompts(P), trainer.components.max_prompt_tokens)
    input_ids, attention_mask = left_pad([row for row in ids for _ in range(G)], trainer.components.tokenizer.pad_token_id)
    sampling = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0)
    generator = torch.Generator().manual_seed(0)
    tokens = input_ids.shape[0] * NEW_TOKENS
    bare, sdk = [], []
    for _ in range(warmup + reps):
        start = time.perf_counter()
        out = bare_sample(gen.model, input_ids, attention_mask, NEW_TOKENS, generator, gen.cache_arg)
        bare.append(tokens / (time.perf_counter() - start))
        assert out.shape[1] == NEW_TOKENS
        start = time.perf_counter()
        result = gen.generate(GenerationInput(input_ids=input_ids, attention_mask=attention_mask), sampling)
        sdk.append(tokens / (time.perf_counter() - start))
        assert result.response_ids.shape[1] == NEW_TOKENS, "every row stopped early: the loop ran short"
    return statistics.median(bare[warmup:]), statistics.median(sdk[warmup:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="training steps per TRL run (two TRL runs)")
    parser.add_argument("--warmup", type=int, default=3, help="leading steps dropped before taking medians")
    parser.add_argument("--gen-reps", type=int, default=10, help="timed generation calls per side")
    parser.add_argument("--no-compile", action="store_true", help="skip grpo-sdk with policy.generation.hf.compile")
    args = parser.parse_args()
    import transformers
    import trl

    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' gradient_checkpointing renames
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    transformers.utils.logging.disable_progress_bar()
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}, "
          f"threads {torch.get_num_threads()}, OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}, "
          f"load avg {os.getloadavg()[0]:.2f}")
    variants = {"grpo-sdk": False} if args.no_compile else {"grpo-sdk": False, "grpo-sdk, compiled decode": True}
    with tempfile.TemporaryDirectory(prefix="grpo-bench-") as tmp:
        work = Path(tmp)
        build_model(work / "model")
        trainers = {name: make_sdk(work / "model", work, 2 * args.steps, compiled)
                    for name, compiled in variants.items()}
        bare = BareGRPO(work / "model", prompts=P, generations=G, new_tokens=NEW_TOKENS, lr=LR, reward=cat_reward)
        runs = {}
        for label, gc in (("TRL defaults (grad ckpt on)", True), ("TRL, grad ckpt off", False)):
            history: dict[str, list] = {name: [] for name in trainers}
            bare_times: list[float] = []

            def between_steps(history=history, bare_times=bare_times):
                for name, trainer in trainers.items():
                    history[name].append(sdk_step(trainer))
                bare_times.append(bare.step())

            trl_times, trl_length = run_trl(work / "model", work, args.steps, gc, between_steps)
            runs[label] = (trl_times, trl_length, history, bare_times)
        generation = {name: bench_generation(trainer, args.gen_reps, warmup=2) for name, trainer in trainers.items()}
        threads = torch.get_num_threads()

    w = args.warmup
    print(f"\nthreads at the end: {threads}; load avg {os.getloadavg()[0]:.2f}; {args.steps} steps per window, "
          f"medians after dropping {w} warm-up steps")
    rows = []
    for label, (trl_times, trl_length, history, bare_times) in runs.items():
        trl_s, bare_s = median_after(trl_times, w), median_after(bare_times, w)
        print(f"\n[{label}]\n  TRL      s/step: {[round(t, 3) for t in trl_times]}")
        print(f"  bare     s/step: {[round(t, 3) for t in bare_times]}")
        rows.append((f"{label}", f"{trl_s:.4f} s/step", ""))
        for name, hist in history.items():
            sdk_s = median_after([h["wall"] for h in hist], w)
            print(f"  {name} s/step: {[round(h['wall'], 3) for h in hist]}")
            print(f"  {name} phases (median s): " + "  ".join(
                f"{phase} {median_after([h[f'timing/{phase}'] for h in hist], w):.4f}"
                for phase in ("rollout", "logprobs", "train", "weight_sync", "step")))
            print(f"  {name} mean response length {statistics.mean(h['response_length/mean'] for h in hist):.1f}"
                  f" tokens (TRL {trl_length:.1f})")
            ratio = sdk_s / trl_s
            rows += [(f"  {name}, same window", f"{sdk_s:.4f} s/step", ""),
                     (f"  ratio {name} / TRL (target <= 0.6)", f"{ratio:.3f}", "MET" if ratio <= 0.6 else "MISSED")]
        rows += [("  bare GRPO step, same window", f"{bare_s:.4f} s/step", ""),
                 ("  ratio bare / TRL", f"{bare_s / trl_s:.3f}", "")]
    for name, (bare_tps, sdk_tps) in generation.items():
        gen_ratio = bare_tps / sdk_tps
        rows += [(f"bare KV-cache sampling loop (vs {name})", f"{bare_tps:,.0f} tok/s", ""),
                 (f"{name} HFGeneration.generate", f"{sdk_tps:,.0f} tok/s", ""),
                 ("  ratio bare / grpo-sdk (target <= 1.2)", f"{gen_ratio:.3f}", "MET" if gen_ratio <= 1.2 else "MISSED")]
    width = max(len(r[0]) for r in rows)
    print()
    for name, value, verdict in rows:
        print(f"{name:<{width}}  {value:>16}  {verdict}")


if __name__ == "__main__":
    main()
