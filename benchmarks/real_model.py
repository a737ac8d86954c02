"""grpo-sdk next to TRL on a real pretrained model: the recipe's model, data and reward, both trainers.

One recipe drives both sides: ``--recipe`` (default recipes/smollm2-arithmetic.yaml) is resolved as
``grpoctl run`` resolves it (defaults < file < overrides), and TRL's ``GRPOConfig`` is derived from
that resolved config (``trl_settings``), so tuning the recipe carries over. ``--model DIR`` replaces
``policy.model_name`` (a model directory with a tokenizer and chat template).

Contenders, each in its own process, one torch thread (OMP_NUM_THREADS=1):

* ``grpo-sdk``: ``grpoctl run -c RECIPE policy.model_name=DIR ...`` itself, with this file as a
  hook plugin (``-p real_model``): its ``grpo_step_end`` hook reports each step and blocks until the
  parent asks for the next one. Validation and checkpoints are off (one evaluator scores both
  sides, below); the console logger is replaced by jsonl (its metrics.jsonl holds timing/*).
* ``trl``: TRL's ``GRPOTrainer`` with HF ``generate`` rollouts (``use_vllm=False``), the same model
  directory, prompts (the recipe's prompt template, as a user message through the same chat template),
  reward (grpo-sdk's own ``math_env.score_response`` with the recipe's env.math settings),
  prompts x generations, new tokens, sampling and loss settings; each step timed by a
  ``TrainerCallback`` that blocks in ``on_step_end`` (outside the timed window).

The parent alternates single steps (one contender computes at a time, the order rotating every
step) for ``--steps``; with ``--equal-wall`` (default) the faster one then trains on alone until its
summed step time reaches the slower one's. Each saves its policy (a Hugging Face model directory)
after step ``--steps`` and at the equal-wall point; the workers then exit and ONE evaluator
(``evaluate``: greedy, transformers ``generate``, float32, the recipe's validation prompts through the
same template, grpo-sdk's math scoring) scores the base model and every saved policy. ``--rounds``
repeats all of it with fresh processes (seed = recipe seed + round, the other contender first).

Run from the repo root in the bench venv (TRL installed; docs/benchmarks.md, "A real model")::

    OMP_NUM_THREADS=1 .venv-bench/bin/python benchmarks/real_model.py --model /path/to/smollm2 --steps 6
    OMP_NUM_THREADS=1 .venv-bench/bin/python benchmarks/real_model.py --quick   # a tiny local model, ~2 min
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from grpo_sdk.plugins import hookimpl  # light: no torch. This file is also grpoctl's hook plugin (-p).

from _workers import read_event

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "smollm2-arithmetic.yaml"
CONTENDERS = ("grpo-sdk", "trl")
PREFIX = "@@real "  # marks the protocol lines among whatever the libraries print
QUICK = ["grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=2", "policy.generation.max_new_tokens=8",
         "policy.train_micro_batch_size=4", "policy.logprob_batch_size=4", "policy.max_total_sequence_length=512"]
LOOSE_ENV = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
             "PYTHONWARNINGS": "ignore"}


def rss_mb() -> dict[str, float]:
    """This process's peak resident set size, MiB: VmHWM, the high-water mark of its own address space.
    Not ``ru_maxrss``: Linux carries that over fork and exec, so a worker would report at least the
    parent's peak (the parent has evaluated the base model by then)."""
    children = [pid for task in Path("/proc/self/task").iterdir()
                for pid in (task / "children").read_text().split()]
    return {"peak": _hwm_mb("self"), "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            # e.g. the math environment's scoring process, where it scores off the main thread
            "children_peak": sum(_hwm_mb(pid) for pid in children)}


def _hwm_mb(pid: str) -> float:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:  # gone since it was listed
        return 0.0
    return next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:")), 0) / 1024


def say(**message: Any) -> None:
    print(PREFIX + json.dumps(message), flush=True)


def command() -> list[str]:
    """The parent's next command: "step", "save DIR" or "stop" (EOF: stop)."""
    return (sys.stdin.readline().strip() or "stop").split(" ", 1)


# --- the settings: the recipe as grpoctl resolves it, and TRL's from it --------------------------------


def sdk_overrides(args: argparse.Namespace, seed: int | None, max_steps: int) -> list[str]:
    """What the benchmark changes in the recipe for grpo-sdk (and, through ``trl_settings``, for TRL);
    ``seed`` None keeps the recipe's."""
    return [f"policy.model_name={args.model}", *([f"grpo.seed={seed}"] if seed is not None else []),
            f"grpo.max_num_steps={max_steps}",
            # one evaluator scores both sides after training; TRL validates nothing during it either
            "grpo.val_period=0", "grpo.val_at_start=false", "grpo.val_at_end=false",
            "checkpointing.enabled=false", "logger.loggers=[jsonl]",
            *(QUICK if args.quick else []), *args.grpo_override]


def resolve(args: argparse.Namespace, seed: int | None, max_steps: int) -> Any:
    from grpo_sdk.config.loading import load_config
    from grpo_sdk.plugins.registry import Registry

    return load_config([str(args.recipe)], sdk_overrides(args, seed, max_steps), Registry.discover())


def trl_settings(cfg: Any) -> tuple[dict[str, Any], list[str]]:
    """``(GRPOConfig keyword arguments, what differs)`` for the resolved grpo-sdk config ``cfg``."""
    from grpo_sdk.config.schema import plugin_config

    grpo, loss, policy, gen = cfg.grpo, cfg.loss_fn, cfg.policy, cfg.policy.generation
    hf, estimator = plugin_config(policy), plugin_config(grpo.adv_estimator)
    rows = grpo.num_prompts_per_step * grpo.num_generations_per_prompt
    micro = min(policy.train_micro_batch_size or rows, rows)
    per_optimizer_step = policy.train_global_batch_size or rows  # rows per optimizer step
    if rows % per_optimizer_step or per_optimizer_step % micro or micro % grpo.num_generations_per_prompt:
        raise SystemExit(f"error: TRL needs the train micro batch ({micro}) to hold whole groups of "
                         f"{grpo.num_generations_per_prompt} and to divide the rows per optimizer step "
                         f"({per_optimizer_step}), and those to divide the {rows} rows per step")
    if grpo.adv_estimator.name != "grpo" or policy.backend != "hf":
        raise SystemExit("error: TRL's GRPOTrainer has group-normalised advantages on a transformers model: the "
                         "recipe needs grpo.adv_estimator.name=grpo and policy.backend=hf")
    if policy.optimizer.name != "adamw" or policy.lora.enabled:
        raise SystemExit("error: this benchmark compares full fine-tuning with AdamW (no LoRA)")
    schedule = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}[policy.scheduler.name]
    settings = dict(
        # a generation batch of P x G rows, in micro batches; an optimizer step every
        # policy.train_global_batch_size rows (default: all of them, one step per generation batch)
        per_device_train_batch_size=micro, gradient_accumulation_steps=per_optimizer_step // micro,
        steps_per_generation=rows // micro, num_generations=grpo.num_generations_per_prompt,
        num_iterations=1, max_completion_length=gen.max_new_tokens,
        temperature=gen.temperature, top_p=gen.top_p, top_k=gen.top_k or 0,
        beta=loss.reference_policy_kl_penalty, epsilon=loss.ratio_clip_min, epsilon_high=loss.ratio_clip_max,
        # "dapo": the loss summed over every completion token of the generation batch, divided by their
        # count (grpo-sdk's token_level_loss); "grpo" averages per sequence first (token_level_loss=false)
        loss_type="dapo" if loss.token_level_loss else "grpo",
        scale_rewards="group" if estimator.normalize_rewards else "none",
        mask_truncated_completions=grpo.overlong_filtering,
        learning_rate=policy.optimizer.lr, weight_decay=policy.optimizer.weight_decay,
        adam_beta1=policy.optimizer.betas[0], adam_beta2=policy.optimizer.betas[1], adam_epsilon=policy.optimizer.eps,
        lr_scheduler_type=schedule, warmup_steps=policy.scheduler.warmup_steps, max_grad_norm=policy.max_grad_norm,
        bf16=hf.autocast == "bfloat16", gradient_checkpointing=hf.gradient_checkpointing,
        max_steps=grpo.max_num_steps, seed=grpo.seed, shuffle_dataset=cfg.data.shuffle,
    )
    differences = [
        "advantages: grpo-sdk " + ("leave-one-out baseline and std (NeMo-RL's default)"
                                   if estimator.use_leave_one_out_baseline else "group-mean baseline, unbiased std")
        + ", (r - b) / (std + 1e-6) where std > 0; TRL group mean, (r - mean) / (std + 1e-4)",
        "prompt order: each shuffles with its own sampler (same data, same seed number, different draws)",
        "sampling: grpo-sdk's own KV-cache sampler vs transformers generate (same temperature/top-p/top-k)",
    ]
    if getattr(hf, "skip_zero_advantage_rows", False):
        differences.append("policy.hf.skip_zero_advantage_rows: grpo-sdk leaves rows whose advantages are all zero "
                           "out of its training passes (the same gradient, less compute); TRL computes them")
    if policy.max_total_sequence_length:
        differences.append(f"policy.max_total_sequence_length={policy.max_total_sequence_length}: grpo-sdk's "
                           "bound on prompt + response; TRL 1.16 has no prompt-length bound (it matters only for "
                           f"prompts over {policy.max_total_sequence_length - gen.max_new_tokens} tokens)")
    if cfg.cluster.malloc_mmap_threshold is not None:
        differences.append(f"cluster.malloc_mmap_threshold={cfg.cluster.malloc_mmap_threshold}: grpo-sdk's allocator "
                           "hands freed training blocks back to the OS (peak RSS, ~1.1x step time); TRL runs with "
                           "glibc's defaults")
    if policy.optimizer.moments_dtype != "float32":
        differences.append(f"policy.optimizer.moments_dtype={policy.optimizer.moments_dtype}: grpo-sdk's AdamW keeps "
                           "its moments in that dtype; TRL's AdamW keeps them in float32")
    if grpo.overlong_filtering:
        differences.append("overlong filtering: TRL's mask_truncated_completions drops truncated rows from the "
                           "loss too, but its advantages still count them in the group statistics, as grpo-sdk")
    return settings, differences


def prompt_texts(cfg: Any, rows: list[dict]) -> list[str]:
    """The user message of each row: ``data.prompt_template`` filled from the row (grpo-sdk's rule)."""
    template = cfg.data.prompt_template
    return [template.format(**row) if template else row[cfg.data.prompt_key] for row in rows]


def conversation(cfg: Any, text: str) -> list[dict[str, str]]:
    system = [{"role": "system", "content": cfg.data.system_prompt}] if cfg.data.system_prompt else []
    return [*system, {"role": "user", "content": text}]


def read_rows(path: str | Path) -> list[dict]:
    path = Path(path) if Path(path).is_absolute() else ROOT / path
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def math_config(cfg: Any) -> Any:
    from grpo_sdk.config.schema import plugin_config

    if cfg.env.name != "math":
        raise SystemExit(f"error: the recipe's env.name is {cfg.env.name!r}; this benchmark scores with 'math'")
    return plugin_config(cfg.env)


def probe_precision(model: Any) -> dict[str, dict]:
    """What the model's first linear layer sees, per mode ("no_grad": sampling and logprob passes, "grad":
    the training forward): whether CPU autocast is on, its weight's and its output's dtype. Filled as the
    trainer runs; reported with the worker's peak RSS."""
    import torch

    seen: dict[str, dict] = {}
    first = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))

    def hook(module, inputs, output):
        seen.setdefault("grad" if torch.is_grad_enabled() else "no_grad", {
            "autocast": torch.is_autocast_enabled("cpu"), "weight": str(module.weight.dtype).removeprefix("torch."),
            "output": str(output.dtype).removeprefix("torch.")})

    first.register_forward_hook(hook)
    return seen


# --- the grpo-sdk worker: grpoctl run with this module as its hook plugin -------------------------------

class SdkWorker:
    """State of the hooks below; they act only in the worker grpoctl the parent starts (REAL_MODEL_WORKER)."""

    tick = 0.0
    precision: dict[str, dict] = {}


def _active() -> bool:
    return os.environ.get("REAL_MODEL_WORKER") == "grpo-sdk"


@hookimpl
def grpo_run_start(run: Any) -> None:
    if _active():
        SdkWorker.precision = probe_precision(run.components.policy.model)
        say(event="ready", rss=rss_mb())
        _serve_sdk(run)


@hookimpl
def grpo_step_end(run: Any, step: int, metrics: dict[str, float]) -> None:
    if not _active():
        return
    wall = time.perf_counter() - SdkWorker.tick  # train_step, the metrics' logging and the hooks: grpoctl's step
    phases = {k[len("timing/"):]: v for k, v in metrics.items() if k.startswith("timing/") and k.count("/") == 1}
    batch = run.last_batch  # the step record: its generated tokens per row are the response lengths (single-turn)
    lengths = batch.token_mask.sum(1).long().tolist() if batch is not None else []
    say(event="step", step=step, wall=wall, phases=phases, reward=metrics.get("reward/mean"), lengths=lengths)
    _serve_sdk(run)


def _serve_sdk(run: Any) -> None:
    while True:
        verb, *rest = command()
        if verb == "save":  # the policy as grpo-sdk checkpoints and exports it (a Hugging Face model dir)
            run.components.policy.save_checkpoint(rest[0])
            say(event="saved", path=rest[0])
        elif verb == "step":
            SdkWorker.tick = time.perf_counter()
            return
        else:  # measured; nothing else of the run is needed (its dir is the parent's temp dir)
            say(event="done", rss=rss_mb(), precision=SdkWorker.precision)
            try:
                run.shutdown()  # its components' processes (a scoring pool) must not outlive it
            finally:
                sys.stdout.flush()
                os._exit(0)


# --- the TRL worker --------------------------------------------------------------------------------------

def trl_worker(args: argparse.Namespace) -> None:
    import torch
    from transformers import TrainerCallback

    torch.set_num_threads(1)
    cfg = resolve(args, args.seed, args.max_steps)
    trainer = build_trl(cfg, Path(args.work))
    timer = {"generate": 0.0, "generate_and_score": 0.0}

    def timed(name: str, method):
        def wrapper(*a, **kw):
            start = time.perf_counter()
            try:
                return method(*a, **kw)
            finally:
                timer[name] += time.perf_counter() - start
        return wrapper

    # TRL's step: _generate_and_score_completions (sampling with generate, rewards, advantages and any
    # logprob pass) then the loss's forward, backward and the optimizer step
    trainer._generate = timed("generate", trainer._generate)
    trainer._generate_and_score_completions = timed("generate_and_score", trainer._generate_and_score_completions)
    lengths: list[int] = []
    reward: list[float] = [0.0]
    original = trainer._calculate_rewards

    def calculate_rewards(inputs, prompts, completions, completion_ids_list):
        lengths[:] = [len(ids) for ids in completion_ids_list]
        rewards = original(inputs, prompts, completions, completion_ids_list)
        reward[0] = float(rewards.sum(-1).mean())
        return rewards

    trainer._calculate_rewards = calculate_rewards

    class Stepper(TrainerCallback):
        def on_step_begin(self, args_, state, control, **kw):
            timer.update(generate=0.0, generate_and_score=0.0)
            self.start = time.perf_counter()

        def on_step_end(self, args_, state, control, model=None, **kw):
            wall = time.perf_counter() - self.start
            scored = timer["generate_and_score"]
            say(event="step", step=state.global_step, wall=wall, lengths=list(lengths), reward=reward[0],
                phases={"generate": timer["generate"], "score_and_logprobs": scored - timer["generate"],
                        "train": wall - scored, "step": wall})
            while True:  # outside the timed window
                verb, *rest = command()
                if verb == "save":
                    model.save_pretrained(rest[0])
                    say(event="saved", path=rest[0])
                elif verb == "step":
                    return
                else:
                    control.should_training_stop = True
                    return

    trainer.add_callback(Stepper())
    precision = probe_precision(trainer.model)
    say(event="ready", rss=rss_mb())
    if command()[0] == "step":
        trainer.train()
    say(event="done", rss=rss_mb(), precision=precision)


def build_trl(cfg: Any, work: Path) -> Any:
    """TRL's GRPOTrainer on the recipe's model, training data and reward, with ``trl_settings(cfg)``."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, ProgressCallback
    from trl import GRPOConfig, GRPOTrainer

    from grpo_sdk.environments.math_env import score_response

    settings, _ = trl_settings(cfg)
    math_cfg, answer_key = math_config(cfg), math_config(cfg).answer_key
    rows = read_rows(cfg.data.train_path)
    texts = prompt_texts(cfg, rows)
    # conversational prompts: TRL applies the tokenizer's chat template with the generation prompt, as
    # grpo-sdk does with data.use_chat_template; plain text otherwise
    prompts = [conversation(cfg, t) for t in texts] if cfg.data.use_chat_template else texts
    data = Dataset.from_dict({"prompt": prompts, "answer": [str(r[answer_key]) for r in rows]})

    def correct(completions, answer, **kw):  # grpo-sdk's math environment's score, per completion
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [score_response(text, gold, math_cfg)[0] for text, gold in zip(texts, answer)]

    args = GRPOConfig(output_dir=str(work / "trl-out"), use_vllm=False, use_cpu=True, report_to="none",
                      save_strategy="no", logging_steps=1, disable_tqdm=True,
                      model_init_kwargs={"dtype": torch.float32}, **settings)
    trainer = GRPOTrainer(model=cfg.policy.model_name, reward_funcs=correct, args=args, train_dataset=data,
                          processing_class=AutoTokenizer.from_pretrained(cfg.policy.model_name, padding_side="left"))
    trainer.remove_callback(ProgressCallback)
    torch.set_num_threads(1)
    return trainer


# --- the evaluator: one for every policy ------------------------------------------------------------------

def evaluate(model_dir: str | Path, cfg: Any, *, samples: int, batch_size: int, max_new_tokens: int) -> dict:
    """Greedy held-out accuracy of the model in ``model_dir`` (float32, transformers ``generate``): the first
    ``samples`` rows of ``data.validation_path``, through the recipe's template and chat template, the
    tokenizer of ``policy.model_name``, scored by grpo-sdk's math environment (``score_response``)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo_sdk.environments.math_env import score_response

    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(cfg.policy.model_name, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = read_rows(cfg.data.validation_path)[:samples]
    texts = prompt_texts(cfg, rows)
    prompts = tokenizer.apply_chat_template([conversation(cfg, t) for t in texts], tokenize=False,
                                            add_generation_prompt=True) if cfg.data.use_chat_template else texts
    math_cfg, eos = math_config(cfg), tokenizer.eos_token_id
    scores, how, lengths, truncated = [], [], [], 0
    for i in range(0, len(rows), batch_size):
        batch = tokenizer(prompts[i:i + batch_size], return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.inference_mode():
            out = model.generate(**batch, do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos,
                                 pad_token_id=tokenizer.pad_token_id, temperature=None, top_p=None, top_k=None)
        for row, ids in zip(rows[i:i + batch_size], out[:, batch["input_ids"].shape[1]:].tolist()):
            n = ids.index(eos) + 1 if eos in ids else len(ids)
            lengths.append(n)
            truncated += eos not in ids
            score, found = score_response(tokenizer.decode(ids[:n], skip_special_tokens=True),
                                          str(row[math_cfg.answer_key]), math_cfg)
            scores.append(score)
            how.append(found)
    return {"accuracy": statistics.mean(scores), "correct": int(sum(scores)), "samples": len(scores),
            "boxed_fraction": how.count("boxed") / len(how), "mean_length": statistics.mean(lengths),
            "truncated_fraction": truncated / len(lengths),
            "seconds": round(time.perf_counter() - start, 1)}


# --- the parent: starts the workers, alternates their steps, evaluates what they saved -------------------

class Worker:
    def __init__(self, name: str, args: argparse.Namespace, seed: int, max_steps: int, work: Path):
        env = {**os.environ, **LOOSE_ENV, "REAL_MODEL_WORKER": name,
               "PYTHONPATH": os.pathsep.join([str(ROOT / "benchmarks"), os.environ.get("PYTHONPATH", "")])}
        if name == "grpo-sdk":
            grpoctl = Path(sys.executable).with_name("grpoctl")
            argv = [str(grpoctl), "run", "-c", str(args.recipe), "--run-dir", str(work / "grpo-sdk-run"),
                    "-p", "real_model", "--no-progress", *sdk_overrides(args, seed, max_steps)]
        else:
            argv = [sys.executable, str(Path(__file__).resolve()), "--worker", name, "--seed", str(seed),
                    "--max-steps", str(max_steps), "--work", str(work), "--recipe", str(args.recipe),
                    "--model", str(args.model), *(["--quick"] if args.quick else []),
                    *[f"--grpo-override={o}" for o in args.grpo_override]]
        self.name, self.log = name, work / f"{name}.log"
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log.open("w"),
                                     text=True, env=env, cwd=ROOT)
        self.steps: list[dict] = []
        self.saved: dict[str, dict] = {}  # label -> {path, step, train_s}

    @property
    def train_s(self) -> float:
        return sum(s["wall"] for s in self.steps)

    def read(self, event: str) -> dict:
        return read_event(self, PREFIX, event)

    def send(self, text: str) -> None:
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def step(self) -> None:
        self.send("step")
        self.steps.append(self.read("step"))

    def save(self, label: str, path: Path) -> None:
        self.send(f"save {path}")
        self.read("saved")
        self.saved[label] = {"path": str(path), "step": len(self.steps), "train_s": self.train_s}

    def stop(self) -> dict:
        self.send("stop")
        done = self.read("done")
        self.proc.wait(timeout=300)
        return done


def run_round(args: argparse.Namespace, cfg: Any, round_: int, work: Path) -> dict:
    """One round: both workers, ``--steps`` alternated steps, the equal-wall tail, their saved policies."""
    seed, max_steps = cfg.grpo.seed + round_, args.steps + args.max_extra_steps
    names = CONTENDERS[round_ % 2:] + CONTENDERS[:round_ % 2]
    workers = {name: Worker(name, args, seed, max_steps, work) for name in names}
    try:
        ready = {name: w.read("ready") for name, w in workers.items()}  # set-up may overlap; nothing timed yet
        for i in range(args.steps):
            order = names[i % 2:] + names[:i % 2]  # one at a time, the order rotating
            for name in order:
                workers[name].step()
        for w in workers.values():
            w.save("equal_steps", work / f"{w.name}-step{args.steps}")
        slow, fast = sorted(workers.values(), key=lambda w: -w.train_s)
        done = {slow.name: slow.stop()}  # idle from here: its peak is reached, and the machine is the other's
        if args.equal_wall and args.max_extra_steps:
            while fast.train_s < slow.train_s and len(fast.steps) < max_steps:
                fast.step()
            fast.save("equal_wall", work / f"{fast.name}-wall")
        done[fast.name] = fast.stop()
    finally:
        for w in workers.values():
            if w.proc.poll() is None:
                w.proc.kill()
                w.proc.wait()
    return {"seed": seed, "order": list(names), "slower": slow.name,
            "contenders": {name: summarise(w, ready[name], done[name], args.steps) for name, w in workers.items()}}


def summarise(w: Worker, ready: dict, done: dict, steps: int) -> dict:
    alternated = w.steps[:steps]
    timed = [s["wall"] for s in alternated[1:]] or [alternated[0]["wall"]]  # the first step warms up
    phases = {k: round(statistics.median(s["phases"].get(k, 0.0) for s in alternated[1:] or alternated), 3)
              for k in alternated[0]["phases"]}
    lengths = [n for s in alternated for n in s["lengths"]]
    return {"step_s": {"median": statistics.median(timed), "min": min(timed), "max": max(timed)},
            "step_times": [round(s["wall"], 2) for s in w.steps], "phases_s": phases,
            "steps": [{"phases": {k: round(v, 2) for k, v in s["phases"].items()}, "reward": s.get("reward"),
                       "mean_length": round(statistics.mean(s["lengths"]), 1) if s["lengths"] else None}
                      for s in w.steps],
            "mean_response_length": statistics.mean(lengths) if lengths else None,
            "peak_rss_mb": done["rss"]["peak"], "children_peak_rss_mb": done["rss"]["children_peak"],
            "rss_ready_mb": ready["rss"]["peak"], "precision": done.get("precision"), "saved": w.saved}


def evaluate_round(args: argparse.Namespace, cfg: Any, result: dict) -> None:
    """Score every policy the round saved (then delete it), with the one evaluator."""
    for contender in result["contenders"].values():
        for saved in contender["saved"].values():
            saved["eval"] = evaluate(saved["path"], cfg, **eval_options(args, cfg))
            shutil.rmtree(saved["path"], ignore_errors=True)


def eval_options(args: argparse.Namespace, cfg: Any) -> dict:
    return {"samples": args.eval_samples or cfg.grpo.max_val_samples or 10**9,
            "batch_size": args.eval_batch_size or cfg.grpo.val_batch_size,
            "max_new_tokens": args.eval_max_new_tokens or cfg.policy.generation.max_new_tokens}


def build_quick_model(out: Path) -> Path:
    """--quick without --model: a random-init 2-layer Llama and its local tokenizer (_common.build_model),
    given a chat template (the recipe renders prompts with one)."""
    import _common
    from transformers import AutoTokenizer

    _common.build_model(out, hidden=64, layers=2, intermediate=176, heads=2)
    tokenizer = AutoTokenizer.from_pretrained(out)
    tokenizer.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                               "{% if add_generation_prompt %}assistant:{% endif %}")
    tokenizer.save_pretrained(out)
    return out


def without_quantization_config(model: Path, tmp: Path) -> tuple[Path, str | None]:
    """``(the model directory both sides load, a note)``. A directory written from a GGUF-loaded model keeps
    ``quantization_config`` (quant_method gguf) in its config.json though its safetensors hold plain floats;
    transformers' Trainer then refuses to fine-tune it ("purely quantized models"). Both sides get the same
    copy without that key: links to the files, a rewritten config.json."""
    config = json.loads((model / "config.json").read_text())
    if "quantization_config" not in config:
        return model, None
    method = config.pop("quantization_config").get("quant_method")
    plain = tmp / "model-plain"
    plain.mkdir()
    for item in model.iterdir():
        if item.name != "config.json":
            (plain / item.name).symlink_to(item)
    (plain / "config.json").write_text(json.dumps(config, indent=2))
    return plain, (f"{model}/config.json has a quantization_config (quant_method {method}) over float weights, "
                   "which TRL's Trainer refuses to fine-tune: both sides load a linked copy without it")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipe", type=Path, default=RECIPE, help="the grpo-sdk recipe both sides follow")
    parser.add_argument("--model", type=Path, help="model directory (config, safetensors, tokenizer with a chat "
                        "template); replaces policy.model_name. Required, except with --quick")
    parser.add_argument("--steps", type=int, help="alternated steps per contender and round (default 6; --quick 2)")
    parser.add_argument("--rounds", type=int, default=1, help="repeats with fresh processes (seed + round)")
    parser.add_argument("--equal-wall", action=argparse.BooleanOptionalAction, default=True,
                        help="after --steps, the faster contender trains on until its summed step time reaches "
                        "the slower one's, and is evaluated there too")
    parser.add_argument("--max-extra-steps", type=int, help="most steps the faster one adds (default: --steps)")
    parser.add_argument("--eval-samples", type=int, help="validation rows scored (default grpo.max_val_samples)")
    parser.add_argument("--eval-batch-size", type=int, help="evaluator batch (default grpo.val_batch_size)")
    parser.add_argument("--eval-max-new-tokens", type=int, help="evaluator's new tokens (default the recipe's)")
    parser.add_argument("--grpo-override", action="append", default=[], metavar="KEY=VALUE",
                        help="a recipe override (repeatable), applied before TRL's settings are derived")
    parser.add_argument("--quick", action="store_true", help="smoke run: a tiny local model (unless --model), "
                        "2 prompts x 2 generations, 8 new tokens, 2 steps, 4 validation rows of 8 tokens")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    parser.add_argument("--worker", choices=["trl"], help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--max-steps", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return args
    if args.steps is None:
        args.steps = 2 if args.quick else 6
    if args.quick:
        args.eval_samples, args.eval_max_new_tokens = args.eval_samples or 4, args.eval_max_new_tokens or 8
    if args.max_extra_steps is None:
        args.max_extra_steps = args.steps
    if args.steps < 1 or args.rounds < 1 or args.max_extra_steps < 0:
        parser.error("need --steps >= 1, --rounds >= 1 and --max-extra-steps >= 0")
    if args.model is None and not args.quick:
        parser.error("--model DIR is required (a model directory with its tokenizer), except with --quick")
    if args.model is not None and not (args.model / "config.json").is_file():
        parser.error(f"--model {args.model}: no config.json there; give a Hugging Face model directory")
    if not args.recipe.is_file():
        parser.error(f"--recipe {args.recipe}: no such file")
    if bad := [o for o in args.grpo_override if "=" not in o]:
        parser.error(f"--grpo-override takes KEY=VALUE, got {bad[0]!r}")
    import importlib.util

    if importlib.util.find_spec("trl") is None:
        parser.error("TRL is not installed in this interpreter: run it in the bench venv (docs/benchmarks.md)")
    args.model = args.model.resolve() if args.model is not None else None
    args.recipe = args.recipe.resolve()
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker == "trl":
        trl_worker(args)
        return 0
    import _common  # noqa: F401 - one torch thread and the offline hub, before torch is imported
    import torch

    load_before, started = os.getloadavg(), time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="grpo-real-model-") as tmp:
        if args.model is None:
            args.model = build_quick_model(Path(tmp) / "model")
        source = args.model
        args.model, model_note = without_quantization_config(args.model, Path(tmp))
        try:
            cfg = resolve(args, None, args.steps + args.max_extra_steps)
        except Exception as exc:  # noqa: BLE001 - a ConfigError names the key; the recipe is the user's
            print(f"error: the recipe does not resolve: {exc}", file=sys.stderr)
            return 2
        settings, differences = trl_settings(cfg)
        base = evaluate(args.model, cfg, **eval_options(args, cfg))
        rounds = []
        for round_ in range(args.rounds):
            work = Path(tmp) / f"round{round_}"
            work.mkdir()
            try:
                rounds.append(run_round(args, cfg, round_, work))
            except RuntimeError as exc:  # a worker failed: its log's tail says why
                print(f"error: {exc}", file=sys.stderr)
                return 1
            evaluate_round(args, cfg, rounds[-1])
    summary = {"commit": git_commit(), "recipe": str(args.recipe), "model": str(source), "model_note": model_note,
               "torch": torch.__version__, "trl": version("trl"), "transformers": version("transformers"),
               "cpus": os.cpu_count(), "load_avg_before": [round(x, 2) for x in load_before],
               "load_avg_after": [round(x, 2) for x in os.getloadavg()],
               "wall_s": round(time.perf_counter() - started, 1), "steps": args.steps,
               "grpo_overrides": sdk_overrides(args, None, args.steps + args.max_extra_steps),
               "trl_settings": settings, "differences": differences, "eval": eval_options(args, cfg),
               "base_eval": base, "rounds": rounds, **totals(rounds)}
    print(json.dumps(summary, indent=1) if args.json else report(summary))
    return 0


def totals(rounds: list[dict]) -> dict:
    """Over the rounds: each contender's step times (after each round's first step), peak RSS, accuracy at
    equal steps; the ratios grpo-sdk/TRL; and each round's equal-wall pair."""
    out: dict[str, Any] = {"step_s": {}, "peak_rss_mb": {}, "accuracy_equal_steps": {}}
    for name in CONTENDERS:
        runs = [r["contenders"][name] for r in rounds]
        # each round's alternated steps after its first (the equal-wall tail ran alone: not counted)
        walls = [t for run in runs for t in run["step_times"][1:r_steps(run)]] or \
            [run["step_times"][0] for run in runs]
        out["step_s"][name] = {"median": statistics.median(walls), "min": min(walls), "max": max(walls),
                               "n": len(walls)}
        out["peak_rss_mb"][name] = max(run["peak_rss_mb"] for run in runs)
        out["accuracy_equal_steps"][name] = [run["saved"]["equal_steps"]["eval"]["accuracy"] for run in runs]
    out["grpo_over_trl_step"] = out["step_s"]["grpo-sdk"]["median"] / out["step_s"]["trl"]["median"]
    out["grpo_over_trl_peak_rss"] = out["peak_rss_mb"]["grpo-sdk"] / out["peak_rss_mb"]["trl"]
    out["equal_wall"] = []
    for r in rounds:
        slow = r["contenders"][r["slower"]]["saved"]["equal_steps"]
        fast_name = next(n for n in CONTENDERS if n != r["slower"])
        fast = r["contenders"][fast_name]["saved"].get("equal_wall")
        if fast is not None:
            out["equal_wall"].append({
                "faster": fast_name, "faster_steps": fast["step"], "faster_train_s": round(fast["train_s"], 1),
                "faster_accuracy": fast["eval"]["accuracy"], "slower": r["slower"], "slower_steps": slow["step"],
                "slower_train_s": round(slow["train_s"], 1), "slower_accuracy": slow["eval"]["accuracy"]})
    return out


def r_steps(run: dict) -> int:
    """The alternated steps of a contender's round (its equal-wall tail ran alone: not in the step times)."""
    return run["saved"]["equal_steps"]["step"]


def report(s: dict) -> str:
    lines = [f"grpo-sdk vs TRL {s['trl']} on {s['model']} ({Path(s['recipe']).name}), commit {s['commit']}; "
             f"torch {s['torch']}, transformers {s['transformers']}, {s['cpus']} CPUs, one thread each; load avg "
             f"{s['load_avg_before']} -> {s['load_avg_after']}; {len(s['rounds'])} round(s) of {s['steps']} "
             f"alternated steps; {s['wall_s']:.0f} s in all", ""]
    lines.append(f"{'':<10} {'s/step median':>13} {'min':>7} {'max':>7} {'peak RSS MB':>12}   accuracy at step "
                 f"{s['steps']} per round (base {s['base_eval']['accuracy']:.3f})")
    for name in CONTENDERS:
        t = s["step_s"][name]
        accuracy = ", ".join(f"{a:.3f}" for a in s["accuracy_equal_steps"][name])
        lines.append(f"{name:<10} {t['median']:>13.2f} {t['min']:>7.2f} {t['max']:>7.2f} "
                     f"{s['peak_rss_mb'][name]:>12.0f}   {accuracy}")
    lines.append(f"ratios grpo-sdk/TRL: step {s['grpo_over_trl_step']:.3f}, peak RSS {s['grpo_over_trl_peak_rss']:.3f}")
    for i, (r, w) in enumerate(zip(s["rounds"], s["equal_wall"] or [None] * len(s["rounds"]))):
        phases = "; ".join(f"{n}: " + ", ".join(f"{k} {v:.2f}" for k, v in c["phases_s"].items())
                           for n, c in r["contenders"].items())
        lines.append(f"round {i} (seed {r['seed']}, {r['order'][0]} first): median phases (s) {phases}")
        if w:
            lines.append(f"  equal wall time: {w['faster']} {w['faster_steps']} steps in {w['faster_train_s']} s "
                         f"-> {w['faster_accuracy']:.3f}; {w['slower']} {w['slower_steps']} steps in "
                         f"{w['slower_train_s']} s -> {w['slower_accuracy']:.3f}")
    for name, c in s["rounds"][0]["contenders"].items():
        lines.append(f"{name} precision (first linear layer: autocast, weight, output): " + "; ".join(
            f"{mode} {p['autocast']}, {p['weight']}, {p['output']}" for mode, p in (c["precision"] or {}).items()))
    e = s["eval"]
    lines.append(f"evaluator: greedy, float32, transformers generate, first {e['samples']} validation rows, batch "
                 f"{e['batch_size']}, {e['max_new_tokens']} new tokens, grpo-sdk's math scoring")
    lines += ["not matched: " + d for d in s["differences"]] + (["note: " + s["model_note"]] if s["model_note"] else [])
    return "\n".join(lines)


def git_commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version as installed

    try:
        return installed(package)
    except PackageNotFoundError:
        return "not installed"


if __name__ == "__main__":
    sys.exit(main())
