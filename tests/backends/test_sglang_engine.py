"""The SGLang backend's engine mode against a FAKE ``sglang`` module (tests/engine_fakes/fake_sglang.py),
and every call the adapter makes, in both modes, pinned against the REAL SGLang 0.5.23 wheel's source.

What these tests prove: engine mode calls ``sglang.Engine`` with the arguments SGLang documents
(construction, generate, each weight path, release/resume, the update group), and, read from the
real wheel with ``ast`` (importing sglang needs 11 GB of dependencies), that every keyword the
adapter passes exists on the real method and every required one is passed; that the fake's
signatures are the real ones; and that every field server mode sends is a field of SGLang's
request struct for that route (``io_struct.py``, ``sampling_params.py``) and every engine argument
a ``ServerArgs`` field. What they do not prove: that SGLang then does what its docs say (no engine
runs here; benchmarks/gpu/check_sglang.py is that check), nor anything about the fake's outputs.

The wheel is downloaded once into ``~/.cache/grpo-sdk/wheels`` (cache it in CI); offline, or when
the download takes over 60 s, the pinning tests are skipped with the reason.
"""

from __future__ import annotations

import ast
import inspect
import io
import pickle
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from helpers import prompt_batch
from engine_fakes import fake_sglang

SGLANG_VERSION = "0.5.23"
WHEEL_DIR = Path.home() / ".cache" / "grpo-sdk" / "wheels"


def sglang_wheel() -> Path:
    """The real wheel (39 MB, no dependencies), downloaded once; skips the test when it cannot be."""
    found = sorted(WHEEL_DIR.glob(f"sglang-{SGLANG_VERSION}-*.whl"))
    if found:
        return found[0]
    WHEEL_DIR.mkdir(parents=True, exist_ok=True)
    try:
        subprocess.run([sys.executable, "-m", "pip", "download", f"sglang=={SGLANG_VERSION}", "--no-deps",
                        "--only-binary=:all:", "-d", str(WHEEL_DIR), "-q"], check=True, timeout=60,
                       capture_output=True)
    except (subprocess.SubprocessError, OSError) as exc:
        pytest.skip(f"the sglang {SGLANG_VERSION} wheel could not be downloaded ({type(exc).__name__}); offline?")
    found = sorted(WHEEL_DIR.glob(f"sglang-{SGLANG_VERSION}-*.whl"))
    if not found:
        pytest.skip(f"pip download fetched no sglang {SGLANG_VERSION} wheel")
    return found[0]


@pytest.fixture(scope="module")
def real_source():
    wheel = zipfile.ZipFile(sglang_wheel())

    def tree(path: str) -> ast.Module:
        return ast.parse(wheel.read(path).decode())
    tree.names = wheel.namelist()
    return tree


def real_class(tree: ast.Module, name: str) -> ast.ClassDef:
    return next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name)


def real_methods(tree: ast.Module, cls: str) -> dict[str, tuple[list[str], set[str]]]:
    """method -> (every parameter name but self, the required ones)."""
    out = {}
    for fn in real_class(tree, cls).body:
        if isinstance(fn, ast.FunctionDef):
            args = fn.args
            positional = [a.arg for a in args.args][1:]
            required = set(positional[:len(positional) - len(args.defaults)])
            required |= {a.arg for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is None}
            out[fn.name] = (positional + [a.arg for a in args.kwonlyargs], required)
    return out


def struct_fields(tree: ast.Module, cls: str) -> set[str]:
    """The annotated fields of a request struct (and of its BaseReq parent: rid etc.)."""
    node = real_class(tree, cls)
    fields = {s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
    for base in node.bases:
        if isinstance(base, ast.Name) and base.id not in ("object",):
            try:
                fields |= struct_fields(tree, base.id)
            except StopIteration:
                pass
    return fields


# --- engine mode against the fake -----------------------------------------------------------------


@pytest.fixture
def engine_mode(monkeypatch, registry, tiny_model_dir):
    """The adapter in engine mode on the FAKE module, and the fake engine it built."""
    from grpo_sdk.backends.sglang.config import SGLangConfig
    from grpo_sdk.backends.sglang.generation import SGLangGeneration
    from grpo_sdk.config.loading import load_config
    from grpo_sdk.config.context import RunContext

    monkeypatch.setitem(sys.modules, "sglang", fake_sglang)
    monkeypatch.setattr(fake_sglang.Engine, "instances", [])
    monkeypatch.setattr(fake_sglang.Engine, "fail", set())

    def build(**options):
        cfg = load_config(None, [f"policy.model_name={tiny_model_dir}"], registry)
        context = RunContext(config=cfg, run_dir=tiny_model_dir, model_path=str(tiny_model_dir),
                             tokenizer_path=str(tiny_model_dir), device="cpu", seed=17, needs_reference=False)
        generation = SGLangGeneration(SGLangConfig(mode="engine", **options), context)
        return generation, fake_sglang.Engine.instances[-1]
    return build


def test_engine_mode_builds_the_engine_on_token_ids_and_parses_its_replies(engine_mode, tiny_model_dir):
    from grpo_sdk.core.models import load_tokenizer
    from grpo_sdk.core.records import SamplingParams

    generation, engine = engine_mode(tp_size=2, engine_kwargs={"chunked_prefill_size": 256})
    assert engine.kwargs["skip_tokenizer_init"] is True and engine.kwargs["random_seed"] == 17
    assert engine.kwargs["model_path"] == str(tiny_model_dir) and engine.kwargs["tp_size"] == 2
    assert engine.kwargs["chunked_prefill_size"] == 256
    tokenizer = load_tokenizer(str(tiny_model_dir))
    inputs = prompt_batch(tokenizer, ["12>", "3>"])
    out = generation.generate(inputs, SamplingParams(max_new_tokens=3, temperature=0.7, seed=5))
    method, call = engine.calls[-1]
    assert method == "generate" and call["return_logprob"] is True
    assert call["input_ids"] == [r[m.bool()].tolist() for r, m in zip(inputs.input_ids, inputs.attention_mask)]
    assert [p["sampling_seed"] for p in call["sampling_params"]] == [5 * 1_000_003, 5 * 1_000_003 + 1]
    assert call["sampling_params"][0]["top_k"] == -1 and tokenizer.eos_token_id in call["sampling_params"][0][
        "stop_token_ids"]
    last = [row[-1] for row in call["input_ids"]]
    assert out.response_ids.tolist() == [[t + 1, t + 2, t + 3] for t in last]  # the fake's made-up tokens
    assert out.truncated.tolist() == [True, True] and torch.all(out.logprobs == -1.0)


def test_engine_mode_weight_paths_call_the_engine_as_documented(engine_mode, tmp_path):
    from grpo_sdk.plugins.tensors import write_weights

    generation, engine = engine_mode(tp_size=2, update_bucket_mb=0.0005)
    weights = [("a.weight", torch.randn(16, 16)), ("b.bias", torch.arange(4.0))]
    generation.update_weights(weights, version=3)
    updates = [c for m, c in engine.calls if m == "update_weights_from_tensor"]
    assert [c["flush_cache"] for c in updates] == [False, True]  # one bucket per tensor here; flush on the last
    assert all(c["load_format"] == "flattened_bucket" and len(c["named_tensors"]) == 2 for c in updates)  # per TP rank
    bucket = pickle.load(io.BytesIO(updates[0]["named_tensors"][0]))
    meta = bucket["metadata"][0]
    assert meta.name == "a.weight" and torch.equal(
        bucket["flattened_tensor"][meta.start_idx:meta.end_idx].view(meta.dtype).reshape(meta.shape), weights[0][1])
    assert generation.weight_version == 3

    path = tmp_path / "weights.safetensors"
    write_weights(weights, path)
    generation.load_weights(str(path), version=4)
    (method, call), listing = engine.calls[-1], engine.disk_listings[-1]
    assert method == "update_weights_from_disk" and listing == ["model.safetensors"]
    assert not Path(call["model_path"]).exists() and path.exists()

    generation.join_broadcast(master_address="10.0.0.1", master_port=29500, rank_offset=1, world_size=3,
                              group_name="g", backend="nccl")
    generation.receive_broadcast([("a.weight", (16, 16), "bfloat16")], group_name="g", version=5, last=True)
    assert engine.calls[-2] == ("init_weights_update_group", {
        "master_address": "10.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 3, "group_name": "g",
        "backend": "nccl"})
    assert engine.calls[-1] == ("update_weights_from_distributed", {
        "names": ["a.weight"], "dtypes": ["bfloat16"], "shapes": [[16, 16]], "group_name": "g", "flush_cache": True,
        "load_format": None})
    assert generation.broadcast_ranks() == 2 and generation.weight_version == 5
    generation.shutdown()
    assert [m for m, _ in engine.calls[-2:]] == ["destroy_weights_update_group", "shutdown"]


def test_engine_mode_releases_when_colocated_and_a_failed_update_is_an_error(engine_mode):
    from grpo_sdk.plugins import PluginError

    generation, engine = engine_mode(needs_offload=True)
    assert engine.kwargs["enable_memory_saver"] is True
    generation.finish_generation()
    assert engine.released
    generation.update_weights([("a", torch.zeros(2))], version=1)  # resumes first
    assert [m for m, _ in engine.calls] == ["release_memory_occupation", "resume_memory_occupation",
                                            "update_weights_from_tensor"]
    fake_sglang.Engine.fail.add("update_weights_from_tensor")
    with pytest.raises(PluginError, match="sglang.Engine.update_weights_from_tensor failed: FAKE failure"):
        generation.update_weights([("a", torch.zeros(2))], version=2)
    assert generation.weight_version == 1


# --- pinned against the real wheel ----------------------------------------------------------------


def test_every_engine_call_and_the_fakes_signatures_match_the_real_engine(engine_mode, real_source, tmp_path):
    from grpo_sdk.core.models import load_tokenizer
    from grpo_sdk.core.records import SamplingParams
    from grpo_sdk.plugins.tensors import write_weights

    real = real_methods(real_source("sglang/srt/entrypoints/engine.py"), "Engine")
    generation, engine = engine_mode(needs_offload=True, tp_size=1)
    tokenizer = load_tokenizer(engine.kwargs["tokenizer_path"])
    generation.generate(prompt_batch(tokenizer, ["1>"]), SamplingParams(max_new_tokens=2, seed=1))
    generation.finish_generation()
    generation.update_weights([("a", torch.zeros(2))], version=1)
    write_weights([("a", torch.zeros(2))], tmp_path / "w.safetensors")
    generation.load_weights(str(tmp_path / "w.safetensors"), version=2)
    generation.join_broadcast(master_address="h", master_port=1, rank_offset=1, world_size=2, group_name="g",
                              backend="gloo")
    generation.receive_broadcast([("a", (2,), "float32")], group_name="g", version=3, last=True)
    generation.shutdown()
    called = {m for m, _ in engine.calls}
    assert called >= {"generate", "update_weights_from_tensor", "update_weights_from_disk",
                      "init_weights_update_group", "update_weights_from_distributed", "release_memory_occupation",
                      "resume_memory_occupation", "destroy_weights_update_group", "shutdown"}
    for method, kwargs in engine.calls:
        assert method in real, f"sglang {SGLANG_VERSION} Engine has no {method}"
        params, required = real[method]
        assert set(kwargs) <= set(params), (method, set(kwargs) - set(params))
        assert required <= set(kwargs), (method, required - set(kwargs))
    for method in called:  # the fake's signature is the real one
        fake = [p for p in inspect.signature(getattr(fake_sglang.Engine, method)).parameters if p != "self"]
        assert fake == real[method][0], method
    # 0.5.23 assembles ServerArgs from the namespaces in sglang/srt/arg_groups/fields/*.py
    server_args = {s.target.id for path in real_source.names if path.startswith("sglang/srt/arg_groups/fields/")
                   and path.endswith(".py") for cls in ast.walk(real_source(path)) if isinstance(cls, ast.ClassDef)
                   for s in cls.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
    assert set(engine.kwargs) <= server_args, set(engine.kwargs) - server_args


def test_every_field_server_mode_sends_is_in_sglangs_request_structs(monkeypatch, registry, tiny_model_dir,
                                                                     real_source, tmp_path):
    """Server mode driven through every path with the HTTP client replaced by a recorder (no server):
    each route's body must fit the struct the real route parses."""
    from grpo_sdk.backends.sglang import server as server_module
    from grpo_sdk.backends.sglang.config import SGLangConfig
    from grpo_sdk.backends.sglang.generation import SGLangGeneration
    from grpo_sdk.config.loading import load_config
    from grpo_sdk.config.context import RunContext
    from grpo_sdk.core.models import load_tokenizer
    from grpo_sdk.core.records import SamplingParams
    from grpo_sdk.plugins.tensors import write_weights

    sent: list[tuple[str, str, object]] = []
    version = {"now": "default"}

    class Recorder:
        def __init__(self, url, *, timeout_s, what):
            pass

        def get(self, path, *, timeout_s=None):
            sent.append(("GET", path, None))
            return {"tp_size": 1, "pp_size": 1, "enable_memory_saver": True} if path == "/server_info" else \
                {"weight_version": version["now"]}

        def post(self, path, body=None, *, timeout_s=None):
            sent.append(("POST", path, body))
            if isinstance(body, dict) and body.get("weight_version"):
                version["now"] = body["weight_version"]
            if path == "/generate":
                return [{"output_ids": [5], "meta_info": {"finish_reason": {"type": "length", "length": 1},
                                                          "output_token_logprobs": [[-0.5, 5, None]],
                                                          "weight_version": version["now"]}}]
            return {"success": True, "message": "ok"}

    monkeypatch.setattr(server_module, "HTTPClient", Recorder)
    cfg = load_config(None, [f"policy.model_name={tiny_model_dir}"], registry)
    context = RunContext(config=cfg, run_dir=tiny_model_dir, model_path=str(tiny_model_dir),
                         tokenizer_path=str(tiny_model_dir), device="cpu", seed=0, needs_reference=False)
    generation = SGLangGeneration(SGLangConfig(url="http://x", needs_offload=True), context)
    generation.generate(prompt_batch(load_tokenizer(str(tiny_model_dir)), ["1>"]), SamplingParams(max_new_tokens=1,
                                                                                                   seed=3))
    generation.finish_generation()
    generation.update_weights([("a", torch.zeros(2))], version=1)
    write_weights([("a", torch.zeros(2))], tmp_path / "w.safetensors")
    generation.load_weights(str(tmp_path / "w.safetensors"), version=2)
    generation.join_broadcast(master_address="h", master_port=1, rank_offset=1, world_size=2, group_name="g",
                              backend="gloo")
    generation.receive_broadcast([("a", (2,), "float32")], group_name="g", version=3, last=True)
    generation.pause_generation(keep_in_flight=False)
    generation.resume_generation(recompute_kv_cache=False)
    generation.shutdown()

    io_struct = real_source("sglang/srt/managers/io_struct.py")
    structs = {"/generate": "GenerateReqInput", "/update_weights_from_tensor": "UpdateWeightsFromTensorReqInput",
               "/update_weights_from_disk": "UpdateWeightFromDiskReqInput",
               "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
               "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
               "/destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
               "/release_memory_occupation": "ReleaseMemoryOccupationReqInput",
               "/resume_memory_occupation": "ResumeMemoryOccupationReqInput",
               "/pause_generation": "PauseGenerationReqInput", "/continue_generation": "ContinueGenerationReqInput"}
    http_server = ast.unparse(real_source("sglang/srt/entrypoints/http_server.py"))
    sampling = struct_fields(real_source("sglang/srt/sampling/sampling_params.py"), "SamplingParams")
    posted = {path for method, path, _ in sent if method == "POST"}
    assert posted == set(structs), posted ^ set(structs)
    for method, path, body in sent:
        assert f"'{path}'" in http_server, f"sglang {SGLANG_VERSION}'s http_server.py has no route {path}"
        if method == "POST":
            fields = struct_fields(io_struct, structs[path])
            assert set(body) <= fields, (path, set(body) - fields)
    for params in next(body for m, p, body in sent if p == "/generate")["sampling_params"]:
        assert set(params) <= sampling, set(params) - sampling
    pause = next(body for m, p, body in sent if p == "/pause_generation")
    assert f"'{pause['mode']}'" in ast.unparse(real_class(io_struct, "PauseGenerationReqInput"))
