"""What the SGLang backend sends and reads, the same in both modes: ``sglang.Engine.generate`` takes
the fields of ``GenerateReqInput`` as keyword arguments and ``POST /generate`` takes them as JSON, and
both answer the same dicts. Checked against SGLang 0.5.23 (PyPI wheel):

* request: ``sglang/srt/managers/io_struct.py`` ``GenerateReqInput`` (``input_ids``,
  ``sampling_params``, ``return_logprob``) and ``sglang/srt/sampling/sampling_params.py``
  (``max_new_tokens``, ``temperature``, ``top_p``, ``top_k`` with -1 for all, ``stop_token_ids``,
  ``sampling_seed``);
* reply: one dict per prompt, ``output_ids`` and ``meta_info`` with ``finish_reason``
  (``{"type": "stop", "matched": id}``, ``{"type": "length", "length": n}``, ``{"type": "abort",
  "message": ...}``: ``sglang/srt/managers/schedule_batch.py``), ``weight_version`` (a string) and
  ``output_token_logprobs``, ``[logprob, token_id, text]`` per sampled token
  (``TokenizerManager.detokenize_logprob_tokens``; text is null with ``skip_tokenizer_init``);
* weights as tensors: ``update_weights_from_tensor(serialized_named_tensors=[one payload per TP rank],
  load_format="flattened_bucket")``, each payload a pickled ``{"flattened_tensor", "metadata"}``
  read by ``model_runner_components/weight_updater.py`` ``_update_weights_from_flattened_bucket``
  (metadata: objects with ``name, shape, dtype, start_idx, end_idx, numel``, here
  ``types.SimpleNamespace``, which SGLang's ``SafeUnpickler`` allows), as NeMo-RL does
  (``nemo_rl/models/policy/utils.py``).
"""

from __future__ import annotations

import io
import os
import shutil
import types
from pickle import HIGHEST_PROTOCOL, dumps  # write-only: the engine's wire format, never read here
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

from grpo_sdk.plugins import GenerationInput, GenerationOutput, PluginError, SamplingParams

SEED_STRIDE = 1_000_003  # a seeded call seeds row i with seed * stride + i (as the vLLM backend does)


def generate_request(prompts: GenerationInput, sampling: SamplingParams, eos_token_id: int | None) -> dict[str, Any]:
    """The ``GenerateReqInput`` fields of one batched call: the prompts without padding, one
    sampling-params dict per row (a seeded call seeds each row its own way)."""
    rows = [ids[mask.bool()].tolist() for ids, mask in zip(prompts.input_ids, prompts.attention_mask)]
    stop = sorted(set(sampling.stop_token_ids) | ({eos_token_id} if eos_token_id is not None else set()))
    params = []
    for i in range(len(rows)):
        row = {"max_new_tokens": sampling.max_new_tokens, "temperature": sampling.temperature,
               "top_p": sampling.top_p, "top_k": sampling.top_k if sampling.top_k else -1,
               "stop_token_ids": stop}
        if sampling.seed is not None:
            row["sampling_seed"] = sampling.seed * SEED_STRIDE + i
        params.append(row)
    return {"input_ids": rows, "sampling_params": params, "return_logprob": True}


def parse_outputs(replies: Any, num_rows: int, pad_token_id: int, engine_version: int | None,
                  where: str) -> GenerationOutput:
    """The engine's per-prompt dicts as a ``GenerationOutput``; a reply that is not what SGLang
    answers (or an aborted request) is an error naming ``where``. ``engine_version`` None: the
    versions are the engine's own (``meta_info.weight_versions``, spans of output tokens per
    version, ``sglang/srt/utils/weight_versions.py``; ``default`` is the launch weights, version
    0); a number: every token has it (an engine that cannot be told versions)."""
    if isinstance(replies, dict):
        replies = [replies]
    if not isinstance(replies, list) or len(replies) != num_rows:
        raise PluginError(f"{where} answered {type(replies).__name__} "
                          f"{'of ' + str(len(replies)) if isinstance(replies, list) else ''} for {num_rows} prompts; "
                          "expected one dict per prompt (output_ids, meta_info)")
    tokens, logprobs, truncated, versions = [], [], [], []
    for i, reply in enumerate(replies):
        meta = reply.get("meta_info") or {}
        finish = meta.get("finish_reason") or {}
        kind = finish.get("type") if isinstance(finish, dict) else finish
        if kind not in ("stop", "length"):
            raise PluginError(f"{where}: request {i} ended with finish_reason {finish!r} "
                              f"(aborted: was the server paused with mode=abort, or restarted?)")
        triples = meta.get("output_token_logprobs")
        if triples is None:
            raise PluginError(f"{where}: meta_info has no output_token_logprobs; the request sets return_logprob")
        ids = list(reply.get("output_ids") or [t[1] for t in triples])
        if len(ids) != len(triples) or any(int(t[1]) != tok for t, tok in zip(triples, ids)):
            raise PluginError(f"{where}: request {i}'s output_token_logprobs do not match its output_ids")
        tokens.append(ids)
        logprobs.append([float(t[0]) for t in triples])
        truncated.append(kind == "length")
        versions.append(token_versions(meta, len(ids)) if engine_version is None else [engine_version] * len(ids))
    width = max((len(t) for t in tokens), default=0)
    response_ids = torch.full((num_rows, width), pad_token_id, dtype=torch.long)
    response_logprobs = torch.zeros((num_rows, width), dtype=torch.float32)
    oldest = min((v for row in versions for v in row), default=engine_version or 0)
    per_token = torch.full((num_rows, width), oldest, dtype=torch.long)
    for i, (row, row_logprobs, row_versions) in enumerate(zip(tokens, logprobs, versions)):
        response_ids[i, :len(row)] = torch.tensor(row, dtype=torch.long)
        response_logprobs[i, :len(row)] = torch.tensor(row_logprobs, dtype=torch.float32)
        per_token[i, :len(row)] = torch.tensor(row_versions, dtype=torch.long)
    several = len({v for row in versions for v in row}) > 1
    return GenerationOutput(response_ids=response_ids, response_lengths=torch.tensor([len(t) for t in tokens]),
                            logprobs=response_logprobs, truncated=torch.tensor(truncated, dtype=torch.bool),
                            weight_version=oldest, token_weight_versions=per_token if several else None)


def token_versions(meta: dict[str, Any], length: int) -> list[int]:
    """Each output token's version from SGLang's spans (``[{"version", "start", "end"}]``), or
    the request's ``weight_version`` for all of them when the server sends no spans."""
    spans = meta.get("weight_versions")
    if not spans:
        return [version_number(meta.get("weight_version"))] * length
    out = [version_number(spans[0]["version"])] * length
    for span in spans:
        for t in range(int(span["start"]), min(int(span["end"]), length)):
            out[t] = version_number(span["version"])
    return out


def version_number(reported: Any) -> int:
    """SGLang's weight_version is a string: the step this backend named it, or ``default`` (the
    weights the server was launched with: version 0)."""
    try:
        return int(reported)
    except (TypeError, ValueError):
        return 0


# --- weights as tensors ------------------------------------------------------------------------------


def weight_buckets(weights: Iterable[tuple[str, torch.Tensor]], bucket_mb: float
                   ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The weights in order, in buckets of at most ``bucket_mb`` MiB (a larger tensor alone)."""
    limit = bucket_mb * 2**20
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in weights:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > limit:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor.detach()))
        size += nbytes
    if bucket:
        yield bucket


def flattened_bucket(named: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """SGLang's flattened-bucket payload: every tensor's bytes in one uint8 tensor, and where each is."""
    flat, metadata, offset = [], [], 0
    for name, tensor in named:
        data = tensor.contiguous().flatten().view(torch.uint8)
        metadata.append(types.SimpleNamespace(name=name, shape=tensor.shape, dtype=tensor.dtype, start_idx=offset,
                                              end_idx=offset + data.numel(), numel=data.numel()))
        flat.append(data)
        offset += data.numel()
    return {"flattened_tensor": torch.cat(flat), "metadata": metadata}


def serialize_payload(payload: Any, tp_size: int) -> list[bytes]:
    """One serialized copy per TP rank (each rank deserializes its own). CUDA tensors travel as CUDA
    IPC handles (ForkingPickler, what SGLang's MultiprocessingSerializer does): the engine must be on
    the same node and see the GPU. CPU tensors travel by value (plain pickle, which SGLang's
    SafeUnpickler reads too), so a server on another host can load them."""
    on_cuda = isinstance(payload, dict) and payload["flattened_tensor"].is_cuda
    if on_cuda:
        from torch.multiprocessing.reductions import init_reductions

        from multiprocessing.reduction import ForkingPickler

        init_reductions()
        _patch_cuda_reductions()
        buf = io.BytesIO()
        ForkingPickler(buf).dump(payload)
        data = buf.getvalue()
    else:
        data = dumps(payload, protocol=HIGHEST_PROTOCOL)
    return [data] * tp_size


def _patch_cuda_reductions() -> None:
    """SGLang rebuilds CUDA IPC tensors by device UUID when the sender patched torch's reductions the
    same way (``sglang/srt/utils/patch_torch.py``); without sglang here, device indices are sent."""
    try:
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    except ImportError:
        return
    monkey_patch_torch_reductions()


# --- weights as a file -------------------------------------------------------------------------------


def version_directory(path: str, version: int) -> Path:
    """SGLang's update_weights_from_disk reads a model DIRECTORY: a per-version one next to the
    transport's file, holding it under the name a checkpoint has (a hard link: no copy)."""
    source = Path(path)
    directory = source.parent / f"sglang-weights-v{version}"
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    target = directory / "model.safetensors"
    try:
        os.link(source, target)
    except OSError:  # another filesystem, or no hard links: copy
        shutil.copyfile(source, target)
    return directory
