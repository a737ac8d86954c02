"""hf policy: logprobs, a frozen reference copy, and optimizer steps over micro-batches.

One GRPO step's rows are split into global batches of ``policy.train_global_batch_size`` rows
(one optimizer step each), and each global batch into micro-batches of
``policy.train_micro_batch_size`` rows whose gradients accumulate. The loss function divides by
token and sequence counts of the whole global batch, so the accumulated gradient does not depend
on the micro-batch size.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Iterator

import torch
from safetensors.torch import load_file, save_file

from grpo_sdk.backends.hf.config import HFPolicyConfig
from grpo_sdk.backends.hf.loading import load_model, sequence_logprobs
from grpo_sdk.core.context import RunContext
from grpo_sdk.core.errors import NonFiniteError
from grpo_sdk.core.metrics import average_optimizer_steps, sum_micro_batches
from grpo_sdk.core.protocols import LossFunction
from grpo_sdk.core.records import TrainBatch


def lr_lambda(step: int, *, warmup_steps: int, total_steps: int, schedule: str, min_lr_ratio: float) -> float:
    """Multiplier of the peak lr at optimizer step ``step`` (0-based)."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if schedule == "linear":
        return 1.0 - (1.0 - min_lr_ratio) * progress
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class HFPolicy:
    def __init__(self, config: HFPolicyConfig | None, context: RunContext):
        config = config or HFPolicyConfig()
        cfg = context.config
        self.policy_cfg = cfg.policy
        self.device = torch.device(context.device)
        self.model = load_model(context.model_path, dtype=cfg.policy.precision, device=context.device,
                                attn_implementation=config.attn_implementation)
        if config.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        self.reference = None
        if context.needs_reference:
            self.reference = copy.deepcopy(self.model).requires_grad_(False)
        gen = cfg.policy.generation
        self.sampling = {"temperature": gen.temperature, "top_k": gen.top_k, "top_p": gen.top_p}
        # With top-k/top-p the KL term uses the unfiltered distribution (a filtered token is -inf).
        filtered = bool(gen.top_k) or gen.top_p < 1.0
        self.kl_needs_unfiltered = filtered and cfg.loss_fn.reference_policy_kl_penalty > 0
        opt = cfg.policy.optimizer
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        # The fused kernel (CPU and CUDA) is ~2.5x faster than the per-tensor loop on small models.
        self.optimizer = torch.optim.AdamW(self.params, lr=opt.lr, betas=tuple(opt.betas), eps=opt.eps,
                                           weight_decay=opt.weight_decay, fused=True)
        rows = cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt
        steps_per_grpo_step = rows // (cfg.policy.train_global_batch_size or rows)
        sched = cfg.policy.scheduler
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: lr_lambda(
            s, warmup_steps=sched.warmup_steps, total_steps=cfg.grpo.max_num_steps * steps_per_grpo_step,
            schedule=sched.name, min_lr_ratio=sched.min_lr_ratio))
        self.optimizer_steps = 0
        self.save_optimizer = cfg.checkpointing.save_optimizer

    # --- logprobs -------------------------------------------------------------------------------

    @torch.no_grad()
    def _logprobs(self, model, batch: TrainBatch) -> torch.Tensor:
        size = self.policy_cfg.logprob_batch_size
        chunks = [sequence_logprobs(model, batch.input_ids[i:i + size].to(self.device),
                                    batch.attention_mask[i:i + size].to(self.device), **self.sampling)
                  for i in range(0, batch.batch_size, size)]
        return torch.cat(chunks).cpu()

    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        return self._logprobs(self.model, batch)

    def reference_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        if self.reference is None:
            raise RuntimeError("reference_logprobs needs loss_fn.reference_policy_kl_penalty > 0")
        return self._logprobs(self.reference, batch)

    # --- training -------------------------------------------------------------------------------

    def train(self, batch: TrainBatch, loss_fn: LossFunction) -> dict[str, float]:
        rows = batch.batch_size
        global_rows = self.policy_cfg.train_global_batch_size or rows
        micro_rows = self.policy_cfg.train_micro_batch_size
        step_metrics = []
        for start in range(0, rows, global_rows):
            global_batch = batch.rows(start, start + global_rows)
            token_mask = global_batch.token_mask[:, 1:] * global_batch.sample_mask[:, None]
            valid_toks, valid_seqs = token_mask.sum(), global_batch.sample_mask.sum()
            self.optimizer.zero_grad(set_to_none=True)
            micro_metrics = []
            for micro_start in range(0, global_batch.batch_size, micro_rows):
                micro = global_batch.rows(micro_start, micro_start + micro_rows)
                micro = micro.to(self.device)
                extra = {}
                logprobs = sequence_logprobs(self.model, micro.input_ids, micro.attention_mask, **self.sampling,
                                             with_unfiltered=self.kl_needs_unfiltered)
                if self.kl_needs_unfiltered:
                    logprobs, extra["unfiltered_logprobs"] = logprobs
                loss, metrics = loss_fn(logprobs, micro, global_valid_seqs=valid_seqs, global_valid_toks=valid_toks,
                                        **extra)
                if not torch.isfinite(loss):
                    raise NonFiniteError(f"loss is {loss.item()} in optimizer step {self.optimizer_steps + 1}, "
                                         f"rows {start + micro_start}..{start + micro_start + micro.batch_size - 1}")
                loss.backward()
                micro_metrics.append(metrics)
            if getattr(loss_fn, "requires_survivor_normalization", False):
                # The in-loss logprob-error filter divided by the original counts; only now, after
                # every micro-batch, are the surviving counts known.
                factor, micro_metrics = loss_fn.survivor_normalization(
                    micro_metrics, global_valid_seqs=float(valid_seqs), global_valid_toks=float(valid_toks))
                for param in self.params:
                    if param.grad is not None:
                        param.grad.mul_(factor)
            grad_norm = self._clip_and_check_gradients()
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer_steps += 1
            step_metrics.append({**sum_micro_batches(micro_metrics), "grad_norm": grad_norm})
        return {**average_optimizer_steps(step_metrics), "lr": self.scheduler.get_last_lr()[0]}

    def _clip_and_check_gradients(self) -> float:
        max_norm = self.policy_cfg.max_grad_norm
        norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm if max_norm is not None else float("inf"))
        if not torch.isfinite(norm):
            bad = next((name for name, p in self.model.named_parameters()
                        if p.grad is not None and not torch.isfinite(p.grad).all()), "?")
            raise NonFiniteError(f"gradient norm is {norm.item()} in optimizer step {self.optimizer_steps + 1} "
                                 f"(first non-finite gradient: {bad})")
        return float(norm)

    # --- weights and state ----------------------------------------------------------------------

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.model.state_dict().items()

    def save_checkpoint(self, path: str) -> None:
        """A Hugging Face model directory, plus the optimizer and LR-schedule state next to it."""
        directory = Path(path)
        self.model.save_pretrained(directory, safe_serialization=True)
        if self.save_optimizer:
            tensors, meta = _flatten_optimizer_state(self.optimizer.state_dict())
            save_file(tensors, str(directory / "optimizer.safetensors"))
            meta["scheduler"] = self.scheduler.state_dict()
            meta["optimizer_steps"] = self.optimizer_steps
            (directory / "optimizer.json").write_text(json.dumps(meta))

    def load_checkpoint(self, path: str) -> None:
        directory = Path(path)
        state = load_file(str(directory / "model.safetensors"), device=str(self.device))
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        tied = set(getattr(self.model, "_tied_weights_keys", None) or ())
        if unexpected or set(missing) - tied:
            raise RuntimeError(f"checkpoint {path} does not match the model: missing {missing}, unexpected {unexpected}")
        if (directory / "optimizer.json").is_file():
            meta = json.loads((directory / "optimizer.json").read_text())
            tensors = load_file(str(directory / "optimizer.safetensors"), device=str(self.device))
            self.optimizer.load_state_dict(_unflatten_optimizer_state(tensors, meta))
            self.scheduler.load_state_dict(meta["scheduler"])
            self.optimizer_steps = meta["optimizer_steps"]

    def offload(self) -> None:
        self.model.to("cpu")

    def onload(self) -> None:
        self.model.to(self.device)

    def shutdown(self) -> None:
        self.model = self.reference = None
        self.optimizer = None



def _flatten_optimizer_state(state: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """Optimizer state as safetensors tensors plus JSON (no pickle): ``state.<param>.<name>``."""
    tensors, scalars = {}, {}
    for index, values in state["state"].items():
        for name, value in values.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state.{index}.{name}"] = value.contiguous()
            else:
                scalars[f"{index}.{name}"] = value
    return tensors, {"param_groups": state["param_groups"], "scalars": scalars}


def _unflatten_optimizer_state(tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    state: dict[int, dict] = {}
    for key, value in tensors.items():
        _, index, name = key.split(".", 2)
        state.setdefault(int(index), {})[name] = value
    for key, value in meta["scalars"].items():
        index, name = key.split(".", 1)
        state.setdefault(int(index), {})[name] = value
    return {"state": state, "param_groups": meta["param_groups"]}
