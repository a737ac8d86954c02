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

Targets (the benchmark issue): grpo-sdk s/step <= 0.6 x TRL's; bare-loop tok/s / grpo-sdk tok/s <= 1.2.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
import warnings
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # must precede `import torch`; see docs/benchmarks.md
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

torch.set_num_threads(1)

PROMPTS = ["the cat sat on", "one plus two is", "a red ball", "the dog ran to", "three minus one", "four five",
           "the answer is", "two cat"]
P, G, NEW_TOKENS, LR = 8, 4, 32, 1e-4


def cat_reward(text: str) -> float:
    return text.count("cat") - 0.01 * len(text)


class CatCountEnvironment:
    """The TRL reward function as a grpo-sdk environment."""

    def __init__(self, config, context):
        pass

    def step(self, message_logs, metadata):
        from grpo_sdk.core.records import EnvironmentReturn

        return EnvironmentReturn(rewards={"cat": [cat_reward(log[-1].content) for log in message_logs]})


def build_model(out: Path) -> None:
    """Appendix A of the feasibility study: tiny Llama + locally trained BPE tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    random.seed(0)
    words = ["the", "cat", "sat", "on", "mat", "dog", "ran", "to", "a", "red", "ball", "one", "two", "three", "four",
             "five", "plus", "minus", "is", "answer"]
    corpus = [" ".join(random.choice(words) for _ in range(12)) + " " +
              " ".join(str(random.randint(0, 99)) for _ in range(4)) for _ in range(2000)]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=384, special_tokens=["<pad>", "<s>", "</s>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                        show_progress=False))
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(hf), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512,
                      bos_token_id=hf.bos_token_id, eos_token_id=hf.eos_token_id, pad_token_id=hf.pad_token_id,
                      tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(out)
    hf.save_pretrained(out)


def median_after(times: list[float], warmup: int) -> float:
    return statistics.median(times[warmup:] if len(times) > warmup else times)


def run_trl(model_dir: Path, work: Path, steps: int, gradient_checkpointing: bool, between_steps):
    from datasets import Dataset
    from transformers import AutoTokenizer, ProgressCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    class Timer(TrainerCallback):
        def __init__(self):
            self.times: list[float] = []

        def on_step_begin(self, args, state, control, **kw):
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.times.append(time.perf_counter() - self.t)
            between_steps()  # outside TRL's timed window

    timer = Timer()
    cfg = GRPOConfig(output_dir=str(work / "trl-out"), per_device_train_batch_size=P * G, num_generations=G,
                     gradient_accumulation_steps=1, steps_per_generation=1, max_completion_length=NEW_TOKENS,
                     max_steps=steps, learning_rate=LR, logging_steps=1, use_vllm=False, use_cpu=True, bf16=False,
                     report_to="none", save_strategy="no", beta=0.0, temperature=1.0, seed=0,
                     gradient_checkpointing=gradient_checkpointing)

    def reward(completions, **kw):
        return [cat_reward(c) for c in completions]

    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=reward, args=cfg,
                          train_dataset=Dataset.from_dict({"prompt": PROMPTS * 8}),
                          processing_class=AutoTokenizer.from_pretrained(model_dir), callbacks=[timer])
    trainer.remove_callback(ProgressCallback)  # no progress bar in the output
    torch.set_num_threads(1)
    trainer.train()
    lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    return timer.times, statistics.mean(lengths)


def build_sdk(model_dir: Path, work: Path, steps: int, compile_decode: bool = False):
    import yaml

    from grpo_sdk.core.config_loader import load_config
    from grpo_sdk.trainer.trainer import GRPOTrainer
    from grpo_sdk.plugins import ComponentSpec, hookimpl
    from grpo_sdk.plugins.host import PluginHost
    from grpo_sdk.plugins.registry import Registry

    class BenchComponents:
        @hookimpl
        def grpo_components(self):
            return [ComponentSpec(name="cat_count", kind="environment", impl=f"{__name__}:CatCountEnvironment")]

    host = PluginHost()
    host.register(BenchComponents(), name="bench")
    registry = Registry.discover(host=host)
    data = work / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS * 8))
    recipe = {
        "policy": {"model_name": str(model_dir), "backend": "hf", "train_micro_batch_size": P * G,
                   "logprob_batch_size": P * G, "max_total_sequence_length": 128, "max_grad_norm": 1.0,
                   "optimizer": {"lr": LR, "weight_decay": 0.0},
                   "generation": {"backend": "hf", "max_new_tokens": NEW_TOKENS, "temperature": 1.0,
                                  "hf": {"compile": compile_decode}}},
        "grpo": {"num_prompts_per_step": P, "num_generations_per_prompt": G, "max_num_steps": steps, "seed": 0,
                 "max_num_epochs": 1000},
        "loss_fn": {"reference_policy_kl_penalty": 0.0},
        "data": {"train_path": str(data)},
        "env": {"name": "cat_count"},
        "logger": {"loggers": []},
        "checkpointing": {"enabled": False},
        "cluster": {"device": "cpu", "num_threads": 1},
    }
    name = "sdk-compiled" if compile_decode else "sdk"
    (work / f"{name}.yaml").write_text(yaml.safe_dump(recipe))
    trainer = GRPOTrainer(load_config([str(work / f"{name}.yaml")], [], registry), run_dir=work / f"{name}-run",
                          registry=registry)
    trainer.setup()
    if compile_decode:  # compile before timing: a one-time cost per (rows, prompt width) shape
        start = time.perf_counter()
        sdk_step(trainer)
        trainer.state.step -= 1
        print(f"grpo-sdk with policy.generation.hf.compile=true: compile warm-up step {time.perf_counter() - start:.1f} s")
    return trainer


def sdk_step(trainer) -> dict[str, float]:
    start = time.perf_counter()
    metrics, _ = trainer.train_step()
    trainer.state.step += 1
    return {**metrics, "wall": time.perf_counter() - start}


@torch.inference_mode()
def bare_sample(model, input_ids, attention_mask, new_tokens: int, generator, cache_arg: str) -> torch.Tensor:
    """The floor: prefill, then one forward per token with the KV cache, plain multinomial sampling."""
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=True)
    next_position = positions[:, -1:] + 1
    tokens = []
    for t in range(new_tokens):
        token = torch.multinomial(torch.softmax(out.logits[:, -1].float(), dim=-1), 1, generator=generator)
        tokens.append(token)
        if t + 1 == new_tokens:
            break
        attention_mask = torch.cat([attention_mask, torch.ones_like(token)], dim=1)
        out = model(input_ids=token, attention_mask=attention_mask, position_ids=next_position, use_cache=True,
                    **{cache_arg: getattr(out, cache_arg)})
        next_position = next_position + 1
    return torch.cat(tokens, dim=1)


class BareGRPO:
    """A bare hand-written GRPO step on one model: sample, reward, group-normalise, one fwd/bwd, AdamW."""

    def __init__(self, model_dir: Path, tokenizer, cache_arg: str):
        from transformers import AutoModelForCausalLM

        from grpo_sdk.trainer.rollout import left_pad

        self.model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LR, weight_decay=0.0)
        self.tokenizer, self.cache_arg = tokenizer, cache_arg
        rows = [tokenizer(p)["input_ids"] for p in PROMPTS for _ in range(G)]
        self.input_ids, self.attention_mask = left_pad(rows, tokenizer.pad_token_id)
        self.generator = torch.Generator().manual_seed(0)

    def step(self) -> float:
        start, tok = time.perf_counter(), self.tokenizer
        completion = bare_sample(self.model, self.input_ids, self.attention_mask, NEW_TOKENS, self.generator,
                                 self.cache_arg).clone()
        after_eos = (completion == tok.eos_token_id).long().cumsum(1) - (completion == tok.eos_token_id).long()
        mask = (after_eos == 0).float()  # up to and including the first EOS
        texts = tok.batch_decode(completion.masked_fill(mask == 0, tok.pad_token_id), skip_special_tokens=True)
        rewards = torch.tensor([cat_reward(t) for t in texts]).view(P, G)
        adv = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)).view(-1, 1)
        ids = torch.cat([self.input_ids, completion], 1)
        full_mask = torch.cat([self.attention_mask, mask.long()], 1)
        logits = self.model(input_ids=ids, attention_mask=full_mask, use_cache=False,
                            position_ids=(full_mask.cumsum(-1) - 1).clamp(min=0)).logits
        logits = logits[:, self.input_ids.shape[1] - 1:-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, completion[..., None]).squeeze(-1)
        loss = -((torch.exp(logp - logp.detach()) * adv) * mask).sum() / mask.sum()
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        return time.perf_counter() - start


def bench_generation(trainer, reps: int, warmup: int) -> tuple[float, float]:
    """tokens/s of the bare loop and of HFGeneration.generate, interleaved, same model and inputs."""
    from grpo_sdk.core.records import GenerationInput, SamplingParams
    from grpo_sdk.trainer.rollout import left_pad, tokenize_prompts

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
        trainers = {name: build_sdk(work / "model", work, 2 * args.steps, compiled)
                    for name, compiled in variants.items()}
        eager = trainers["grpo-sdk"]
        bare = BareGRPO(work / "model", eager.tokenizer, eager.generation.cache_arg)
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
