"""The contract kit's training check: ``run_training`` trains the built-in recipe through the real
``GRPOTrainer`` with the component selected, then probes the weight sync (see its docstring).

A module of its own because it is the one check that runs the trainer (lazily imported: importing
the kit imports no torch), with the probe that only it needs. ``grpo_sdk.testing`` re-exports
``run_training``.
"""

from __future__ import annotations

import inspect
import math
import tempfile
from pathlib import Path
from typing import Any, Sequence

from grpo_sdk.core.errors import GrpoSdkError
from grpo_sdk.plugins.registry import KIND_LABELS, Registry
from grpo_sdk.testing.checks import PROTOCOLS, ContractError, _label, _selector_override, check_spec

# The run ``run_training`` makes: the built-in recipe, small, on the CPU, with nothing but training.
SMALL_RUN = (
    "grpo.num_prompts_per_step=4",
    "grpo.num_generations_per_prompt=4",
    "grpo.val_period=0",
    "grpo.val_at_start=false",
    "grpo.val_at_end=false",
    "checkpointing.enabled=false",
    "cluster.runtime=local",
    "cluster.device=cpu",
)

# What a step may leave non-finite: the min or max over an empty set.
_EXTREMES = ("_min", "_max")

# The weight-sync probe: how far it moves the policy (in token_mult_prob_error, as a multiple of
# the logprob tolerance, so a stale backend is well outside it) and how many optimizer steps it
# may take to get there.
PROBE_MARGIN = 3.0
PROBE_MAX_STEPS = 32


def run_training(kind: str, name: str, overrides: Sequence[str] = (), *, steps: int = 2,
                 registry: Registry | None = None, run_dir: str | Path | None = None,
                 model_dir: str | Path | None = None, logprob_tolerance: float | None = 0.01
                 ) -> list[dict[str, float]]:
    """Train ``steps`` steps of the built-in recipe through the real ``GRPOTrainer`` with the
    component selected, then probe the weight sync; returns each step's metrics (with ``"step"``).

    The run: tiny GPT-2 (``model_dir``, or built into the run directory), reverse digits, 4
    prompts x 4 generations, no validation, no checkpoints, on the CPU; then ``overrides``. A
    logger joins the recipe's ``jsonl`` logger. Fails when setup or a step raises, when the
    component was not the one the run used, when a metric is not finite, or when generation did
    not sample with the last synced weights: from step 2 on, ``generation/weight_version`` must
    be the previous step and ``token_mult_prob_error`` within ``logprob_tolerance`` of 1 (None
    skips this and the probe; a bf16 inference engine may need more than the default 0.01).

    The probe does not trust the run to have changed the weights (when every step-1 reward is 0,
    every advantage is 0 and no weight moves, so a backend that ignores ``update_weights`` would
    still agree with the policy). It samples the next prompts, trains the policy on them with
    advantage -1 on every generated token until its logprobs of those tokens have moved by
    ``PROBE_MARGIN`` x ``logprob_tolerance`` (in token_mult_prob_error), syncs the weights through
    the run's transport as version ``steps + 1``, samples again, and requires the generation
    backend to report that version and logprobs within ``logprob_tolerance`` of the policy's.
    """
    from grpo_sdk.config.loading import load_config
    from grpo_sdk.trainer.trainer import GRPOTrainer

    label = _label(kind, name)
    registry = registry or Registry.discover()
    check_spec(kind, name, registry=registry)
    model = [f"policy.model_name={model_dir}"] if model_dir is not None else []
    try:
        cfg = load_config(None, [*SMALL_RUN, f"grpo.max_num_steps={steps}", *model, _selector_override(kind, name),
                                 *overrides], registry)
    except GrpoSdkError as exc:
        raise ContractError(f"the training config for {label} does not load:\n{exc}") from None

    with tempfile.TemporaryDirectory(prefix="grpo-contract-") as scratch:
        trainer = GRPOTrainer(cfg, run_dir=Path(run_dir) if run_dir is not None else Path(scratch) / "run",
                              registry=registry)
        rows: list[dict[str, float]] = []
        phase = "setup"
        try:
            trainer.setup()
            _check_built(trainer, kind, name, registry)
            phase = "training"
            trainer.train(on_step=lambda step, metrics: rows.append({"step": step, **metrics}))
            _check_metrics(rows, label, steps, logprob_tolerance)
            if logprob_tolerance is not None:
                phase = "the weight-sync probe"
                _probe_weight_sync(trainer, label, steps + 1, logprob_tolerance)
        except ContractError:
            raise
        except BaseException as exc:  # noqa: BLE001 - whatever the component raised is the finding
            if isinstance(exc, KeyboardInterrupt):
                raise
            where = {"setup": "in setup", "training": f"in step {len(rows) + 1}"}.get(phase, f"in {phase}")
            raise ContractError(f"training with {label} failed {where}: {type(exc).__name__}: {exc}") from exc
        finally:
            trainer.shutdown()
    return rows


def _check_built(trainer: Any, kind: str, name: str, registry: Registry) -> None:
    """The run built the component under test (seen through the local runtime's deadline wrapper)."""
    impl = registry.load_impl(kind, name)
    parts = trainer.components
    built = parts.loggers if kind == "logger" else [getattr(parts, kind)]  # the record names them by kind
    from grpo_sdk.runtime.deadlines import EnvironmentDeadline

    built = [obj.component if isinstance(obj, EnvironmentDeadline) else obj for obj in built]
    if inspect.isclass(impl) and not any(isinstance(obj, impl) for obj in built):
        raise ContractError(f"the run did not use {_label(kind, name)}: it built {[type(o).__name__ for o in built]}; "
                    f"do the overrides select another {KIND_LABELS[kind]}?")
    protocol = PROTOCOLS[kind]
    for obj in built:
        if isinstance(obj, impl) and not isinstance(obj, protocol):
            raise ContractError(f"the {type(obj).__name__} instance is not a {protocol.__name__} (isinstance check)")


def _check_metrics(rows: list[dict[str, float]], label: str, steps: int, tolerance: float | None) -> None:
    if len(rows) != steps:
        raise ContractError(f"training with {label} logged {len(rows)} steps, expected {steps}")
    for row in rows:
        bad = {k: v for k, v in row.items()
               if not k.endswith(_EXTREMES) and isinstance(v, (int, float)) and not math.isfinite(v)}
        if bad:
            listed = ", ".join(f"{k}={v}" for k, v in sorted(bad.items()))
            raise ContractError(f"training with {label}: non-finite metrics in step {row['step']}: {listed}")
    for row in rows[1:]:
        step = row["step"]
        version = row.get("generation/weight_version")
        if version is not None and version != step - 1:
            raise ContractError(f"training with {label}: step {step} sampled with weight version {version:g}, but version "
                        f"{step - 1} was synced after step {step - 1}. A generation backend reports the version of "
                        "its last update_weights(..., version=) in GenerationOutput.weight_version; a weight-sync "
                        "transport passes version= through")
        error = row.get("token_mult_prob_error")
        if tolerance is not None and error is not None and abs(error - 1.0) > tolerance:
            raise ContractError(f"training with {label}: token_mult_prob_error is {error:.4f} in step {step} (allowed: 1 "
                        f"+- {tolerance}): generation's logprobs disagree with the policy's for the sampled tokens. "
                        "Either generation does not report the logprob of each token under the distribution it was "
                        "sampled from (temperature, top-k, top-p applied), or it did not sample with the weights of "
                        "the last sync (update_weights / sync_weights)")


def _mult_prob_error(a: Any, b: Any, mask: Any) -> float:
    """Mean of exp(|a - b|) over ``mask`` (the loss's token_mult_prob_error)."""
    mask = mask.float().cpu()
    diff = (a.float().cpu() - b.float().cpu()).abs().exp()
    return float((diff * mask).sum() / mask.sum().clamp(min=1))


def _probe_weight_sync(trainer: Any, label: str, version: int, tolerance: float) -> dict[str, float]:
    """Move the policy for certain, sync, and check generation samples under the new weights (see
    ``run_training``). Talks to the built components through their protocols only; takes the run's
    prompt source, tokenizer and sampling parameters from ``trainer.components``."""
    import torch

    from grpo_sdk.algorithms.loss import ClippedPGLoss
    from grpo_sdk.config.schema import LossConfig
    from grpo_sdk.core.records import GenerationInput, TrainBatch
    from grpo_sdk.plugins.tensors import left_pad
    from grpo_sdk.rollouts.rollout import tokenize_prompts

    cfg, parts = trainer.config, trainer.components
    policy, generation, G = parts.policy, parts.generation, cfg.grpo.num_generations_per_prompt
    prompts = parts.prompts.next_prompts(cfg.grpo.num_prompts_per_step)
    rows = [ids for ids in tokenize_prompts(parts.tokenizer, prompts, parts.max_prompt_tokens) for _ in range(G)]
    input_ids, attention_mask = left_pad(rows, parts.tokenizer.pad_token_id)
    inputs = GenerationInput(input_ids=input_ids, attention_mask=attention_mask)

    def sample() -> tuple[int, TrainBatch]:
        generation.prepare_for_generation()
        try:
            out = generation.generate(inputs, parts.sampling)
        finally:
            generation.finish_generation()
        width = out.response_ids.shape[1]
        response_mask = (torch.arange(width)[None] < out.response_lengths.cpu()[:, None]).long()
        token_mask = torch.cat([torch.zeros_like(input_ids), response_mask], 1).float()
        return out.weight_version, TrainBatch(
            input_ids=torch.cat([input_ids, out.response_ids.cpu()], 1),
            attention_mask=torch.cat([attention_mask, response_mask], 1), token_mask=token_mask,
            sample_mask=torch.ones(len(rows)),
            generation_logprobs=torch.cat([torch.zeros(input_ids.shape), out.logprobs.float().cpu()], 1),
            group_ids=torch.arange(len(prompts)).repeat_interleave(G), rewards=torch.zeros(len(rows)),
            advantages=-token_mask)  # -1 on every generated token: the policy makes them less likely

    # 1. Move the policy: a fixed advantage gives a gradient whatever the rewards were. Negative, so
    # the sampled tokens lose probability: at a low temperature they are near certain, and making
    # them more likely would not move their logprobs.
    _, batch = sample()
    before = policy.logprobs(batch)
    loss_fn = ClippedPGLoss(LossConfig(reference_policy_kl_penalty=0.0))
    floor = 1.0 + PROBE_MARGIN * tolerance
    moved, nudges = 1.0, 0
    while moved < floor and nudges < PROBE_MAX_STEPS:
        policy.train(batch, loss_fn)
        nudges += 1
        moved = _mult_prob_error(policy.logprobs(batch), before, batch.token_mask)
    if moved < floor:
        optimizer = cfg.policy.optimizer
        raise ContractError(
            f"training with {label}: the weight-sync probe trained the policy {nudges} times with advantage -1 on "
            f"every sampled token and its logprobs of those tokens moved by only {moved:.4f} (token_mult_prob_error "
            f"against the logprobs before; needed: {floor:.4f}). "
            + ("policy.train changes no weight: it must take an optimizer step on the loss it is given"
               if moved == 1.0 else
               f"Raise policy.optimizer.lr (now {optimizer.lr:g}) in the component's overrides, or check "
               "policy.scheduler (the probe trains after the run's last step)"))

    # 2. Sync through the run's transport; generation must now sample with the moved weights.
    parts.weight_sync.sync_weights(policy, generation, version=version)
    reported, batch = sample()
    if reported != version:
        raise ContractError(f"training with {label}: after the weight sync of version {version}, generation reported "
                            f"weight version {reported} (GenerationOutput.weight_version must be the version= of its "
                            "last update_weights)")
    error = _mult_prob_error(batch.generation_logprobs, policy.logprobs(batch), batch.token_mask)
    if abs(error - 1.0) > tolerance:
        raise ContractError(
            f"training with {label}: generation does not sample with the synced weights. The probe moved the policy "
            f"(its logprobs of sampled tokens changed by {moved:.4f} in token_mult_prob_error), synced version "
            f"{version}, and generation, though it reports version {reported}, gives the tokens it samples logprobs "
            f"that disagree with the policy's: token_mult_prob_error {error:.4f} (allowed: 1 +- {tolerance}). "
            "update_weights(weights, version=) must load every (name, tensor) it is given before it returns; a "
            "backend that talks to a server must have the server load them (docs/plugins.md, out-of-process "
            "backends)")
    return {"probe/policy_moved": moved, "probe/optimizer_steps": float(nudges),
            "generation/weight_version": float(reported), "token_mult_prob_error": error}
