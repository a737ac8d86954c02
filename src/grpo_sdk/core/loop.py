"""The synchronous GRPO training loop. It talks only to the protocols.

One step::

    prompts  = next P prompts                       (dataset or environment)
    batch    = G responses per prompt, scored       (Generation, Environment)
    batch.prev_logprobs      = policy.logprobs      (only when a step takes several optimizer steps)
    batch.reference_logprobs = policy.reference_logprobs    (only when the KL penalty is on)
    batch.advantages = estimator.compute_advantages(rewards, group_ids, mask, ...)
    metrics  = policy.train(batch, loss_fn)         (Policy)
    weight_sync.sync_weights(policy, generation, version=step)

Every component is built the same way, ``registry.load_impl(kind, name)(config_block, context)``;
nothing here knows which backend it drives.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any, Callable

import attrs
import torch

from grpo_sdk.algorithms.loss import ClippedPGLoss
from grpo_sdk.core.config import MasterConfig, plugin_config
from grpo_sdk.core.config_loader import to_yaml
from grpo_sdk.core.context import RunContext
from grpo_sdk.core.data import make_prompt_source
from grpo_sdk.core.errors import GrpoSdkError, NonFiniteError
from grpo_sdk.core.models import load_tokenizer
from grpo_sdk.core.records import SamplingParams
from grpo_sdk.core.rollout import collect_rollouts
from grpo_sdk.recipes.tiny_model import resolve_model_path


@attrs.frozen(kw_only=True)
class RunSummary:
    steps: int
    seconds: float
    reward_first: float  # mean reward of the first step: the starting level
    reward_last: float  # mean reward over the last min(10, steps) steps
    run_dir: Path
    checkpoint: Path | None
    example: dict[str, Any] | None  # one sample of the last step

    def to_json(self) -> dict[str, Any]:
        return {**attrs.asdict(self), "run_dir": str(self.run_dir),
                "checkpoint": str(self.checkpoint) if self.checkpoint else None}


def pick_device(requested: str) -> str:
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise GrpoSdkError("cluster.device=cuda but torch sees no CUDA device")
    return requested


class GRPOTrainer:
    """Builds the components of a run and trains; ``run`` for observer hooks is this object."""

    def __init__(self, config: MasterConfig, *, run_dir: str | Path, registry: Any):
        self.config = config
        self.run_dir = Path(run_dir)
        self.registry = registry
        self.step = 0

    # --- setup ----------------------------------------------------------------------------------

    def setup(self) -> None:
        cfg = self.config
        if cfg.cluster.num_threads:
            torch.set_num_threads(cfg.cluster.num_threads)
        random.seed(cfg.grpo.seed)
        torch.manual_seed(cfg.grpo.seed)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.resolved.yaml").write_text(to_yaml(cfg))
        (self.run_dir / "plugins.json").write_text(json.dumps(self._plugin_versions(), indent=2) + "\n")

        model_path = resolve_model_path(cfg.policy.model_name, self.run_dir, cfg.grpo.seed)
        self.context = RunContext(
            config=cfg, run_dir=self.run_dir, model_path=model_path,
            tokenizer_path=cfg.policy.tokenizer.name or model_path, device=pick_device(cfg.cluster.device),
            seed=cfg.grpo.seed, needs_reference=cfg.loss_fn.reference_policy_kl_penalty > 0,
            registry=self.registry,
        )
        self.policy = self._build("policy", cfg.policy)
        self.generation = self._build("generation", cfg.policy.generation)
        self.environment = self._build("environment", cfg.env)
        self.estimator = self._build("estimator", cfg.grpo.adv_estimator)
        self.weight_sync = self._build("weight_sync", cfg.weight_sync)
        self.loggers = [self._build("logger", cfg.logger, name) for name in cfg.logger.loggers]
        self.loss_fn = ClippedPGLoss(cfg.loss_fn)

        self.tokenizer = load_tokenizer(self.context.tokenizer_path)
        self.prompts = make_prompt_source(cfg, self.environment)
        gen = cfg.policy.generation
        self.sampling = SamplingParams(max_new_tokens=gen.max_new_tokens, temperature=gen.temperature,
                                       top_p=gen.top_p, top_k=gen.top_k, stop_token_ids=tuple(gen.stop_token_ids))
        self.max_prompt_tokens = cfg.data.max_input_seq_length or (
            cfg.policy.max_total_sequence_length - gen.max_new_tokens)

    def _build(self, kind: str, section: Any, name: str | None = None) -> Any:
        name = name or getattr(section, type(section).__plugin__.selector)
        impl = self.registry.load_impl(kind, name)
        return impl(plugin_config(section, name), self.context)

    def _plugin_versions(self) -> dict[str, Any]:
        from grpo_sdk import __version__

        return {"grpo_sdk": __version__, "torch": torch.__version__,
                "components": [info.to_json() for info in self.registry.list()],
                "hooks": [p.to_json() for p in self.registry.hook_plugins]}

    # --- one step -------------------------------------------------------------------------------

    def train_step(self) -> tuple[dict[str, float], list[dict[str, Any]]]:
        cfg = self.config
        timings: dict[str, float] = {}
        start = time.perf_counter()
        prompts = self.prompts.next_prompts(cfg.grpo.num_prompts_per_step)
        batch, metrics, samples = collect_rollouts(
            prompts=prompts, tokenizer=self.tokenizer, generation=self.generation, environment=self.environment,
            cfg=cfg, sampling=self.sampling, max_prompt_tokens=self.max_prompt_tokens,
            group_offset=self.step * cfg.grpo.num_prompts_per_step)
        timings["rollout"] = time.perf_counter() - start

        tick = time.perf_counter()
        rows = batch.batch_size
        if (cfg.policy.train_global_batch_size or rows) < rows:  # several optimizer steps: freeze "old"
            batch.prev_logprobs = self.policy.logprobs(batch)
        if self.context.needs_reference:
            batch.reference_logprobs = self.policy.reference_logprobs(batch)
        timings["logprobs"] = time.perf_counter() - tick

        mask = batch.token_mask * batch.sample_mask[:, None]
        batch.advantages = self.estimator.compute_advantages(
            batch.rewards, batch.group_ids, mask, valid_mask=batch.sample_mask.bool(),
            reward_components={k[len("reward/"):]: v for k, v in batch.extras.items() if k.startswith("reward/")},
            prev_logprobs=batch.prev_logprobs, reference_logprobs=batch.reference_logprobs)
        valid_adv = batch.advantages[:, -1][batch.sample_mask > 0]
        if valid_adv.numel():
            metrics.update({"advantages/mean": float(valid_adv.mean()), "advantages/min": float(valid_adv.min()),
                            "advantages/max": float(valid_adv.max())})

        tick = time.perf_counter()
        metrics.update(self.policy.train(batch, self.loss_fn))
        timings["train"] = time.perf_counter() - tick

        tick = time.perf_counter()
        self.weight_sync.sync_weights(self.policy, self.generation, version=self.step + 1)
        timings["weight_sync"] = time.perf_counter() - tick
        timings["step"] = time.perf_counter() - start
        metrics.update({f"timing/{k}": v for k, v in timings.items()})
        metrics["perf/tokens_per_sec"] = metrics["generated_tokens"] / timings["step"]
        metrics["perf/rollout_tokens_per_sec"] = metrics["generated_tokens"] / timings["rollout"]
        return metrics, samples

    # --- the run --------------------------------------------------------------------------------

    def train(self, on_step: Callable[[int, dict[str, float]], None] | None = None) -> RunSummary:
        cfg = self.config
        hooks = self.registry.host
        start = time.perf_counter()
        rewards: list[float] = []
        samples: list[dict[str, Any]] = []
        hooks.run_start(run=self)
        status, error = "failed", None
        try:
            while self.step < cfg.grpo.max_num_steps and self.prompts.epoch < cfg.grpo.max_num_epochs:
                try:
                    metrics, samples = self.train_step()
                except NonFiniteError as exc:
                    raise NonFiniteError(f"step {self.step + 1}: {exc}") from exc
                self.step += 1
                rewards.append(metrics["reward/mean"])
                for logger in self.loggers:
                    logger.log_metrics(self.step, metrics)
                hooks.step_end(run=self, step=self.step, metrics=metrics)
                if on_step is not None:
                    on_step(self.step, metrics)
            checkpoint = self.save_final_checkpoint() if cfg.checkpointing.enabled else None
            status = "completed"
        except KeyboardInterrupt as exc:
            status, error = "interrupted", exc
            raise
        except BaseException as exc:
            error = exc
            raise
        finally:
            for logger in self.loggers:
                logger.close()
            hooks.run_end(run=self, status=status, error=error)
        tail = rewards[-10:]
        summary = RunSummary(steps=self.step, seconds=time.perf_counter() - start,
                             reward_first=rewards[0] if rewards else float("nan"),
                             reward_last=sum(tail) / len(tail) if tail else float("nan"),
                             run_dir=self.run_dir, checkpoint=checkpoint, example=samples[0] if samples else None)
        (self.run_dir / "summary.json").write_text(json.dumps(summary.to_json(), indent=2) + "\n")
        return summary

    def save_final_checkpoint(self) -> Path:
        base = Path(self.config.checkpointing.checkpoint_dir or self.run_dir / "checkpoints")
        final = base / f"step_{self.step}"
        partial = base / f".step_{self.step}.partial"  # renamed only once complete
        partial.mkdir(parents=True, exist_ok=True)
        self.policy.save_checkpoint(str(partial))
        self.tokenizer.save_pretrained(str(partial))
        partial.rename(final)
        self.registry.host.checkpoint_saved(run=self, step=self.step, path=str(final))
        return final

    def shutdown(self) -> None:
        for component in ("generation", "policy"):
            obj = getattr(self, component, None)
            if obj is not None:
                obj.shutdown()
