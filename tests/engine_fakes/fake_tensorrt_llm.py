"""FAKE ``tensorrt_llm`` package: the parts of TensorRT-LLM's Python API the grpo-sdk trtllm backend
calls, with their real names and fields, running no engine. TensorRT-LLM cannot be installed here (the
PyPI package is a stub that downloads from NVIDIA's index), so the signatures were taken from its
source in the index (NVIDIA/TensorRT-LLM main):

* ``tensorrt_llm/sampling_params.py`` (000a01de): ``SamplingParams`` fields (a kw-only dataclass; an
  unknown field is a TypeError, as in the real one); ``LogprobMode`` (RAW default, PROCESSED) as
  imported by ``tests/unittest/llmapi/test_llm_pytorch.py``-style tests on main
  (``from tensorrt_llm.sampling_params import LogprobMode, SamplingParams``);
* ``tensorrt_llm/llmapi/llm_args.py``: ``KvCacheConfig(free_gpu_memory_fraction=, enable_block_reuse=)``;
* ``AsyncLLM`` as NeMo-RL (``trtllm_worker_async.py``) and verl (``trtllm_async_server.py``) drive it:
  ``AsyncLLM(**kwargs)``, ``await setup_async()``, ``await generate_async(inputs=, sampling_params=)``
  -> ``RequestOutput`` with ``outputs[0].token_ids / logprobs / finish_reason``, ``await
  collective_rpc(method, args=(), kwargs=None)`` -> one result per worker, ``await release(tags)``,
  ``await resume(tags)``, ``shutdown()``;
* ``tensorrt_llm/llmapi/rlhf_utils.py`` (04762f3b): ``WorkerExtension.update_weights(ipc_handles=None)``
  (decorated with ``tensorrt_llm/_ray_utils.py::control_action_decorator``), ``reset_prefix_cache()``.

What it does instead of an engine: made-up tokens (each the previous one plus one), logprobs given as
TensorRT-LLM gives them (``{token_id: Logprob(logprob, rank)}`` per token); ``collective_rpc`` runs the
method on ``workers`` instances of the ``ray_worker_extension_cls`` (imported by name, as TensorRT-LLM
does), each with a fake ``engine`` whose ``model_engine.model`` is a real ``torch.nn.Module`` and whose
``model_loader.reload`` loads into it. Tests against it check only that the adapter (and grpo-sdk's
worker extension) call the API as written, never that TensorRT-LLM behaves so.

    fake_tensorrt_llm.install(monkeypatch)   # sys.modules["tensorrt_llm", ...] -> these fakes
    fake_tensorrt_llm.AsyncLLM.instances[-1].calls
"""

from __future__ import annotations

import enum
import importlib
import importlib.machinery
import sys
import types
from dataclasses import dataclass, field
from typing import Any, Callable, List, NamedTuple, Optional, Union

FAKE = True
__version__ = "0.0.0-FAKE"


class LogprobMode(str, enum.Enum):
    RAW = "raw"
    PROCESSED = "processed"


@dataclass(slots=True, kw_only=True)
class SamplingParams:
    end_id: Optional[int] = None
    pad_id: Optional[int] = None
    max_tokens: int = 32
    stop: Optional[Union[str, List[str]]] = None
    stop_token_ids: Optional[List[int]] = None
    include_stop_str_in_output: bool = False
    n: int = 1
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    seed: Optional[int] = None
    temperature: Optional[float] = None
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    logprobs_mode: LogprobMode = LogprobMode.RAW
    detokenize: bool = True
    ignore_eos: bool = False


@dataclass(kw_only=True)
class KvCacheConfig:
    free_gpu_memory_fraction: Optional[float] = None
    enable_block_reuse: bool = True
    max_tokens: Optional[int] = None


class Logprob(NamedTuple):
    logprob: float
    rank: Optional[int] = None


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    logprobs: list[Any]
    finish_reason: str


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)


# --- the worker side ---------------------------------------------------------------------------------

def control_action_decorator(method: Callable) -> Callable:
    """The real one drains the executor's requests around the call; the fake records that it ran."""
    def wrapper(self, *args, **kwargs):
        self.engine.control_actions.append(method.__name__)
        return method(self, *args, **kwargs)
    wrapper.__name__ = method.__name__
    return wrapper


class WorkerExtension:
    @control_action_decorator
    def update_weights(self, ipc_handles: Optional[dict] = None):
        self.engine.upstream_updates.append(ipc_handles)

    def reset_prefix_cache(self) -> None:
        self.engine.reset_prefix_cache()


class FakeModelLoader:
    def __init__(self, engine: "FakeExecutor"):
        self.engine = engine

    def reload(self, model, weights: dict, allow_partial_loading: bool = False) -> None:
        self.engine.reloads.append((sorted(weights), allow_partial_loading))
        missing = set(weights) - set(model.state_dict())
        if missing:
            raise KeyError(f"FAKE model has no weights {sorted(missing)}")
        model.load_state_dict({k: v.to("cpu") for k, v in weights.items()}, strict=False)


class FakeExecutor:
    """``self.engine`` of a worker: ``model_engine.model``/``model_loader``, ``reset_prefix_cache``."""

    def __init__(self, model: Any):
        self.model_engine = types.SimpleNamespace(model=model, model_loader=FakeModelLoader(self))
        self.control_actions: list[str] = []
        self.upstream_updates: list[Any] = []
        self.reloads: list[Any] = []
        self.prefix_resets = 0

    def reset_prefix_cache(self) -> None:
        self.prefix_resets += 1


def get_device_uuid(device_id: int) -> str:
    return f"GPU-FAKE-{device_id}"


# --- the LLM API ----------------------------------------------------------------------------------------

class AsyncLLM:
    instances: list["AsyncLLM"] = []
    model_factory: Callable[[], Any] | None = None  # builds each worker's model (a torch module)
    workers = 1

    def __init__(self, **kwargs: Any):
        self.kwargs = kwargs
        self.calls: list[tuple[str, Any]] = []
        self.set_up = False
        self.released: list[str] = []
        module, name = kwargs["ray_worker_extension_cls"].rsplit(".", 1)
        extension = getattr(importlib.import_module(module), name)
        worker_cls = type("FakeRayGPUWorker", (extension,), {})
        self.worker_objects = []
        for rank in range(AsyncLLM.workers):
            worker = worker_cls()
            worker.engine = FakeExecutor(AsyncLLM.model_factory() if AsyncLLM.model_factory else None)
            worker.device_id = rank
            self.worker_objects.append(worker)
        AsyncLLM.instances.append(self)

    async def setup_async(self) -> None:
        self.set_up = True

    async def generate_async(self, inputs: Any, sampling_params: SamplingParams | None = None, **kwargs: Any):
        assert self.set_up, "FAKE: generate_async before setup_async"
        if self.released:
            raise RuntimeError("FAKE: generate while the memory is released")
        self.calls.append(("generate_async", {"inputs": inputs, "sampling_params": sampling_params}))
        row = list(inputs["prompt_token_ids"] if isinstance(inputs, dict) else inputs)
        params = sampling_params or SamplingParams()
        stop = set(params.stop_token_ids or ())
        tokens: list[int] = []
        while len(tokens) < params.max_tokens:
            tokens.append((tokens or row)[-1] + 1)
            if tokens[-1] in stop:
                break
        reason = "stop" if tokens and tokens[-1] in stop else "length"
        logprobs = [{t: Logprob(-0.5 - 0.01 * i, 1)} for i, t in enumerate(tokens)] if params.logprobs else []
        return RequestOutput(prompt_token_ids=row, outputs=[CompletionOutput(0, tokens, logprobs, reason)])

    async def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None, **_: Any) -> list:
        self.calls.append(("collective_rpc", {"method": method, "args": args, "kwargs": kwargs}))
        return [getattr(worker, method)(*args, **(kwargs or {})) for worker in self.worker_objects]

    async def release(self, tags: list[str]) -> None:
        self.calls.append(("release", {"tags": list(tags)}))
        self.released = list(tags)

    async def resume(self, tags: list[str]) -> None:
        self.calls.append(("resume", {"tags": list(tags)}))
        self.released = []

    def shutdown(self) -> None:
        self.calls.append(("shutdown", {}))


LLM = AsyncLLM  # the adapter never constructs LLM; present because `from tensorrt_llm import LLM` works


def install(monkeypatch: Any = None) -> types.ModuleType:
    """Put the fake in sys.modules under every name the backend imports; returns the top module.
    Without ``monkeypatch`` (a stand-in server's own process) the modules stay for the process."""
    names = {
        "tensorrt_llm": dict(AsyncLLM=AsyncLLM, LLM=LLM, SamplingParams=SamplingParams, __version__=__version__),
        "tensorrt_llm.llmapi": dict(KvCacheConfig=KvCacheConfig, SamplingParams=SamplingParams),
        "tensorrt_llm.sampling_params": dict(SamplingParams=SamplingParams, LogprobMode=LogprobMode),
        "tensorrt_llm.llmapi.rlhf_utils": dict(WorkerExtension=WorkerExtension),
        "tensorrt_llm._ray_utils": dict(control_action_decorator=control_action_decorator),
        "tensorrt_llm._torch": {},
        "tensorrt_llm._torch.utils": dict(get_device_uuid=get_device_uuid),
    }
    for name, attrs in names.items():
        module = types.ModuleType(name)
        module.__dict__.update(attrs, FAKE=True)
        module.__spec__ = importlib.machinery.ModuleSpec(name, loader=None, is_package=True)
        module.__path__ = []
        if monkeypatch is None:
            sys.modules[name] = module
        else:
            monkeypatch.setitem(sys.modules, name, module)
    if monkeypatch is None:
        sys.modules.pop("grpo_sdk.backends.trtllm.worker_extension", None)
    else:
        monkeypatch.delitem(sys.modules, "grpo_sdk.backends.trtllm.worker_extension", raising=False)
    AsyncLLM.instances.clear()
    return sys.modules["tensorrt_llm"]
