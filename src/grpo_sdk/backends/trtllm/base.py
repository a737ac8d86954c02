"""TensorRT-LLM generation: what both modes share (docs/trtllm.md), ``TrtllmGeneration``, the base of
``TrtllmEngineGeneration`` (engine.py: the LLM API in this process) and ``TrtllmServerGeneration``
(server.py: a trtllm-serve over HTTP), which builds one of them by ``policy.generation.trtllm.mode``.
Both:

* send prompts as token ids and read token ids back, with the stop token kept in the response
  (``include_stop_str_in_output=True``, as NeMo-RL's worker does so the response matches the policy's);
* take one logprob per sampled token (``logprobs=1``; ``logprobs=0`` returns none through trtllm-serve);
* move weights by one of three paths, each a grpo-sdk transport's:
  - ``update_weights`` with CUDA tensors (``inprocess``/``cuda_ipc``, colocated): IPC handles through
    upstream's ``WorkerExtension.update_weights``, then the finalising ``update_weights(None)``;
  - ``update_weights`` with CPU tensors, and ``load_weights(path)`` (``disk``): a safetensors file
    loaded by grpo-sdk's worker extension (``load_file``);
  - ``join_broadcast`` / ``receive_broadcast`` (``collective``): the engine's workers join the
    transport's group and receive each tensor from policy rank 0 (worker_extension.py);
* release the engine's memory after a generation round and take it back before the next when
  ``enable_sleep`` (colocated).

Weight versions: TensorRT-LLM keeps none. In engine mode every worker's reply to a grpo-sdk command
names the version it loaded and the tensor count, and a mismatch stops the run. trtllm-serve's
``/update_weights`` answers only ``{"status": "success"}``, so in server mode a failed update is
seen only as the route's error status (docs/trtllm.md).
"""

from __future__ import annotations

import random
import tempfile
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

from grpo_sdk.backends.trtllm.config import TrtllmConfig
from grpo_sdk.backends.trtllm.refit import ALL_TAGS, command, device_uuid, ipc_handles
from grpo_sdk.plugins import GenerationInput, GenerationOutput, PluginError, RunContext, SamplingParams
from grpo_sdk.plugins.toolkit import load_tokenizer

Completion = tuple[list[int], list[float], str]  # token ids, their logprobs, finish_reason


def prompt_rows(prompts: GenerationInput) -> list[list[int]]:
    """The left-padded prompts as lists of token ids, padding removed."""
    return [ids[mask.bool()].tolist() for ids, mask in zip(prompts.input_ids, prompts.attention_mask)]


def row_seeds(sampling: SamplingParams, rows: int, rng: random.Random) -> list[int]:
    """One seed per row. TensorRT-LLM documents ``SamplingParams.seed=None`` as "the C++ runtime default
    0" (``tensorrt_llm/sampling_params.py``), so unseeded requests would all draw the same stream and
    the G samples of one prompt could come out identical: every request gets a seed of its own, from
    the call's seed (validation) or from the backend's generator (seeded by the run's seed)."""
    if sampling.seed is not None:
        return [(sampling.seed * 1_000_003 + row) % 2**31 for row in range(rows)]
    return [rng.getrandbits(31) for _ in range(rows)]


def pack(completions: Sequence[Completion], pad_token_id: int, weight_version: int) -> GenerationOutput:
    width = max((len(tokens) for tokens, _, _ in completions), default=0)
    response_ids = torch.full((len(completions), width), pad_token_id, dtype=torch.long)
    logprobs = torch.zeros((len(completions), width), dtype=torch.float32)
    for i, (tokens, row_logprobs, _) in enumerate(completions):
        if len(tokens) != len(row_logprobs):
            raise PluginError(f"TensorRT-LLM returned {len(tokens)} tokens but {len(row_logprobs)} logprobs for row "
                              f"{i}; is `logprobs` reaching the engine?")
        response_ids[i, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        logprobs[i, :len(tokens)] = torch.tensor(row_logprobs, dtype=torch.float32)
    return GenerationOutput(
        response_ids=response_ids, logprobs=logprobs,
        response_lengths=torch.tensor([len(t) for t, _, _ in completions], dtype=torch.long),
        truncated=torch.tensor([reason == "length" for _, _, reason in completions], dtype=torch.bool),
        weight_version=weight_version)


class TrtllmGeneration:
    """The Generation protocol, ``WeightFileLoader`` and ``ReceivesBroadcast`` over one TensorRT-LLM engine.

    The spec names this one class (the contract kit checks it); constructing it builds the subclass of
    ``policy.generation.trtllm.mode``, which provides ``_complete``, ``_update``, ``_release`` and
    ``_resume``. Each subclass registers its mode (``class TrtllmServerGeneration(TrtllmGeneration,
    mode="server")``); generation.py, the spec's module, imports both.

    Example::

        generation = TrtllmGeneration(TrtllmConfig(mode="server", url="http://127.0.0.1:8000"), context)
        out = generation.generate(prompts, SamplingParams(max_new_tokens=64))
        generation.load_weights("/runs/x/weight_sync/weights_v3.safetensors", version=3)
    """

    modes: dict[str, type[TrtllmGeneration]] = {}

    def __init_subclass__(cls, *, mode: str, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        TrtllmGeneration.modes[mode] = cls

    def __new__(cls, config: TrtllmConfig | None = None, context: RunContext | None = None) -> Any:
        if cls is TrtllmGeneration:
            cls = TrtllmGeneration.modes[(config or TrtllmConfig()).mode]
        return super().__new__(cls)

    def __init__(self, config: TrtllmConfig | None, context: RunContext):
        self.config = config or TrtllmConfig()
        self.context = context
        tokenizer = load_tokenizer(context.tokenizer_path)
        self.pad_token_id = tokenizer.pad_token_id
        self.eos_token_id = tokenizer.eos_token_id
        self.weight_version = 0
        self.released = False
        self.rng = random.Random(context.seed)
        self.pending_tensors = 0  # received in this collective update so far (receive_broadcast)

    # --- what a mode provides ----------------------------------------------------------------------

    def _complete(self, rows: list[list[int]], sampling: SamplingParams) -> list[Completion]:
        raise NotImplementedError

    def _update(self, weights: dict[str, str] | None, *, op: str | None = None, version: int | None = None,
                tensors: int | None = None) -> None:
        """One ``update_weights`` call on every engine worker; for a grpo-sdk command (``op``) the
        workers' answers are checked where the mode can read them."""
        raise NotImplementedError

    def _release(self, tags: Sequence[str]) -> None:
        raise NotImplementedError

    def _resume(self, tags: Sequence[str]) -> None:
        raise NotImplementedError

    def _device_uuid(self, index: int) -> str:
        return device_uuid(index)

    # --- sampling ----------------------------------------------------------------------------------

    def generate(self, prompts: GenerationInput, sampling: SamplingParams) -> GenerationOutput:
        if self.released:
            self.prepare_for_generation()
        completions = self._complete(prompt_rows(prompts), sampling)
        return pack(completions, self.pad_token_id, self.weight_version)

    def sampling_fields(self, sampling: SamplingParams, seed: int) -> dict[str, Any]:
        """TensorRT-LLM ``SamplingParams`` fields (the same names in /v1/completions), one request."""
        return dict(max_tokens=sampling.max_new_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
                    top_k=sampling.top_k or 0,  # TensorRT-LLM spells "no top-k" as 0
                    seed=seed, stop_token_ids=list(sampling.stop_token_ids) or None,
                    include_stop_str_in_output=True, logprobs=1, detokenize=False)

    # --- weights -----------------------------------------------------------------------------------

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, version: int) -> None:
        self.prepare_for_generation()  # a released engine holds no weights to update
        named = [(name, tensor.detach()) for name, tensor in weights]
        if named and all(t.is_cuda for _, t in named):
            torch.cuda.synchronize()  # the engine reads this memory from its own processes
            by_device: dict[int, list[tuple[str, torch.Tensor]]] = {}
            for name, tensor in named:
                by_device.setdefault(tensor.device.index or 0, []).append((name, tensor))
            payload: dict[str, str] = {}
            for index, group in by_device.items():
                payload.update(ipc_handles(group, self._device_uuid(index)))
            self._update(payload)  # upstream's path: the engine copies out of our CUDA memory
            self._update(None)  # finalise: post-load processing, prefix cache reset
            torch.cuda.synchronize()
        else:
            if self.config.mode == "server" and not self.config.worker_extension:
                raise PluginError("trtllm-serve without grpo-sdk's worker extension takes CUDA IPC handles only, and "
                                  "these weights are not all on a GPU; start the server with the extension and set "
                                  "policy.generation.trtllm.worker_extension=true (docs/trtllm.md)")
            if any(t.is_cuda for _, t in named):
                named = [(n, t.cpu()) for n, t in named]  # one file, whatever device each tensor was on
            from grpo_sdk.plugins.tensors import write_weights

            with tempfile.TemporaryDirectory(prefix="grpo-trtllm-weights-") as tmp:
                path = Path(tmp) / "model.safetensors"
                write_weights(named, path)
                self._load_file(str(path), version=version, tensors=len(named))
        self.weight_version = version

    def load_weights(self, path: str, *, version: int) -> None:
        """``WeightFileLoader``: the disk transport's file, loaded by the engine's own workers."""
        from safetensors import safe_open

        self.prepare_for_generation()
        with safe_open(path, framework="pt") as handle:
            count = len(list(handle.keys()))
        self._load_file(str(Path(path).absolute()), version=version, tensors=count)
        self.weight_version = version

    def _load_file(self, path: str, *, version: int, tensors: int) -> None:
        self._update(command("load_file", path=path, version=version, last=True), op="load_file", version=version,
                     tensors=tensors)

    # --- ReceivesBroadcast ---------------------------------------------------------------------------

    def broadcast_ranks(self) -> int:
        return self.config.tensor_parallel_size

    def join_broadcast(self, *, master_address: str, master_port: int, rank_offset: int, world_size: int,
                       group_name: str, backend: str) -> None:
        timeout_s = float(self.context.config.cluster.call_timeout_s)
        self.prepare_for_generation()
        self._update(command("join", master_address=master_address, master_port=master_port,
                             rank_offset=rank_offset, world_size=world_size, group_name=group_name, backend=backend,
                             timeout_s=timeout_s), op="join")

    def receive_broadcast(self, tensors: Sequence[tuple[str, tuple[int, ...], str]], *, group_name: str,
                          version: int, last: bool) -> None:
        self.prepare_for_generation()
        listed = [[name, list(shape), dtype] for name, shape, dtype in tensors]
        # Per worker, the tensor count of a finished update is every tensor of its calls.
        self.pending_tensors += len(listed)
        expected = self.pending_tensors if last else len(listed)
        try:
            self._update(command("receive", tensors=listed, group_name=group_name, version=version, last=last),
                         op="receive", version=version if last else None, tensors=expected)
        except BaseException:
            self.pending_tensors = 0  # the next sync starts a new update
            raise
        if last:
            self.pending_tensors = 0
            self.weight_version = version

    # --- colocation --------------------------------------------------------------------------------

    def prepare_for_generation(self) -> None:
        if self.released:
            self._resume(ALL_TAGS)
            self.released = False

    def finish_generation(self) -> None:
        if self.config.enable_sleep and not self.released:
            self._release(ALL_TAGS)
            self.released = True

    def shutdown(self) -> None:
        pass
