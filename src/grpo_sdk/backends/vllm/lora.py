"""Adapter-only weight sync into vLLM (``policy.lora.sync=adapter``, the ``lora_adapters`` capability).

vLLM 0.32 loads a LoRA adapter from a directory in peft's format (``LoRARequest(name, id, path)``);
it has no public way to take one from tensors. So each weight version's adapter tensors (peft's
file names, from the hf policy's ``named_weights``) are written to a directory of their own with
an ``adapter_config.json`` built from ``policy.lora`` (rank, alpha, the adapted module names read
off the tensors), registered with ``add_lora`` under a new id, and the previous one is removed from
the engine and the disk: one adapter is resident at a time, so memory stays bounded. Generation
requests carry the current version's ``LoRARequest``; before the first sync (version 0: B is zero,
the adapter is the identity) they carry none.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator

import torch

from grpo_sdk.plugins import ConfigError, PluginError

if TYPE_CHECKING:
    from grpo_sdk.plugins.toolkit import MasterConfig

# vLLM's LoRAConfig accepts these max_lora_rank values only (vllm/config/lora.py, MaxLoRARanks).
VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def uses_adapters(config: MasterConfig) -> bool:
    """Whether the run syncs adapters only (policy.lora enabled with sync=adapter)."""
    return bool(config.policy.lora.enabled and config.policy.lora.sync == "adapter")


def max_lora_rank(rank: int) -> int:
    """The smallest rank vLLM accepts that holds ``rank`` (the config check refuses a larger one)."""
    return next(r for r in VLLM_RANKS if r >= rank)


def engine_args(config: MasterConfig) -> dict[str, Any]:
    """The engine's LoRA arguments: one adapter slot, sized for ``policy.lora.rank``."""
    return dict(enable_lora=True, max_lora_rank=max_lora_rank(config.policy.lora.rank), max_loras=1)


@contextlib.contextmanager
def model_support() -> Iterator[None]:
    """vLLM refuses LoRA for a model class without ``SupportsLoRA`` (GPT-2) when the engine loads it
    (``ValueError: GPT2LMHeadModel does not support LoRA yet``); that is the config's problem."""
    try:
        yield
    except ValueError as exc:
        if "does not support LoRA" not in str(exc):
            raise
        raise ConfigError([("policy.lora.sync", f"'adapter' needs a model vLLM applies LoRA adapters to, and vLLM "
                            f"says: {exc} Use policy.lora.sync=merged (merged weights work with every model)")]
                          ) from exc


class AdapterSlot:
    """The engine's one adapter: a directory per weight version, the current ``LoRARequest``."""

    def __init__(self, engine: Any, config: MasterConfig):
        self.engine, self.lora = engine, config.policy.lora
        self.root = Path(tempfile.mkdtemp(prefix="grpo-vllm-lora-"))
        self.request: Any = None

    def load(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        state = {name: tensor.detach().to("cpu").contiguous() for name, tensor in weights}
        modules = sorted({name.rsplit(".", 3)[-3] for name in state if ".lora_A." in name})
        if not modules or any(".lora_A." not in n and ".lora_B." not in n for n in state):
            raise PluginError("policy.lora.sync=adapter: the weights to load are not LoRA adapter tensors "
                              f"(peft's base_model.model.X.lora_A.weight names), e.g. {sorted(state)[:3]}")
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        directory = self.root / f"v{version}"
        directory.mkdir()
        save_file(state, str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})
        (directory / "adapter_config.json").write_text(json.dumps(dict(
            peft_type="LORA", task_type="CAUSAL_LM", r=self.lora.rank, lora_alpha=self.lora.alpha,
            target_modules=modules, bias="none", fan_in_fan_out=False, use_rslora=False, use_dora=False)))
        # The id must be new for every version (vLLM caches adapters by id); ids start at 1.
        request = LoRARequest(f"grpo-v{version}", version + 1, str(directory))
        self.engine.add_lora(request)
        previous, self.request = self.request, request
        if previous is not None:
            self.engine.remove_lora(previous.lora_int_id)
            shutil.rmtree(previous.lora_path, ignore_errors=True)

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
