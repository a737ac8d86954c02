"""Does a model trained on the calculator recipe use the tool, or did it learn to add?

    python benchmarks/calculator_tool_use.py RUN_DIR [--prompts 512]

Loads RUN_DIR's latest checkpoint (a run of recipes/tiny-calculator.yaml) and plays greedy episodes
on fresh prompts twice: with the real tool, add(x, y) = (x + y) mod 10, and with a wrong one,
(x + y + 1) mod 10. A model that uses the tool copies the tool's results, so with the wrong tool its
answers follow the tool (they equal its last result) and are seldom the true sum; a model that had
learned to add would keep giving the true sum. Prints, per tool: episodes that made both calls and
answered, answers equal to the true sum, answers equal to the tool's last result, and calls whose
first operand is the previous call's result as the tool returned it. Results: docs/tools.md.
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
from pathlib import Path

import attrs


def play(trainer, environment, prompts, sampling):
    from grpo_sdk.rollouts.rollout import collect_rollouts

    parts = trainer.components
    batch, _ = collect_rollouts(prompts=prompts, tokenizer=parts.tokenizer, generation=parts.generation,
                                environment=environment, cfg=trainer.config, sampling=sampling,
                                max_prompt_tokens=parts.max_prompt_tokens, group_offset=0, num_generations=1)
    counts = {"two calls, then an answer": 0, "answer = true sum": 0, "answer = tool's last result": 0,
              "second call starts from the tool's result": 0}
    for log, meta in zip(batch.message_logs, batch.metadata):
        turns = [m.content for m in log if m.generation_logprobs is not None]
        results = [m.content.strip("=>") for m in log if m.role == "tool"]
        complete = len(turns) == 3 and len(results) == 2 and len(turns[2]) == 1
        counts["two calls, then an answer"] += complete
        counts["answer = true sum"] += complete and turns[2] == meta["target"]
        counts["answer = tool's last result"] += complete and turns[2] == results[1]
        counts["second call starts from the tool's result"] += complete and turns[1][:1] == results[0]
    return {k: v / len(prompts) for k, v in counts.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--prompts", type=int, default=512)
    args = parser.parse_args()

    import torch

    from grpo_sdk.config.loading import load_config
    from grpo_sdk.environments.calculator import CalculatorEnvironment
    from grpo_sdk.plugins.registry import Registry
    from grpo_sdk.plugins.tools import Tool
    from grpo_sdk.data.prompts import PromptBuilder
    from grpo_sdk.data.prompt_sources import EnvironmentPrompts
    from grpo_sdk.trainer.trainer import GRPOTrainer

    torch.set_num_threads(1)
    registry = Registry.discover()
    cfg = load_config([str(args.run_dir / "config.resolved.yaml")], [], registry)
    work = Path(tempfile.mkdtemp(prefix="calculator-tool-use-"))
    try:
        shutil.copytree(args.run_dir, work / "run", ignore=shutil.ignore_patterns("metrics.jsonl", "report"))
        trainer = GRPOTrainer(cfg, run_dir=work / "run", registry=registry, resume=True)
        trainer.setup()
        print(f"checkpoint: step {trainer.state.step} of {args.run_dir}")

        class WrongTool(CalculatorEnvironment):
            def tools(self):
                add = super().tools()[0]
                return [attrs.evolve(add, function=lambda x, y: (x + y + 1) % 10)]

        block = cfg.env.structured_blocks["calculator"]
        real = CalculatorEnvironment(block, trainer.components.context)
        prompts = EnvironmentPrompts(real, "calculator", seed="tool-use",  # not the training or validation stream
                                     builder=PromptBuilder(tokenizer=trainer.components.tokenizer)
                                     ).next_prompts(args.prompts)
        greedy = attrs.evolve(trainer.components.sampling, top_k=1)
        rows = {"real tool, (x+y) mod 10": play(trainer, real, prompts, greedy),
                "wrong tool, (x+y+1) mod 10": play(trainer, WrongTool(block, trainer.components.context), prompts,
                                                    greedy)}
        trainer.shutdown()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    keys = list(next(iter(rows.values())))
    print(f"{args.prompts} fresh prompts, greedy decoding\n")
    print(f"| {'tool':<28} | " + " | ".join(keys) + " |")
    print("|" + "---|" * (len(keys) + 1))
    for name, values in rows.items():
        print(f"| {name:<28} | " + " | ".join(f"{values[k]:.3f}" for k in keys) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
