"""FAKE ``sglang`` module: ``Engine`` with the signatures of SGLang 0.5.23's
``sglang/srt/entrypoints/engine.py`` (PyPI wheel ``sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl``)
for the methods the grpo-sdk adapter calls. It runs no model: it records every call and answers in
the shapes the real methods return (``generate``: one dict per prompt with ``output_ids`` and
``meta_info``; the weight methods: ``(success, message)``), with made-up tokens (each the previous
one plus one) and logprobs (-1.0). Tests against it check only that the adapter calls the API as
documented; tests/backends/test_sglang_engine.py checks these signatures against the real wheel.

    sys.modules["sglang"] = fake_sglang     # then the adapter's ``import sglang`` gets this
    fake_sglang.Engine.instances[-1].calls  # [("generate", {...}), ...]
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Union

FAKE = True


class Engine:
    instances: list["Engine"] = []
    fail: set[str] = set()  # method names that answer (False, message)

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.released = False
        self.disk_listings: list[list[str]] = []
        Engine.instances.append(self)

    def _record(self, method: str, **kwargs: Any) -> Any:
        self.calls.append((method, kwargs))
        if method in Engine.fail:
            return False, f"FAKE failure of {method}"
        return True, "Success"

    def generate(self, prompt: Optional[Union[List[str], str]] = None,
                 sampling_params: Optional[Union[List[Dict], Dict]] = None,
                 input_ids: Optional[Union[List[List[int]], List[int]]] = None, image_data=None, audio_data=None,
                 video_data=None, mm_hashes=None, mm_content_hashes=None, return_logprob=False,
                 logprob_start_len=None, top_logprobs_num=None, token_ids_logprob=None, lora_path=None,
                 custom_logit_processor=None, require_reasoning: bool = False, return_hidden_states=False,
                 return_routed_experts: bool = False, routed_experts_start_len: int = 0, stream: bool = False,
                 bootstrap_host=None, bootstrap_port=None, bootstrap_room=None, routed_dp_rank=None,
                 disagg_prefill_dp_rank=None, kv_hints=None, data_parallel_rank=None, external_trace_header=None,
                 rid=None, session_params=None, priority=None, session_id=None, *, cache_salt=None):
        self.calls.append(("generate", {"input_ids": input_ids, "sampling_params": sampling_params,
                                        "return_logprob": return_logprob}))
        if self.released:
            raise RuntimeError("FAKE: generate while the memory is released")
        out = []
        for row, params in zip(input_ids, sampling_params):
            tokens, stop = [], set(params.get("stop_token_ids") or ())
            while len(tokens) < params["max_new_tokens"]:
                tokens.append((tokens or row)[-1] + 1)
                if tokens[-1] in stop:
                    break
            finish = ({"type": "stop", "matched": tokens[-1]} if tokens[-1] in stop
                      else {"type": "length", "length": len(tokens)})
            meta = {"id": "fake", "finish_reason": finish, "weight_version": "default", "prompt_tokens": len(row),
                    "completion_tokens": len(tokens)}
            if return_logprob:
                meta["output_token_logprobs"] = [(-1.0, t, None) for t in tokens]
            out.append({"output_ids": tokens, "meta_info": meta})
        return out

    def update_weights_from_tensor(self, named_tensors, load_format: Optional[str] = None, flush_cache: bool = True):
        return self._record("update_weights_from_tensor", named_tensors=named_tensors, load_format=load_format,
                            flush_cache=flush_cache)

    def update_weights_from_disk(self, model_path: str, load_format: Optional[str] = None):
        import os

        self.disk_listings.append(sorted(os.listdir(model_path)))  # what the engine finds there, at call time
        return self._record("update_weights_from_disk", model_path=model_path, load_format=load_format)

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str, backend: str = "nccl"):
        return self._record("init_weights_update_group", master_address=master_address, master_port=master_port,
                            rank_offset=rank_offset, world_size=world_size, group_name=group_name, backend=backend)

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        group_name: str = "weight_update_group", flush_cache: bool = True,
                                        load_format: Optional[str] = None):
        return self._record("update_weights_from_distributed", names=names, dtypes=dtypes, shapes=shapes,
                            group_name=group_name, flush_cache=flush_cache, load_format=load_format)

    def destroy_weights_update_group(self, group_name: str):
        return self._record("destroy_weights_update_group", group_name=group_name)

    def release_memory_occupation(self, tags: Optional[List[str]] = None):
        self.released = True
        self._record("release_memory_occupation", tags=tags)

    def resume_memory_occupation(self, tags: Optional[List[str]] = None):
        self.released = False
        self._record("resume_memory_occupation", tags=tags)

    def flush_cache(self):
        return self._record("flush_cache")

    def get_model_info(self):
        return {"model_path": self.kwargs.get("model_path"), "weight_version": "default"}

    def shutdown(self):
        self._record("shutdown")
