"""What playing rollouts through the rollout endpoint costs, against the trainer's own turn loop.

One "step" is the calculator recipe's rollout (recipes/tiny-calculator.yaml): 8 prompts x 16
generations = 128 rollouts of up to 3 turns of at most 2 new tokens, on the built-in tiny model
(a 2-layer GPT-2, d_model 64, random init, fp32, one torch thread). Contenders:

* ``(a) in-process``: ``collect_rollouts`` with the calculator environment: the trainer plays the
  turns itself (``rollouts.episodes.run_episodes``: one ``generate`` call per turn for every
  rollout still going);
* ``(b) endpoint, urllib``: ``collect_rollouts`` with the agent harness (``env.name=agent``:
  ``rollouts.agent_rollouts.play_agents``), 128 agent threads (``max_concurrency=128``, as
  examples/agents/calculator-agent.yaml), each playing the example agent's loop with the standard
  library's ``urllib.request`` (a new connection per request);
* ``(c) endpoint, openai``: the same with the example agent itself,
  examples/agents/calculator_agent.py:run (the ``openai`` client over one ``httpx.Client`` the
  example shares across every rollout);
* ``(c1) openai, a client per rollout``, a what-if: (c) with ``OpenAI()`` building its own HTTP
  client every rollout (the example's ``HTTP`` set to None for the step), as an agent that
  constructs its client in its rollout function does;
* ``(d) Endpoint.chat, fake engine``: the endpoint's own work per request and nothing else: the
  same agent loop calling ``Endpoint.chat`` directly in one thread (no HTTP, no threads), over an
  engine that answers at once (two digits; on the third turn a digit and ``<eos>``).

The contenders alternate, round by round, on the same prompts within a round, so each round's
contenders see about the same load; one warm-up round first. Printed per contender: seconds per
step (median over rounds), the ratio to (a), the process's CPU seconds per step (every thread:
steadier than wall time on a shared machine), assistant turns (= requests) per step and per
second, and ``Generation.generate`` calls per step with the wall seconds inside them. Sampling is
not seeded, so a rollout may stop before its third turn; turns are counted, not assumed.

Then probes, one thread, one request at a time, over HTTP to the fake engine's endpoint: a urllib
request, an openai request over one keep-alive ``httpx.Client`` against the server as it ships
and against one with ``TCP_NODELAY`` on its sockets (a what-if: its handler's
``disable_nagle_algorithm``), building an ``httpx.Client``, and ``Endpoint.chat`` alone.

Run from the repo root (about 2 minutes with the default 8 rounds on 2 busy shared vCPUs)::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/endpoint_overhead.py [--repeats 8]

Results: docs/benchmarks.md ("Agents over the rollout endpoint"). Nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # must precede `import torch`
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import httpx  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # examples.agents.calculator_agent, imported as the trainer would
    sys.path.insert(0, str(ROOT))

import examples.agents.calculator_agent as example  # noqa: E402
from examples.agents.calculator_agent import EOS, matching, reference_turns  # noqa: E402

GENERATIONS = 16  # per prompt, as the recipe
# name: (how the step is played, what-if: OpenAI() builds its own HTTP client every rollout)
CONTENDERS = {
    "(a) in-process": ("calculator", False),
    "(b) endpoint, urllib": ("urllib", False),
    "(c) endpoint, openai": ("openai", False),
    "(c1) openai, a client per rollout": ("openai", True),
    "(d) Endpoint.chat, fake engine": ("fake", False),
}
PROBES = 30  # requests per probe


def load() -> str:
    return f"load avg {os.getloadavg()[0]:.2f}"  # the 1-minute figure of /proc/loadavg


# --- the agents -------------------------------------------------------------------------------------


def play(task, post) -> float:
    """The example agent's loop (examples/agents/calculator_agent.py:run) over ``post(url, body) -> reply``."""
    reference = reference_turns(task.row["operands"])
    messages = [{"role": "user", "content": task.prompt}]
    reward = 0.0
    for k in range(len(reference)):
        reply = post(f"{task.base_url}/chat/completions",
                     {"model": task.model, "messages": messages, "max_tokens": 2})
        choice = reply["choices"][0]
        text = choice["message"]["content"] or ""
        said = list(text) + ([EOS] if choice["finish_reason"] == "stop" else [])
        reward += matching(said, reference[k]) / len(reference)
        messages.append({"role": "assistant", "content": text})
        if choice["finish_reason"] == "stop":
            break
        if len(text) == 2 and text.isdigit():
            messages.append({"role": "tool", "content": f"={(int(text[0]) + int(text[1])) % 10}>"})
        else:
            messages.append({"role": "tool", "content": "=?>"})
    return reward


def urllib_post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def urllib_agent(task) -> float:
    """The example agent with the standard library's HTTP client instead of openai."""
    return play(task, urllib_post)


# --- counting and faking generation -------------------------------------------------------------------


class Counter:
    """Wraps ``generation.generate``: its calls and the wall seconds inside them. A backend with
    submit/poll (the hf sampler, since issue 35) is streamed to by the endpoint's engine: a submitted
    request counts as a call, and the seconds are those inside ``poll``, which runs the sampler."""

    def __init__(self, generation):
        self.calls = 0
        self.seconds = 0.0
        self._generate = generation.generate
        generation.generate = self
        if hasattr(generation, "submit"):
            submit, poll = generation.submit, generation.poll

            def submitted(*args):
                self.calls += 1
                return submit(*args)

            def polled(timeout_s):
                start = time.perf_counter()
                try:
                    return poll(timeout_s)
                finally:
                    self.seconds += time.perf_counter() - start

            generation.submit, generation.poll = submitted, polled

    def __call__(self, inputs, sampling):
        start = time.perf_counter()
        try:
            return self._generate(inputs, sampling)
        finally:
            self.seconds += time.perf_counter() - start
            self.calls += 1

    def reset(self) -> None:
        self.calls = 0
        self.seconds = 0.0


class FakeEngine:
    """A GenerationEngine that answers at once: two digits (a call, cut at max_tokens) on the first two
    turns, a digit and <eos> (the answer) on the third; the turn is the count of '>' in the prompt."""

    is_open = True
    queued = 0

    def __init__(self, tokenizer):
        self.digit = tokenizer.convert_tokens_to_ids("7")
        self.gt = tokenizer.convert_tokens_to_ids(">")
        self.eos = tokenizer.eos_token_id

    def generate(self, prompt_ids, sampling, *, timeout_s):
        from grpo_sdk.serving.engine import Sampled

        if list(prompt_ids).count(self.gt) >= 3:
            return Sampled(ids=[self.digit, self.eos], logprobs=[-1.0, -1.0], versions=[0, 0], truncated=False)
        return Sampled(ids=[self.digit, self.digit], logprobs=[-1.0, -1.0], versions=[0, 0], truncated=True)


# --- the contenders -----------------------------------------------------------------------------------


class Bench:
    def __init__(self, work: Path, rollouts: int):
        from grpo_sdk.backends.hf.generation import HFGeneration
        from grpo_sdk.config.loading import load_config
        from grpo_sdk.config.context import RunContext
        from grpo_sdk.core.models import load_tokenizer
        from grpo_sdk.core.records import SamplingParams
        from grpo_sdk.environments.agent_harness import AgentHarness
        from grpo_sdk.environments.calculator import CalculatorEnvironment
        from grpo_sdk.environments.callables import reference_for
        from grpo_sdk.environments.specs import AgentHarnessConfig
        from grpo_sdk.plugins.registry import Registry
        from grpo_sdk.recipes.tiny_model import build_tiny_gpt2
        from grpo_sdk.serving.endpoint import Endpoint, EndpointSettings
        from grpo_sdk.data.prompts import PromptBuilder
        from grpo_sdk.data.prompt_sources import EnvironmentPrompts

        model = build_tiny_gpt2(work / "model", seed=0)
        registry = Registry.discover()
        cfg = self.cfg = load_config([str(ROOT / "recipes" / "tiny-calculator.yaml")],
                                     [f"policy.model_name={model}"], registry)
        context = RunContext(config=cfg, run_dir=work, model_path=str(model), tokenizer_path=str(model), device="cpu",
                             seed=0, needs_reference=False)
        self.tokenizer = load_tokenizer(str(model))
        self.generation = HFGeneration(None, context)
        self.counter = Counter(self.generation)
        gen = cfg.policy.generation
        self.sampling = SamplingParams(max_new_tokens=gen.max_new_tokens, temperature=gen.temperature,
                                       top_p=gen.top_p, top_k=gen.top_k, stop_token_ids=tuple(gen.stop_token_ids))
        self.max_prompt_tokens = cfg.policy.max_total_sequence_length - gen.max_new_tokens
        self.calculator = CalculatorEnvironment(cfg.env.structured_blocks["calculator"], context)
        self.prompts = EnvironmentPrompts(self.calculator, "calculator", seed="endpoint-overhead",
                                          builder=PromptBuilder(tokenizer=self.tokenizer))
        self.num_prompts = rollouts // GENERATIONS
        self.environments = {"calculator": self.calculator}
        for kind, agent in (("urllib", urllib_agent), ("openai", example.run)):
            self.environments[kind] = AgentHarness(AgentHarnessConfig(agent=reference_for(agent), max_concurrency=128,
                                                                      timeout_s=60), None)
        self.fake = FakeEngine(self.tokenizer)
        self.fake_endpoint = Endpoint(self.fake, self.tokenizer, EndpointSettings(
            model_name="policy", sampling="run", defaults=self.sampling,
            max_total_tokens=cfg.policy.max_total_sequence_length))
        self._sessions = 0

    def run(self, contender: str, prompts) -> dict[str, float]:
        """One step; its wall time, turns, generate calls and seconds inside generate."""
        from grpo_sdk.core.records import Message
        from grpo_sdk.rollouts.rollout import collect_rollouts

        kind, per_rollout = CONTENDERS[contender]
        self.counter.reset()
        shared = example.HTTP
        start, cpu = time.perf_counter(), time.process_time()
        if kind == "fake":
            turns = self._fake_step(prompts)
        else:
            if per_rollout:  # the example's agent as it is, but OpenAI(http_client=None) builds its own
                example.HTTP = None
            try:
                batch, _ = collect_rollouts(prompts=prompts, tokenizer=self.tokenizer, generation=self.generation,
                                            environment=self.environments[kind], cfg=self.cfg, sampling=self.sampling,
                                            max_prompt_tokens=self.max_prompt_tokens, group_offset=0,
                                            num_generations=GENERATIONS)
            finally:
                example.HTTP = shared
            failed = int((~batch.reward_valid).sum())
            if failed:
                raise SystemExit(f"{contender}: {failed} of {len(batch.message_logs)} rollouts failed")
            turns = sum(1 for log in batch.message_logs for m in log
                        if isinstance(m, Message) and m.generation_logprobs is not None)
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        return {"wall": wall, "cpu": cpu, "turns": turns, "calls": self.counter.calls,
                "generate_s": self.counter.seconds}

    def _fake_step(self, prompts) -> int:
        """Every rollout's agent loop, one after another, calling Endpoint.chat directly."""
        from grpo_sdk.core.agents import AgentTask

        endpoint = self.fake_endpoint
        requests = 0

        def post(url: str, body: dict) -> dict:
            nonlocal requests
            requests += 1
            return endpoint.chat(body, session)

        for prompt in prompts:
            for i in range(GENERATIONS):
                self._sessions += 1
                session = f"fake-{self._sessions}"
                task = AgentTask(session_id=session, base_url="", endpoint_url="", api_key="EMPTY", model="policy",
                                 prompt=prompt.text, messages=None, row=dict(prompt.metadata), max_tokens=2,
                                 timeout_s=60, group=0, index=i)
                play(task, post)
                endpoint.sessions.take(session)
        return requests

    def close(self) -> None:
        from grpo_sdk.rollouts.agent_rollouts import close_endpoints

        close_endpoints()

    def probes(self) -> dict[str, tuple[float, float]]:
        """One thread, one request at a time, over HTTP to the fake engine's endpoint (no model): what a
        request costs each client, and what building the example's per-thread client costs. Median wall
        and CPU seconds of each."""
        from openai import OpenAI

        from grpo_sdk.serving.server import RolloutServer

        body = {"model": "policy", "messages": [{"role": "user", "content": "7+5+3>"}], "max_tokens": 2}
        shipped = RolloutServer(self.fake_endpoint)
        nagle = RolloutServer(self.fake_endpoint)
        # what-if: the server without TCP_NODELAY, as it first shipped (socketserver sets TCP_NODELAY on an
        # accepted connection when the handler class says so); this server's handler class is its own
        nagle._httpd.RequestHandlerClass.disable_nagle_algorithm = False
        out = {}
        try:
            for server in (shipped, nagle):
                server.start()
            url = shipped.base_url + "/chat/completions"
            out["urllib, a connection per request"] = timed(lambda: urllib_post(url, body))
            for name, server in (("openai over one keep-alive httpx client", shipped),
                                 ("openai, the same, server without TCP_NODELAY", nagle)):
                with httpx.Client(timeout=60) as http:
                    client = OpenAI(base_url=server.base_url, api_key="EMPTY", http_client=http, max_retries=0)
                    out[name] = timed(lambda: client.chat.completions.create(**body))
            out["building an httpx.Client (its TLS context)"] = timed(lambda: httpx.Client(timeout=60).close())
            out["Endpoint.chat, no HTTP"] = timed(lambda: self.fake_endpoint.chat(body, None))
        finally:
            for server in (shipped, nagle):
                server.stop()
        return out


def timed(fn) -> tuple[float, float]:
    fn()  # the first connection, imports
    walls, cpus = [], []
    for _ in range(PROBES):
        start, cpu = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - start)
        cpus.append(time.process_time() - cpu)
    return statistics.median(walls), statistics.median(cpus)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=8, help="timed rounds (each contender once per round)")
    parser.add_argument("--rollouts", type=int, default=128, help=f"rollouts per step, a multiple of {GENERATIONS}")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.rollouts < GENERATIONS or args.rollouts % GENERATIONS:
        parser.error(f"--rollouts must be a positive multiple of {GENERATIONS}")
    import openai
    import transformers

    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, transformers {transformers.__version__}, "
          f"openai {openai.__version__}, httpx {httpx.__version__}; threads {torch.get_num_threads()}, "
          f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}, cpus {os.cpu_count()}, {load()}", flush=True)
    print(f"one step: {args.rollouts // GENERATIONS} prompts x {GENERATIONS} = {args.rollouts} rollouts, "
          "up to 3 turns of at most 2 new tokens (recipes/tiny-calculator.yaml)", flush=True)
    history: dict[str, list[dict[str, float]]] = {c: [] for c in CONTENDERS}
    with tempfile.TemporaryDirectory(prefix="grpo-endpoint-overhead-") as tmp:
        start = time.perf_counter()
        bench = Bench(Path(tmp), args.rollouts)
        print(f"set up in {time.perf_counter() - start:.1f} s", flush=True)
        try:
            for round_ in range(1 + args.repeats):  # round 0 warms up
                prompts = bench.prompts.next_prompts(bench.num_prompts)  # the same prompts for every contender
                walls = []
                for contender in CONTENDERS:
                    result = bench.run(contender, prompts)
                    walls.append(f"{contender.split()[0]} {result['wall']:.3f}")
                    if round_:
                        history[contender].append(result)
                walls = "  ".join(walls)
                print(f"  round {round_}/{args.repeats}{' (warm-up)' if not round_ else ''}: s/step {walls}, {load()}",
                      flush=True)
            probes = bench.probes()
        finally:
            bench.close()

    median = {c: {k: statistics.median(r[k] for r in rows) for k in rows[0]} for c, rows in history.items()}
    a, b, c, c1, d = (median[k] for k in CONTENDERS)
    base = a["wall"]
    print(f"\n{args.repeats} rounds, contenders alternated within each; medians; {load()} at the end")
    header = (f"{'contender':<32} {'s/step':>8} {'x (a)':>7} {'CPU s/step':>10} {'turns/step':>10} {'turns/s':>8} "
              f"{'generate calls/step':>19} {'in generate s/step':>18}")
    print(header)
    print("-" * len(header))
    for contender, rows in history.items():
        m = median[contender]
        per_s = sum(r["turns"] for r in rows) / sum(r["wall"] for r in rows)
        print(f"{contender:<32} {m['wall']:>8.4f} {m['wall'] / base:>7.2f} {m['cpu']:>10.4f} {m['turns']:>10.0f} "
              f"{per_s:>8,.0f} {m['calls']:>19.0f} {m['generate_s']:>18.4f}")
    print("CPU s/step: the process's CPU time (every thread); in generate: wall time inside Generation.generate "
          "calls, which the agent and HTTP threads stretch while they hold the GIL")
    print(f"\n(d) the endpoint's own cost per request (Endpoint.chat, no model, no HTTP): "
          f"{d['wall'] / d['turns'] * 1e6:.0f} us")
    for name, m in (("(b) urllib", b), ("(c) openai", c), ("(c1) openai, a client per rollout", c1)):
        print(f"{name}: x{m['wall'] / base:.2f} of in-process, "
              f"{(m['cpu'] - a['cpu']) / m['turns'] * 1e3:.2f} ms more CPU per turn")
    print(f"the openai client over urllib, (c) - (b): {(c['wall'] - b['wall']) / c['turns'] * 1e3:+.2f} ms of wall "
          f"and {(c['cpu'] - b['cpu']) / c['turns'] * 1e3:+.2f} ms of CPU per turn; a client per rollout over one "
          f"shared, (c1) / (c): x{c1['wall'] / c['wall']:.2f}")
    print(f"\nprobes: one thread, one request at a time, the fake engine over HTTP; medians of {PROBES}; {load()}")
    for name, (wall, cpu) in probes.items():
        print(f"  {name:<44} {wall * 1e3:>7.2f} ms wall {cpu * 1e3:>7.2f} ms CPU")
    return 0


if __name__ == "__main__":
    sys.exit(main())
