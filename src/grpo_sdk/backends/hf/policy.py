"""hf policy: logprobs, a frozen reference copy, and optimizer steps over micro-batches.

With ``policy.lora.enabled`` the model carries peft LoRA adapters (``grpo_sdk.backends.hf.lora``):
the optimizer holds the adapters only, the reference is the same model with its adapters disabled
(no copy), ``named_weights`` yields merged weights under the base names, and checkpoints hold the
adapters only.

One GRPO step's rows are split into global batches of ``policy.train_global_batch_size`` rows
(one optimizer step each), and each global batch into micro-batches of
``policy.train_micro_batch_size`` rows whose gradients accumulate, or, with
``policy.dynamic_batching`` / ``policy.sequence_packing``, into micro-batches by token budget
without padding (``packing``). The loss function divides by token and sequence counts of the
whole global batch, so the accumulated gradient does not depend on how the rows are split. That
loop, its normalisation and clipping, and the optimizer are ``grpo_sdk.plugins.training``'s, which the
megatron policy runs too; this module supplies the logprobs, the micro-batch plan and FSDP. Logprobs
are computed at response positions only, in chunks (``forward``).

With ``context.world_size > 1`` the policy is one rank of a data-parallel group: the model is
sharded with FSDP2 and each rank trains on its share of every global batch
(``grpo_sdk.backends.hf.distributed`` has the contract with the runtime). Results are the
single-process results, on every rank.
"""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path
from typing import Iterator

import torch
from safetensors.torch import load_file, save_file

from grpo_sdk.backends.hf import distributed, lora
from grpo_sdk.backends.hf.config import HFPolicyConfig
from grpo_sdk.backends.hf.forward import sequence_logprobs
from grpo_sdk.backends.hf.loading import autocast_context, enable_activation_checkpointing, load_model
from grpo_sdk.backends.hf.packing import padding_free_logprobs, plan, spans
from grpo_sdk.plugins import LossFunction, RunContext, TrainBatch
from grpo_sdk.plugins.toolkit import forget_policy, publish_policy, published_policy
from grpo_sdk.plugins.training import (all_gather_rows, all_reduce_metrics, any_rank, broadcast_json, make_optimizer,
                                       max_over_ranks, row_share, select_rows, train_global_batches)


class HFPolicy:
    def __init__(self, config: HFPolicyConfig | None, context: RunContext):
        config = config or HFPolicyConfig()
        cfg = context.config
        self.policy_cfg = cfg.policy
        self.device = torch.device(context.device)
        self.rank, self.dp = context.rank, context.world_size > 1
        if self.dp:
            distributed.check_process_group(context.rank, context.world_size)
        # Data-parallel ranks load on the CPU: fully_shard moves each block to the device as it
        # shards it, so no rank holds the whole model on the accelerator.
        self.model = load_model(context.model_path, dtype=cfg.policy.precision,
                                device="cpu" if self.dp else context.device,
                                attn_implementation=config.attn_implementation)
        if config.gradient_checkpointing:
            enable_activation_checkpointing(self.model)
        # Every forward pass of the policy and the reference (not the loss, not the backward) runs in it.
        self.autocast = autocast_context(self.device, config.autocast)
        self.skip_zero_advantage_rows = config.skip_zero_advantage_rows and not self.dp
        self.reference = self.lora = None
        self.lora_sync = cfg.policy.lora.sync  # what named_weights sends: merged weights, or the adapters only
        if cfg.policy.lora.enabled:
            # Adapters injected in place: self.model stays the module trained, sharded and saved.
            # The reference is this model with its adapters disabled, so there is no copy to make.
            self.lora = lora.apply(self.model, cfg.policy.lora, seed=context.seed)
        elif context.needs_reference:
            self.reference = copy.deepcopy(self.model).requires_grad_(False)
        if self.dp:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh(self.device.type, (context.world_size,))
            distributed.shard(self.model, mesh)
            if self.reference is not None:
                # Sharded too, though frozen: a replica would cost every rank the whole model's
                # memory again; its forward passes gather one block at a time like the policy's.
                distributed.shard(self.reference, mesh)
        gen = cfg.policy.generation
        self.sampling = {"temperature": gen.temperature, "top_k": gen.top_k, "top_p": gen.top_p}
        # With top-k/top-p the KL term uses the unfiltered distribution (a filtered token is -inf).
        filtered = bool(gen.top_k) or gen.top_p < 1.0
        self.kl_needs_unfiltered = filtered and cfg.loss_fn.reference_policy_kl_penalty > 0
        self.chunk_size = cfg.policy.logprob_chunk_size
        self.batching = _batching(cfg.policy)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer, self.scheduler = make_optimizer(self.params, cfg)
        self.optimizer_steps = 0
        self.save_optimizer = cfg.checkpointing.save_optimizer
        # An hf generation of this process may sample with self.model (published_policy); it then sets
        # this, and offload() keeps the model where the generation needs it.
        self.shared_with_generation = False
        self.context = context
        publish_policy(context, self)

    # --- logprobs -------------------------------------------------------------------------------

    @torch.no_grad()
    def _logprobs(self, model, batch: TrainBatch) -> torch.Tensor:
        if self.dp:  # this rank's equal share, so every rank runs the same number of chunks
            batch = batch.rows(*row_share(batch.batch_size, "policy logprobs"))
        logprobs = torch.zeros(batch.input_ids.shape)
        for rows in self._micro_batches(batch, self.policy_cfg.logprob_batch_size, "logprob_mb_tokens"):
            if rows is None:  # a data-parallel rank with fewer micro-batches keeps FSDP's collectives in step
                self._idle_forward(model, batch)
                continue
            micro = select_rows(batch, rows).to(self.device)
            logprobs[rows] = self._micro_logprobs(model, micro).cpu()
        return (all_gather_rows(logprobs.to(self.device)) if self.dp else logprobs).cpu()

    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        return self._logprobs(self.model, batch)

    def reference_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        if self.lora is not None:  # the frozen base: the same module, adapters off
            with self.lora.disable_adapter():
                return self._logprobs(self.model, batch)
        if self.reference is None:
            raise RuntimeError("reference_logprobs needs loss_fn.reference_policy_kl_penalty > 0")
        return self._logprobs(self.reference, batch)

    # --- training -------------------------------------------------------------------------------

    def train(self, batch: TrainBatch, loss_fn: LossFunction) -> dict[str, float]:
        micro_rows = self.policy_cfg.train_micro_batch_size
        return train_global_batches(
            self, batch, loss_fn, logprobs=functools.partial(self._micro_logprobs, self.model),
            row_share=row_share if self.dp else None, reduce=self._reduce if self.dp else None,
            micro_batches=lambda global_batch, rows: self._micro_batches(global_batch, micro_rows, "train_mb_tokens",
                                                                         rows=rows),
            idle_loss=functools.partial(self._idle_forward, self.model),
            skip_zero_advantage_rows=self.skip_zero_advantage_rows)

    def _reduce(self, metrics: dict[str, float], failed: bool) -> tuple[dict[str, float], bool]:
        # FSDP has summed the gradients already, in the backward passes.
        return all_reduce_metrics(metrics, failed, self.device, who="hf policy")

    def _micro_batches(self, batch: TrainBatch, rows_each: int, budget_key: str,
                       rows: list[int] | None = None) -> list[list[int] | None]:
        """Row indices of each micro-batch (of ``rows``, default all): ``rows_each`` rows at a time, or by
        token budget (dynamic batching, packing). Data-parallel ranks whose budgets give fewer
        micro-batches than another rank's get ``None`` entries (an idle forward) up to the largest count."""
        rows = list(range(batch.batch_size)) if rows is None else rows
        if self.batching is None:
            micro = [rows[i:i + rows_each] for i in range(0, len(rows), rows_each)]
        else:
            key = f"policy.{self.batching['name']}.{budget_key}"
            _, lengths = spans(batch.attention_mask, key)
            planned = plan([lengths[r] for r in rows], self.batching[budget_key], self.batching["round"],
                           pack=self.batching["pack"], key=key)
            micro = [[rows[i] for i in group] for group in planned]
        if self.dp and self.batching is not None:  # fixed row counts are equal on every rank already
            micro += [None] * (max_over_ranks(len(micro), self.device) - len(micro))
        return micro

    def _micro_logprobs(self, model, micro: TrainBatch, with_unfiltered: bool = False):
        forward = {**self._forward_args(), "with_unfiltered": with_unfiltered}
        with self.autocast():
            if self.batching is None:
                return sequence_logprobs(model, micro.input_ids, micro.attention_mask, token_mask=micro.token_mask,
                                         **forward)
            return padding_free_logprobs(model, micro.input_ids, micro.attention_mask, micro.token_mask,
                                         pack=self.batching["pack"], round_to=self.batching["round"],
                                         key=f"policy.{self.batching['name']}.enabled", **forward)

    def _idle_forward(self, model, batch: TrainBatch) -> torch.Tensor:
        """A one-token forward pass scoring nothing: 0, with a (zero) gradient for every parameter."""
        ids = batch.input_ids[:1, :1].to(self.device)
        with self.autocast():
            return sequence_logprobs(model, ids, torch.ones_like(ids), token_mask=torch.zeros_like(ids),
                                     **self._forward_args()).sum()

    def _forward_args(self) -> dict:
        # Read at each call: self.sampling is the one source of the sampling settings.
        return {**self.sampling, "chunk_size": self.chunk_size}

    # --- weights and state ----------------------------------------------------------------------

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        # Whole tensors; data-parallel: gathered one by one, so every rank must drain this iterator.
        named = distributed.full_weights(self.model) if self.dp else self.model.state_dict().items()
        if self.lora is not None and self.lora_sync == "adapter":  # A and B only, peft's file names
            named = lora.adapter_weights(named)
        elif self.lora is not None:  # the base model's names, adapters folded in (policy.lora.sync=merged)
            named = lora.merged_weights(named, lora.lora_layers(self.model))
        yield from named

    def save_checkpoint(self, path: str) -> None:
        """A Hugging Face model directory (with LoRA: peft's adapter directory), plus the optimizer and
        LR-schedule state next to it.

        Data-parallel: every rank calls it; rank 0 writes the same files as one process would
        (whole tensors), the others write nothing; every rank returns once the files are written.
        """
        if not self.dp:
            self._write_checkpoint(Path(path), None, self.optimizer.state_dict() if self.save_optimizer else None)
            return
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict)

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)  # whole tensors, on rank 0 only
        # With LoRA only the adapters are written (and so gathered): the base is the model's own files.
        model_state = get_model_state_dict(self.model, options=StateDictOptions(
            full_state_dict=True, cpu_offload=True, ignore_frozen_params=self.lora is not None))
        optim_state = (get_optimizer_state_dict(self.model, self.optimizer, options=options)
                       if self.save_optimizer else None)
        error = None
        if self.rank == 0:
            try:
                tied = set(getattr(self.model, "_tied_weights_keys", None) or ())
                for names in distributed.parameter_aliases(self.model):
                    # A tied weight is stored once, under the name save_pretrained keeps.
                    keep = next((name for name in names if name not in tied), names[0])
                    for alias in names:
                        if alias != keep:
                            model_state.pop(alias, None)
                if optim_state is not None:
                    optim_state = distributed.optimizer_state_by_index(optim_state, self._parameter_index())
                self._write_checkpoint(Path(path), model_state, optim_state)
            except Exception as exc:  # shared below, so that no rank waits for a rank that failed
                error = exc
        if any_rank(error is not None, self.device):
            raise error or RuntimeError(f"rank 0 of the policy group could not write the checkpoint {path}")

    def _write_checkpoint(self, directory: Path, model_state: dict | None, optim_state: dict | None) -> None:
        if self.lora is not None:  # peft's adapter directory, not the model: the base never changes
            state = model_state if model_state is not None else self.model.state_dict()
            lora.write_adapter(self.lora, directory, lora.adapter_state(state.items()))
        else:
            self.model.save_pretrained(directory, state_dict=model_state, safe_serialization=True)
        if optim_state is not None:
            tensors, meta = _flatten_optimizer_state(optim_state)
            save_file(tensors, str(directory / "optimizer.safetensors"))
            meta["scheduler"] = self.scheduler.state_dict()
            meta["optimizer_steps"] = self.optimizer_steps
            (directory / "optimizer.json").write_text(json.dumps(meta))

    def load_checkpoint(self, path: str) -> None:
        """Data-parallel: every rank calls it; rank 0 reads the files and sends each rank its shards."""
        if self.dp:
            self._load_sharded_checkpoint(path)
            return
        directory = Path(path)
        if self.lora is not None:
            self.model.load_state_dict(lora.read_adapter(directory, self.model, str(self.device)), strict=False)
        else:
            lora.refuse_adapter_checkpoint(directory)
            state = load_file(str(directory / "model.safetensors"), device=str(self.device))
            missing, unexpected = self.model.load_state_dict(state, strict=False)
            _check_model_keys(path, self.model, missing, unexpected)
        if (directory / "optimizer.json").is_file():
            meta = json.loads((directory / "optimizer.json").read_text())
            tensors = load_file(str(directory / "optimizer.safetensors"), device=str(self.device))
            self.optimizer.load_state_dict(_unflatten_optimizer_state(tensors, meta))
            self.scheduler.load_state_dict(meta["scheduler"])
            self.optimizer_steps = meta["optimizer_steps"]

    def _load_sharded_checkpoint(self, path: str) -> None:
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                             set_optimizer_state_dict)

        directory = Path(path)
        model_state, optim_state, header, error = {}, {}, {}, None
        if self.rank == 0:
            try:
                if self.lora is not None:  # the adapters only; strict=False below leaves the base as loaded
                    model_state = lora.read_adapter(directory, self.model)
                else:
                    lora.refuse_adapter_checkpoint(directory)
                    model_state = load_file(str(directory / "model.safetensors"))
                    for names in distributed.parameter_aliases(self.model):  # a tied weight is stored once
                        present = next((name for name in names if name in model_state), None)
                        if present is not None:
                            model_state.update(dict.fromkeys(names, model_state[present]))
                    expected = set(self.model.state_dict())
                    _check_model_keys(path, self.model, expected - set(model_state), set(model_state) - expected)
                if (directory / "optimizer.json").is_file():
                    meta = json.loads((directory / "optimizer.json").read_text())
                    optim_state = distributed.optimizer_state_by_name(_unflatten_optimizer_state(
                        load_file(str(directory / "optimizer.safetensors")), meta), self._parameter_names())
                    header = {"scheduler": meta["scheduler"], "optimizer_steps": meta["optimizer_steps"]}
            except Exception as exc:  # shared below, so that no rank waits for a rank that failed
                error, header = exc, {"error": f"{type(exc).__name__}: {exc}"}
        header = broadcast_json(header, self.device)
        if "error" in header:
            raise error or RuntimeError(f"rank 0 of the policy group could not load {path}: {header['error']}")
        # strict=False: rank 0 has checked the keys (tied names may be absent, as single-process).
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
        set_model_state_dict(self.model, model_state, options=options)
        if "scheduler" in header:
            set_optimizer_state_dict(self.model, self.optimizer, optim_state, options=options)
            self.scheduler.load_state_dict(header["scheduler"])
            self.optimizer_steps = header["optimizer_steps"]

    def _parameter_names(self) -> list[str]:
        """The name of each optimized parameter, in optimizer order (a single process's names)."""
        first = {id(p): name for name, p in self.model.named_parameters()}
        return [first[id(p)] for p in self.params]

    def _parameter_index(self) -> dict[str, int]:
        """Optimizer position of every name of every optimized parameter, tied names included."""
        position = {id(p): i for i, p in enumerate(self.params)}
        return {name: position[id(p)] for name, p in self.model.named_parameters(remove_duplicate=False)
                if id(p) in position}

    @staticmethod
    def export_merged(policy_dir: str, out: str) -> None:
        """``ExportsMergedModel``: a LoRA checkpoint (adapters only) as a standalone model directory, the
        adapters merged into the base model they were trained on (``grpoctl export --lora merged``)."""
        lora.export_merged(Path(policy_dir), Path(out))

    def offload(self) -> None:
        if self.shared_with_generation:
            return  # the generation samples with this very module next: moving it would free nothing
        self.model.to("cpu")

    def onload(self) -> None:
        self.model.to(self.device)

    def shutdown(self) -> None:
        if published_policy(self.context) is self:  # a later run in this process publishes its own
            forget_policy(self.context)
        self.model = self.reference = self.lora = None
        self.optimizer = None


def _batching(policy_cfg) -> dict | None:
    """``policy.dynamic_batching`` or ``policy.sequence_packing`` (the config check allows one), with
    null budgets resolved to NeMo-RL's defaults; None when both are off (fixed row counts)."""
    for name, pack in (("sequence_packing", True), ("dynamic_batching", False)):
        block = getattr(policy_cfg, name)
        if block.enabled:
            longest = policy_cfg.max_total_sequence_length
            return {"name": name, "pack": pack, "round": block.sequence_length_round,
                    "train_mb_tokens": block.train_mb_tokens or longest * policy_cfg.train_micro_batch_size,
                    "logprob_mb_tokens": block.logprob_mb_tokens or longest * policy_cfg.logprob_batch_size}
    return None


def _check_model_keys(path: str, model, missing, unexpected) -> None:
    tied = set(getattr(model, "_tied_weights_keys", None) or ())
    if unexpected or set(missing) - tied:
        raise RuntimeError(f"checkpoint {path} does not match the model: missing {sorted(missing)}, "
                           f"unexpected {sorted(unexpected)}")


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
