"""What the TRL comparisons share (benchmarks/trl_side_by_side.py, benchmarks/scale.py): the locally
built Llama models and tokenizer, the reward environments, grpo-sdk's trainer on a recipe, TRL's
GRPOTrainer, and a bare hand-written GRPO step (the floor of an eager loop).

Importing this module sets one torch thread and the offline hub, as every benchmark here runs.
"""

from __future__ import annotations

import inspect
import json
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("OMP_NUM_THREADS", "1")  # must precede `import torch`; see docs/benchmarks.md
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

torch.set_num_threads(1)

PROMPTS = ["the cat sat on", "one plus two is", "a red ball", "the dog ran to", "three minus one", "four five",
           "the answer is", "two cat"]
WORDS = ["the", "cat", "sat", "on", "mat", "dog", "ran", "to", "a", "red", "ball", "one", "two", "three", "four",
         "five", "plus", "minus", "is", "answer"]


def cat_reward(text: str) -> float:
    """trl_side_by_side's reward: more "cat", shorter."""
    return text.count("cat") - 0.01 * len(text)


def vowel_reward(text: str) -> float:
    """scale.py's reward: the share of vowels. It varies between samples (so advantages are not all
    zero) and does not depend on the length, so training does not move the length distribution."""
    return sum(c in "aeiou" for c in text) / max(len(text), 1)


class RewardEnvironment:
    """A reward function as a grpo-sdk environment (registered in-process by ``register_environments``)."""

    reward: Callable[[str], float] = staticmethod(cat_reward)

    def __init__(self, config, context):
        pass

    def step(self, message_logs, metadata):
        from grpo_sdk.core.records import EnvironmentReturn

        return EnvironmentReturn(rewards={"reward": [self.reward(log[-1].content) for log in message_logs]})


class CatCountEnvironment(RewardEnvironment):
    reward = staticmethod(cat_reward)


class VowelEnvironment(RewardEnvironment):
    reward = staticmethod(vowel_reward)


ENVIRONMENTS = {"cat_count": CatCountEnvironment, "vowels": VowelEnvironment}


def train_tokenizer():
    """A ByteLevel BPE tokenizer (vocab 384) trained on a word soup: no hub access."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    random.seed(0)
    corpus = [" ".join(random.choice(WORDS) for _ in range(12)) + " " +
              " ".join(str(random.randint(0, 99)) for _ in range(4)) for _ in range(2000)]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=384, special_tokens=["<pad>", "<s>", "</s>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                        show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def build_model(out: Path, *, hidden: int = 128, layers: int = 2, intermediate: int = 256, heads: int = 2,
                eos_probability: float | None = None) -> int:
    """A random-init Llama plus the local tokenizer in ``out``; returns the parameter count.

    ``eos_probability``: make the model emit EOS with that probability at every decode step, whatever
    came before, so response lengths are geometric (a long tail: mean 1/p, p90 ~2.3/p), the same
    for every sampler that samples from the model's softmax at temperature 1 without top-k/top-p.
    How: one residual dimension is a constant in every token's embedding, so after the final norm it
    is a near-constant input to the LM head; only the EOS row reads it, with the weight that puts
    the EOS logit where softmax gives it ``eos_probability`` (calibrated on random sequences).
    """
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    transformers.utils.logging.disable_progress_bar()
    tokenizer = train_tokenizer()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                      max_position_embeddings=1024, bos_token_id=tokenizer.bos_token_id,
                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    if eos_probability is not None:
        set_eos_probability(model, tokenizer.eos_token_id, eos_probability)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


@torch.no_grad()
def set_eos_probability(model, eos_id: int, p: float, tokens: int = 2048) -> float:
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    embed[:, 0] = 1.0  # the constant dimension (the others are ~N(0, 0.02))
    head[:, 0] = 0.0  # nobody else reads it
    ids = torch.randint(3, embed.shape[0], (8, tokens // 8), generator=torch.Generator().manual_seed(0))
    for _ in range(3):  # the EOS logit moves the softmax's normaliser a little: settle it
        hidden = model.model(input_ids=ids).last_hidden_state  # after the final norm
        logits = model.lm_head(hidden)
        others = torch.cat([logits[..., :eos_id], logits[..., eos_id + 1:]], -1).logsumexp(-1)
        # p = e^l / (e^l + e^others)  <=>  l = others + log(p / (1 - p))
        target = others + torch.log(torch.tensor(p / (1 - p)))
        head[eos_id, 0] += ((target - logits[..., eos_id]) / hidden[..., 0]).mean()
    return torch.softmax(model.lm_head(model.model(input_ids=ids).last_hidden_state), -1)[..., eos_id].mean().item()


def median_after(times: list[float], warmup: int) -> float:
    return statistics.median(times[warmup:] if len(times) > warmup else times)


def length_stats(lengths: list[int]) -> dict[str, float]:
    ordered = sorted(lengths)
    return {"mean": statistics.mean(ordered), "median": statistics.median(ordered),
            "p90": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))], "max": ordered[-1]}


# --- grpo-sdk ------------------------------------------------------------------------------------


def build_sdk(model_dir: Path, work: Path, *, name: str, steps: int, prompts: int, generations: int,
              new_tokens: int, lr: float, environment: str = "cat_count", compile_decode: bool = False,
              overrides: list[str] = ()):
    """grpo-sdk's GRPOTrainer on the model, set up; ``overrides`` are `key=value` as on `grpoctl run`."""
    import yaml

    from grpo_sdk.config.loading import load_config
    from grpo_sdk.plugins import ComponentSpec, hookimpl
    from grpo_sdk.plugins.host import PluginHost
    from grpo_sdk.plugins.registry import Registry
    from grpo_sdk.trainer.trainer import GRPOTrainer

    class BenchComponents:
        @hookimpl
        def grpo_components(self):
            return [ComponentSpec(name=env, kind="environment", impl=f"_common:{cls.__name__}")
                    for env, cls in ENVIRONMENTS.items()]

    host = PluginHost()
    host.register(BenchComponents(), name="bench")
    registry = Registry.discover(host=host)
    data = work / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS * 8))
    rows = prompts * generations
    recipe = {
        "policy": {"model_name": str(model_dir), "backend": "hf", "train_micro_batch_size": rows,
                   "logprob_batch_size": rows, "max_total_sequence_length": new_tokens + 32, "max_grad_norm": 1.0,
                   "optimizer": {"lr": lr, "weight_decay": 0.0},
                   "generation": {"backend": "hf", "max_new_tokens": new_tokens, "temperature": 1.0,
                                  "hf": {"compile": compile_decode}}},
        # no validation set here, and TRL validates nothing either: validation off (it is on by default)
        "grpo": {"num_prompts_per_step": prompts, "num_generations_per_prompt": generations,
                 "max_num_steps": steps, "seed": 0, "max_num_epochs": 1000, "val_period": 0, "val_at_end": False},
        "loss_fn": {"reference_policy_kl_penalty": 0.0},
        "data": {"train_path": str(data)},
        "env": {"name": environment},
        "logger": {"loggers": []},
        "checkpointing": {"enabled": False},
        "cluster": {"device": "cpu", "num_threads": 1},
    }
    (work / f"{name}.yaml").write_text(yaml.safe_dump(recipe))
    trainer = GRPOTrainer(load_config([str(work / f"{name}.yaml")], list(overrides), registry),
                          run_dir=work / f"{name}-run", registry=registry)
    trainer.setup()
    return trainer


def sdk_step(trainer) -> dict[str, Any]:
    """One timed ``train_step``: its metrics, ``wall`` seconds and the response ``lengths``."""
    start = time.perf_counter()
    metrics, batch = trainer.train_step()
    wall = time.perf_counter() - start
    trainer.state.step += 1
    # The step record's generated tokens per row: single-turn, each response's length.
    return {**metrics, "wall": wall, "lengths": batch.token_mask.sum(1).long().tolist()}


# --- TRL -----------------------------------------------------------------------------------------


def build_trl(model_dir: Path, work: Path, *, steps: int, prompts: int, generations: int, new_tokens: int,
              lr: float, reward: Callable[[str], float], gradient_checkpointing: bool, callbacks: list):
    """TRL's GRPOTrainer with HF ``generate`` rollouts, one optimizer step per generation batch."""
    from datasets import Dataset
    from transformers import AutoTokenizer, ProgressCallback
    from trl import GRPOConfig, GRPOTrainer

    cfg = GRPOConfig(output_dir=str(work / "trl-out"), per_device_train_batch_size=prompts * generations,
                     num_generations=generations, gradient_accumulation_steps=1, steps_per_generation=1,
                     max_completion_length=new_tokens, max_steps=steps, learning_rate=lr, logging_steps=1,
                     use_vllm=False, use_cpu=True, bf16=False, report_to="none", save_strategy="no", beta=0.0,
                     temperature=1.0, top_k=0, top_p=1.0, seed=0, gradient_checkpointing=gradient_checkpointing)

    def reward_fn(completions, **kw):
        return [reward(c) for c in completions]

    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=reward_fn, args=cfg,
                          train_dataset=Dataset.from_dict({"prompt": PROMPTS * 8}),
                          processing_class=AutoTokenizer.from_pretrained(model_dir), callbacks=callbacks)
    trainer.remove_callback(ProgressCallback)  # no progress bar in the output
    torch.set_num_threads(1)
    return trainer


# --- the bare loop -------------------------------------------------------------------------------


@torch.inference_mode()
def bare_sample(model, input_ids, attention_mask, new_tokens: int, generator, cache_arg: str,
                eos_id: int | None = None) -> torch.Tensor:
    """The floor: prefill, then one forward per token with the KV cache, plain multinomial sampling.
    With ``eos_id``, stops once every row has sampled it (the rows still running decide the width)."""
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=True)
    next_position = positions[:, -1:] + 1
    done = torch.zeros(input_ids.shape[0], dtype=torch.bool)
    tokens = []
    for t in range(new_tokens):
        token = torch.multinomial(torch.softmax(out.logits[:, -1].float(), dim=-1), 1, generator=generator)
        tokens.append(token)
        if eos_id is not None:
            done |= token[:, 0] == eos_id
        if t + 1 == new_tokens or bool(done.all()):
            break
        attention_mask = torch.cat([attention_mask, torch.ones_like(token)], dim=1)
        out = model(input_ids=token, attention_mask=attention_mask, position_ids=next_position, use_cache=True,
                    **{cache_arg: getattr(out, cache_arg)})
        next_position = next_position + 1
    return torch.cat(tokens, dim=1)


class BareGRPO:
    """A bare hand-written GRPO step on one model: sample, reward, group-normalise, one fwd/bwd, AdamW.
    Responses are padded to the batch's longest, as a plain loop does."""

    def __init__(self, model_dir: Path, *, prompts: int, generations: int, new_tokens: int, lr: float,
                 reward: Callable[[str], float], stop_at_eos: bool = False,
                 lengths: list[list[int]] | None = None):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from grpo_sdk.plugins.tensors import left_pad

        self.model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        self.tokenizer = tok = AutoTokenizer.from_pretrained(model_dir)
        # transformers 5 renamed the cache argument of some models' forward
        self.cache_arg = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0)
        self.prompts, self.generations, self.new_tokens, self.reward = prompts, generations, new_tokens, reward
        self.eos_id = tok.eos_token_id if stop_at_eos else None
        # fixed_lengths' table: step k decodes its longest length, each row's EOS placed at its own
        self.fixed = iter(lengths) if lengths is not None else None
        rows = [tok(p)["input_ids"] for p in (PROMPTS * 8)[:prompts] for _ in range(generations)]
        self.input_ids, self.attention_mask = left_pad(rows, tok.pad_token_id)
        self.generator = torch.Generator().manual_seed(0)
        self.lengths: list[int] = []  # of the last step's responses, the EOS included

    def step(self) -> float:
        start, tok = time.perf_counter(), self.tokenizer
        if self.fixed is None:
            completion = bare_sample(self.model, self.input_ids, self.attention_mask, self.new_tokens, self.generator,
                                     self.cache_arg, self.eos_id).clone()
        else:
            lengths = torch.tensor(next(self.fixed))
            completion = bare_sample(self.model, self.input_ids, self.attention_mask, int(lengths.max()),
                                     self.generator, self.cache_arg).clone()
            completion[completion == tok.eos_token_id] = tok.pad_token_id  # no EOS before its place
            completion[torch.arange(len(lengths)), lengths - 1] = tok.eos_token_id
        after_eos = (completion == tok.eos_token_id).long().cumsum(1) - (completion == tok.eos_token_id).long()
        mask = (after_eos == 0).float()  # up to and including the first EOS
        self.lengths = mask.sum(1).long().tolist()
        texts = tok.batch_decode(completion.masked_fill(mask == 0, tok.pad_token_id), skip_special_tokens=True)
        rewards = torch.tensor([self.reward(t) for t in texts]).view(self.prompts, self.generations)
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


# --- fixed lengths (issue 35 item 6): every contender decodes the same per-row lengths ------------------


def fixed_lengths(seed: int, eos_mean: float, cap: int, steps: int, rows: int) -> list[list[int]]:
    """``[steps][rows]`` response lengths (the EOS included), each the position of the first EOS when
    every step emits it with probability 1/``eos_mean`` (the built model's own law), capped at ``cap``;
    drawn once from ``seed``, so every contender's step k decodes the same rows."""
    rng = random.Random(seed)
    table = []
    for _ in range(steps):
        row_lengths = []
        for _ in range(rows):
            n = 1
            while n < cap and rng.random() >= 1 / eos_mean:
                n += 1
            row_lengths.append(n)
        table.append(row_lengths)
    return table


def force_sdk_lengths(trainer, table: list[list[int]], eos_id: int) -> None:
    """grpo-sdk's generation decodes each step's lengths: per-row budgets with EOS ignored, then the
    row's last token made the EOS (so a row ends as the other contenders' rows do: stopped, not truncated).
    Wraps ``generate`` and, where the rollout streams into the backend, ``submit``/``poll`` (one request
    per turn, as with ``env.max_concurrent_calls=0``)."""
    import attrs

    generation = trainer.components.generation
    steps = iter(table)

    def forced(prompts, sampling):
        lengths = torch.tensor(next(steps), dtype=torch.long)
        if len(lengths) != prompts.input_ids.shape[0]:
            raise RuntimeError(f"fixed lengths: {len(lengths)} for {prompts.input_ids.shape[0]} rows")
        if prompts.max_new_tokens is not None:
            lengths = torch.minimum(lengths, prompts.max_new_tokens)
        return attrs.evolve(prompts, max_new_tokens=lengths), attrs.evolve(sampling, ignore_eos=True)

    def ended(out):
        ids = out.response_ids.clone()
        ids[torch.arange(len(ids)), out.response_lengths - 1] = eos_id
        return attrs.evolve(out, response_ids=ids, truncated=torch.zeros_like(out.truncated))

    generate = generation.generate
    generation.generate = lambda prompts, sampling: ended(generate(*forced(prompts, sampling)))
    if hasattr(generation, "submit"):
        submit, poll = generation.submit, generation.poll
        generation.submit = lambda request_id, prompts, sampling: submit(request_id, *forced(prompts, sampling))
        generation.poll = lambda timeout_s: [(rid, out if isinstance(out, BaseException) else ended(out))
                                             for rid, out in poll(timeout_s)]


class ForceLengths:
    """A transformers logits processor: row i samples EOS exactly at its ``lengths[i]``-th new token
    (never before), so HF ``generate`` (TRL's rollouts) decodes the given lengths."""

    def __init__(self, lengths: list[int], prompt_width: int, eos_id: int):
        self.lengths, self.prompt_width, self.eos_id = torch.tensor(lengths), prompt_width, eos_id

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        t = input_ids.shape[1] - self.prompt_width  # the index of the token being sampled
        scores = scores.clone()
        scores[t < self.lengths - 1, self.eos_id] = -float("inf")
        end = t == self.lengths - 1
        scores[end] = -float("inf")
        scores[end, self.eos_id] = 0.0
        return scores


def force_trl_lengths(trainer, table: list[list[int]], eos_id: int) -> None:
    """TRL's GRPOTrainer (HF ``generate`` rollouts) decodes each step's lengths: its model's ``generate``
    gets a ``ForceLengths`` processor (TRL has no per-row length option)."""
    from transformers import LogitsProcessorList

    model = trainer.model
    inner, steps = model.generate, iter(table)

    def generate(*args, **kwargs):
        lengths = next(steps)
        width = kwargs["input_ids"].shape[1]
        if len(lengths) != kwargs["input_ids"].shape[0]:
            raise RuntimeError(f"fixed lengths: {len(lengths)} for {kwargs['input_ids'].shape[0]} rows")
        kwargs["logits_processor"] = LogitsProcessorList([ForceLengths(lengths, width, eos_id)])
        return inner(*args, **kwargs)

    model.generate = generate
