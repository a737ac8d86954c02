"""LoRA adapters for the hf policy, through peft (``policy.lora``).

The adapters are injected into the policy's own transformers model (``get_peft_model``), which
freezes every base weight: the optimizer is built over the parameters that still require grad,
so it holds the adapters only. The reference policy is that same model inside peft's
``disable_adapter()`` (the frozen base, no second copy).

Names: peft renames an adapted layer ``X`` to ``X.base_layer`` and adds ``X.lora_A.default`` /
``X.lora_B.default``. ``merged_weights`` undoes that for weight sync: it yields the base model's
Hugging Face names, with ``X.weight = W + alpha/rank * B @ A`` computed into a new tensor (the
training weights are never merged in place), so every generation backend takes them unchanged.

Checkpoints hold the adapters in peft's own layout (``adapter_model.safetensors`` +
``adapter_config.json``, what ``PeftModel.from_pretrained`` reads), never the base weights.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch
from safetensors.torch import load_file, save_file

from grpo_sdk.plugins import ConfigError, PluginError

INSTALL = "pip install 'grpo-sdk[lora]' (peft)"
ADAPTER = "default"  # peft's name of the one adapter
ADAPTER_FILE, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"


def _peft():
    try:
        import peft
    except ImportError as exc:  # the config check catches this first; a library user may not run it
        raise PluginError(f"policy.lora.enabled=true needs peft, which is not installed: {INSTALL}") from exc
    return peft


def linear_module_names(model: torch.nn.Module) -> list[str]:
    """Names of the layers LoRA can adapt: ``nn.Linear`` and GPT-2's ``Conv1D`` (a transposed linear)."""
    return [name for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D"]


def _matches(name: str, patterns: Iterable[str]) -> bool:
    """peft's rule for a list of names: the module's full name or a dotted suffix of it."""
    return any(name == p or name.endswith("." + p) for p in patterns)


def target_modules(model: torch.nn.Module, cfg: Any) -> list[str]:
    """Full names of the layers to adapt, from ``policy.lora``; a ConfigError names the bad key."""
    linear = linear_module_names(model)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    heads = {name for name, module in model.named_modules() if head is not None and module is head}
    listing = ", ".join(sorted({name.rsplit(".", 1)[-1] for name in linear})) or "none"
    if cfg.target_modules:
        unknown = [p for p in cfg.target_modules if not any(_matches(name, [p]) for name in linear)]
        if unknown:
            raise ConfigError([("policy.lora.target_modules",
                                f"{unknown} match no linear layer of the model; its linear layers are named {listing}")])
        chosen = [name for name in linear if _matches(name, cfg.target_modules)]
    elif cfg.match_all_linear:
        chosen = [name for name in linear if name not in heads]  # NeMo-RL's rule: never the LM head
    else:
        raise ConfigError([("policy.lora.target_modules", "is empty and policy.lora.match_all_linear is false: no "
                            f"layer would get an adapter; name some of the model's linear layers ({listing})")])
    unknown = [p for p in cfg.exclude_modules if not any(_matches(name, [p]) for name in linear)]
    if unknown:
        raise ConfigError([("policy.lora.exclude_modules",
                            f"{unknown} match no linear layer of the model; its linear layers are named {listing}")])
    chosen = [name for name in chosen if not _matches(name, cfg.exclude_modules)]
    if not chosen:
        raise ConfigError([("policy.lora.exclude_modules", "excludes every targeted layer: no adapter is left")])
    return chosen


def apply(model: torch.nn.Module, cfg: Any, seed: int):
    """``model`` with adapters injected in place; returns the ``PeftModel`` wrapping it.

    ``model`` stays the object that is trained, sharded and saved (peft only swaps its layers), so
    the policy keeps calling it; the wrapper is for ``disable_adapter`` and peft's file layout.
    A is drawn from its own generator seeded with ``seed`` (B starts at zero): every data-parallel
    rank must start from the same A (each keeps its shard of its own draw), and a run must not
    depend on how much of the global RNG stream ran before.
    """
    peft = _peft()
    targets = target_modules(model, cfg)
    fan_in_fan_out = any(type(dict(model.named_modules())[name]).__name__ == "Conv1D" for name in targets)
    lora_config = peft.LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                                  target_modules=targets, fan_in_fan_out=fan_in_fan_out, bias="none",
                                  task_type="CAUSAL_LM")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        wrapped = peft.get_peft_model(model, lora_config)
    if cfg.dropout > 0:
        for layer in lora_layers(model).values():
            layer.lora_dropout[ADAPTER] = TrainingDropout(cfg.dropout)
    model.eval()  # get_peft_model keeps the mode, but dropout off must not depend on that
    return wrapped


class TrainingDropout(torch.nn.Dropout):
    """Dropout in the training forward only. The policy keeps its model in eval mode (no dropout, so
    the sampler's, the old policy's and the trainer's logprobs agree), where peft's ``nn.Dropout``
    would never drop: this one drops whenever autograd records, i.e. in ``train``'s forward (and its
    activation-checkpointing recompute, which replays the RNG), never in the no-grad logprob passes."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(x, self.p, training=torch.is_grad_enabled())


def lora_layers(model: torch.nn.Module) -> dict[str, Any]:
    """``{name: peft LoRA layer}`` of the (unwrapped) model."""
    return {name: module for name, module in model.named_modules()
            if hasattr(module, "lora_A") and hasattr(module, "base_layer")}


def merged_weights(named: Iterable[tuple[str, torch.Tensor]], layers: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's weights under the base model's names, adapters folded in; ``named`` is the
    unwrapped model's ``(name, whole tensor)`` stream (a state dict, or FSDP's gathered one).

    An adapted layer's base weight, A and B arrive one after the other (module order), so at most
    one layer's tensors are held. The sum is a new tensor: the training weights stay unmerged.
    """
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in named:
        prefix, _, leaf = name.rpartition(".")
        owner = prefix.removesuffix(".base_layer") if prefix.endswith(".base_layer") else None
        for part in (f".lora_A.{ADAPTER}", f".lora_B.{ADAPTER}"):
            if prefix.endswith(part) and prefix[:-len(part)] in layers:
                owner, leaf = prefix[:-len(part)], part[1:7]  # "lora_A" / "lora_B"
        if owner is None or owner not in layers:
            yield name, tensor
            continue
        if leaf == "bias":
            yield f"{owner}.bias", tensor
            continue
        parts = pending.setdefault(owner, {})
        parts[leaf] = tensor
        if len(parts) == 3:
            del pending[owner]
            yield f"{owner}.weight", fold(layers[owner], parts["weight"], parts["lora_A"], parts["lora_B"])
    if pending:
        raise RuntimeError(f"LoRA layers {sorted(pending)} came without their base weight, A or B")


def fold(layer: Any, weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
         dtype: torch.dtype | None = None) -> torch.Tensor:
    """``W + s * B @ A`` of one LoRA ``layer`` as a new tensor in ``dtype`` (default: the weight's),
    summed in float32: bf16 would round the small update away. A Conv1D weight is stored transposed
    (in x out): ``W + s * A^T @ B^T``."""
    a, b = a.float(), b.float()
    factors = (a.T, b.T) if layer.fan_in_fan_out else (b, a)
    return torch.addmm(weight.float(), *factors, alpha=layer.scaling[ADAPTER]).to(dtype or weight.dtype)


@contextlib.contextmanager
def base_modules(model: torch.nn.Module) -> Iterator[dict[str, Any] | None]:
    """For the duration, each of peft's LoRA layers swapped for its base Linear in the module tree, so
    a forward pass runs the base model's own modules and no peft wrapper (peft's forward, adapters
    off or on, cost SmolLM2's sampler 1.25x the time of a token); yields ``{name: LoRA layer}`` to fold
    the adapters from. Yields None and swaps nothing when a layer's base is not a Linear (GPT-2's
    Conv1D): its weight is not what the sampler casts. Nothing may train while it lasts."""
    layers = lora_layers(model)
    if not layers or not all(isinstance(layer.base_layer, torch.nn.Linear) for layer in layers.values()):
        yield None
        return
    slots = [(model.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2], layer)
             for name, layer in layers.items()]
    try:
        for parent, child, layer in slots:
            setattr(parent, child, layer.base_layer)
        yield layers
    finally:
        for parent, child, layer in slots:
            setattr(parent, child, layer)


def is_adapter_name(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def adapter_weights(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Weight sync with ``policy.lora.sync=adapter``: the adapter tensors only, under peft's file names
    (what a backend declaring ``lora_adapters`` loads). ``named`` is drained whole: data-parallel
    ranks gather every tensor together, the frozen base included."""
    for name, tensor in named:
        if is_adapter_name(name):
            yield "base_model.model." + name.replace(f".{ADAPTER}.", "."), tensor


def adapter_state(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The adapter tensors under peft's file names (``base_model.model.X.lora_A.weight``)."""
    return {"base_model.model." + name.replace(f".{ADAPTER}.", "."): tensor.detach().cpu().contiguous()
            for name, tensor in named if is_adapter_name(name)}


def model_names(file_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of ``adapter_state``: peft file names back to the unwrapped model's names."""
    out = {}
    for name, tensor in file_state.items():
        name = name.removeprefix("base_model.model.")
        for part in ("lora_A", "lora_B"):
            name = name.replace(f".{part}.weight", f".{part}.{ADAPTER}.weight")
        out[name] = tensor
    return out


def write_adapter(wrapped, directory: Path, state: dict[str, torch.Tensor]) -> None:
    """peft's adapter directory: the config (as ``save_pretrained`` writes it) and the tensors."""
    directory.mkdir(parents=True, exist_ok=True)
    config = wrapped.peft_config[ADAPTER]
    config.save_pretrained(str(directory))
    save_file(state, str(directory / ADAPTER_FILE), metadata={"format": "pt"})


def read_adapter(directory: Path, model: torch.nn.Module, device: str | None = None) -> dict[str, torch.Tensor]:
    """An adapter file's tensors under the unwrapped model's names, checked against ``model``'s adapters."""
    path = directory / ADAPTER_FILE
    if not path.is_file():
        raise RuntimeError(f"{directory} holds no LoRA adapter ({ADAPTER_FILE}); was it saved with policy.lora "
                           "enabled?")
    state = model_names(load_file(str(path), device=device or "cpu"))
    expected = {name for name, _ in model.named_parameters() if is_adapter_name(name)}
    missing, unexpected = expected - set(state), set(state) - expected
    if missing or unexpected:
        raise RuntimeError(f"LoRA checkpoint {directory} does not match the model's adapters (policy.lora): missing "
                           f"{sorted(missing)[:4]}, unexpected {sorted(unexpected)[:4]}")
    return state


def refuse_adapter_checkpoint(directory: Path) -> None:
    """For a policy without LoRA: an adapters-only checkpoint is a clear error, not a missing file."""
    if (directory / ADAPTER_CONFIG).is_file() and not (directory / "model.safetensors").is_file():
        raise RuntimeError(f"checkpoint {directory} holds LoRA adapters only (it was trained with policy.lora."
                           "enabled=true); load it with policy.lora enabled, or export it merged (grpoctl export)")


def base_model_path(directory: Path) -> str | None:
    """The base model an adapter directory was trained on (peft's ``base_model_name_or_path``)."""
    config = directory / ADAPTER_CONFIG
    return json.loads(config.read_text()).get("base_model_name_or_path") if config.is_file() else None


def export_merged(policy_dir: Path, out: Path) -> None:
    """A LoRA checkpoint's policy as a plain model directory: the base model (where the adapter config
    says it was trained from) with the adapters merged, plus the checkpoint's tokenizer files."""
    import shutil

    from transformers import AutoModelForCausalLM

    from grpo_sdk.plugins.toolkit import load_pretrained

    peft = _peft()
    base_path = base_model_path(policy_dir)
    if not base_path:
        raise RuntimeError(f"{policy_dir / ADAPTER_CONFIG} names no base model (base_model_name_or_path)")
    base = load_pretrained(AutoModelForCausalLM.from_pretrained, base_path,
                           f"base_model_name_or_path of {policy_dir / ADAPTER_CONFIG}", dtype="auto")
    merged = peft.PeftModel.from_pretrained(base, str(policy_dir)).merge_and_unload()
    merged.save_pretrained(out, safe_serialization=True)
    skip = {ADAPTER_FILE, ADAPTER_CONFIG, "README.md"}
    for path in policy_dir.iterdir():  # the tokenizer the run used
        if path.is_file() and path.name not in skip and not path.name.startswith("optimizer."):
            shutil.copy2(path, out / path.name)
