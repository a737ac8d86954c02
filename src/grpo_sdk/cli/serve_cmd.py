"""`grpoctl serve MODEL`: the rollout endpoint stand-alone, over a model directory or a run's checkpoint.

The same OpenAI-compatible endpoint a run opens for its agents (``grpo_sdk.serving``), over any
generation backend, built through the registry as the trainer builds it. For evaluation, and for
debugging an agent against the model it will train: each request's sampling parameters are honoured
(``EndpointSettings(sampling="request")``), answers carry the turn's exact token ids and logprobs.

MODEL is a Hugging Face model directory (or hub id), a ``.gguf`` file (served from its cached
model directory, docs/models.md), ``builtin:NAME`` (built as `grpoctl run` builds it, from
``grpo.seed``, or a packaged GGUF file), a run directory (its latest checkpoint's policy; ``--step``/``--best`` as in
`grpoctl export`) or one checkpoint directory (``.../checkpoints/step_N``). The config is that of the
run (its ``policy`` and ``cluster`` sections: backend, precision, sampling, context length) or the
built-in recipe's for a built-in model, the defaults otherwise (a model directory's context length
from its config.json); ``-c`` files, ``key=value`` overrides and the flags go on top.

Nothing heavy is imported until the command runs: ``grpoctl --help`` stays light.
"""

from __future__ import annotations

import json
import signal
import socket
import sys
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import attrs
import typer

from grpo_sdk.cli.common import guarded, load_plugin_modules
from grpo_sdk.core.errors import ConfigError, ExitCode, GrpoSdkError, ModelLoadError
from grpo_sdk.trainer.signals import SIGNALS, StopNow, signal_name

if TYPE_CHECKING:
    from grpo_sdk.config.schema import MasterConfig

API_KEY_ENV = "GRPO_SDK_API_KEY"
_SAVED_CONFIG = "config.resolved.yaml"
_SECTIONS = ("policy", "cluster")  # what serving needs of a run's config (grpo.seed too: the built-in model's)


class ServeError(GrpoSdkError):
    """`grpoctl serve` cannot start: a bad MODEL, host, port or option. Exit code 2, one line."""

    exit_code = ExitCode.USAGE


def serve(
    model: str = typer.Argument(..., help="A Hugging Face model directory (or hub id), a .gguf file, builtin:NAME, a run "
                                "directory (its latest checkpoint) or a checkpoint directory (.../checkpoints/step_N)."),
    overrides: Optional[list[str]] = typer.Argument(None, help="Dotted config overrides, as for `grpoctl run`: "
                                                    "policy.generation.vllm.gpu_memory_utilization=0.5."),
    config: Optional[list[Path]] = typer.Option(None, "-c", "--config", help="Config YAML whose policy.generation "
                                                "(backend and its block), policy.precision and cluster.device apply; "
                                                "repeat to layer files."),
    plugin_modules: Optional[list[str]] = typer.Option(None, "-p", "--plugin", help="Import MODULE as a hook plugin "
                                                       "(a generation backend of your own)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on. Anything but loopback needs --api-key."),
    port: int = typer.Option(8000, "--port", min=0, max=65535, help="Port to listen on; 0 picks a free one."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar=API_KEY_ENV, show_envvar=True,
                                          help="Bearer token every request must carry (401 otherwise)."),
    model_name: Optional[str] = typer.Option(None, "--model-name", help="The name /v1/models answers with; default: "
                                             "MODEL's directory name."),
    backend: Optional[str] = typer.Option(None, "--backend", help="Generation backend (policy.generation.backend): "
                                          "hf, vllm or an installed plugin's. Default: the config's (hf)."),
    max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens", min=1, help="Tokens a request "
                                                 "generates when it sets no max_tokens (policy.generation."
                                                 "max_new_tokens); --max-model-len bounds them all."),
    max_model_len: Optional[int] = typer.Option(None, "--max-model-len", min=1, help="Longest prompt + generation "
                                                "of one request (policy.max_total_sequence_length)."),
    temperature: Optional[float] = typer.Option(None, "--temperature", help="Default temperature; a request's own "
                                                "wins (policy.generation.temperature)."),
    top_p: Optional[float] = typer.Option(None, "--top-p", help="Default top_p; a request's own wins."),
    top_k: Optional[int] = typer.Option(None, "--top-k", help="Default top_k; a request's own wins (0: off)."),
    tool_parser: str = typer.Option("hermes", "--tool-parser", help="How tool calls are read from a turn when a "
                                    "request has tools: hermes, or module:Class."),
    max_queue: int = typer.Option(1024, "--max-queue", min=1, help="Requests that may wait for generation; beyond, "
                                  "HTTP 429."),
    request_timeout: float = typer.Option(300.0, "--request-timeout", min=0.001, help="Seconds one request may take "
                                          "(queue + generation); beyond, HTTP 504."),
    log_requests: bool = typer.Option(False, "--log-requests", help="One line on stderr per request."),
    step: Optional[int] = typer.Option(None, "--step", help="A run directory's checkpoint of this step."),
    best: bool = typer.Option(False, "--best", help="A run directory's best checkpoint by checkpointing.metric_name."),
) -> None:
    """Serve MODEL behind an OpenAI-compatible endpoint (chat, completions, responses, tokenize) until
    SIGINT or SIGTERM, then exit 0.

    Answers carry the turn's exact token ids and logprobs (prompt_token_ids, generation_token_ids,
    generation_log_probs); a base URL of http://HOST:PORT/sessions/<id>/v1 records a session's turns
    as a training run would. Prints the base URL once it listens.
    """
    flags = {"policy.generation.backend": backend, "policy.generation.max_new_tokens": max_new_tokens,
             "policy.generation.temperature": temperature, "policy.generation.top_p": top_p,
             "policy.generation.top_k": top_k or None,
             "policy.max_total_sequence_length": max_model_len}
    request = ServeRequest(model=model, overrides=list(overrides or []), files=[str(c) for c in config or []],
                           plugin_modules=list(plugin_modules or []), host=host, port=port, api_key=api_key or None,
                           model_name=model_name, flags={k: v for k, v in flags.items() if v is not None},
                           top_k_off=top_k == 0, tool_parser=tool_parser, max_queue=max_queue,
                           request_timeout_s=request_timeout, log_requests=log_requests, step=step, best=best)
    guarded(lambda: _serve(request))


# The flags' config keys, to name the flag in a config problem.
_FLAG_OF = {"policy.generation.backend": "--backend", "policy.generation.max_new_tokens": "--max-new-tokens",
            "policy.generation.temperature": "--temperature", "policy.generation.top_p": "--top-p",
            "policy.generation.top_k": "--top-k", "policy.max_total_sequence_length": "--max-model-len"}


@attrs.frozen(kw_only=True)
class ServeRequest:
    model: str
    overrides: list[str] = attrs.field(factory=list)
    files: list[str] = attrs.field(factory=list)
    plugin_modules: list[str] = attrs.field(factory=list)
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    model_name: str | None = None
    flags: dict[str, Any] = attrs.field(factory=dict)  # config key -> value of the flags given
    top_k_off: bool = False  # --top-k 0
    tool_parser: str = "hermes"
    max_queue: int = 1024
    request_timeout_s: float = 300.0
    log_requests: bool = False
    step: int | None = None
    best: bool = False


@attrs.frozen(kw_only=True)
class ModelSource:
    """What MODEL names."""

    model_name: str  # policy.model_name: a directory, a hub id or builtin:NAME
    saved_config: Path | None  # the config whose policy and cluster sections are the base
    label: str  # for the banner: where the weights come from
    default_name: str  # --model-name's default


def model_source(model: str, step: int | None = None, best: bool = False) -> ModelSource:
    """MODEL as a model to load: a model directory as it is, a run directory as its chosen checkpoint's
    policy (`grpoctl export`'s choice), a checkpoint directory as its policy. ServeError when MODEL names
    nothing servable."""
    from grpo_sdk.config.files import BUILTIN_RECIPE
    from grpo_sdk.core.models import looks_local

    path = Path(model).expanduser()
    gguf = _gguf_source(model)
    if gguf is not None:
        _no_checkpoint_choice(model, step, best)
        return gguf
    if model.startswith("builtin:"):
        _no_checkpoint_choice(model, step, best)
        return ModelSource(model_name=model, saved_config=BUILTIN_RECIPE, label=model,
                           default_name=model.split(":", 1)[1])
    if not path.exists():
        if looks_local(model):
            raise ServeError(f"MODEL: no such directory: {model}")
        _no_checkpoint_choice(model, step, best)
        return ModelSource(model_name=model, saved_config=None, label=f"hub {model}", default_name=model)
    if not path.is_dir():
        raise ServeError(f"MODEL: {model} is a file; expected a model directory, a run directory or a checkpoint")
    name = path.resolve().name
    if (path / "config.json").is_file():  # a Hugging Face model directory (an exported policy too)
        _no_checkpoint_choice(model, step, best)
        return ModelSource(model_name=str(path), saved_config=None, label=str(path), default_name=name)
    if (path / _SAVED_CONFIG).is_file() or (path / "checkpoints").is_dir():  # a run directory
        from grpo_sdk.trainer.checkpoint import chosen_checkpoint

        try:
            checkpoint = chosen_checkpoint(path, step=step, best=best)
        except ConfigError as exc:
            raise ServeError(_one_line(exc)) from None
        saved = path / _SAVED_CONFIG
        return _checkpoint_source(checkpoint, saved if saved.is_file() else None, name)
    if (path / "policy").is_dir() and path.name.startswith("step_"):  # one checkpoint: <run>/checkpoints/step_N
        _no_checkpoint_choice(model, step, best)
        saved = path.resolve().parent.parent / _SAVED_CONFIG  # the default layout; elsewhere: no run config
        return _checkpoint_source(path, saved if saved.is_file() else None, name)
    raise ServeError(f"MODEL: {model} is neither a Hugging Face model directory (no config.json), a run directory "
                     f"(no {_SAVED_CONFIG} or checkpoints/) nor a checkpoint (no policy/)")


def _gguf_source(model: str) -> ModelSource | None:
    """A GGUF file, or a built-in that is a packaged one, as its cached model directory (converted here
    when it is not cached), so its own config.json gives the context length; None for anything else."""
    from grpo_sdk.core.builtin_models import packaged_file
    from grpo_sdk.core.gguf_cache import is_gguf
    from grpo_sdk.core.models import resolve_model_source

    if not is_gguf(model) and packaged_file(model, key="MODEL") is None:
        return None
    directory = resolve_model_source(model, key="MODEL")
    name = model.split(":", 1)[1] if model.startswith("builtin:") else Path(model).stem
    return ModelSource(model_name=directory, saved_config=None, label=f"{model} (as {directory})", default_name=name)


def _checkpoint_source(checkpoint: Path, saved: Path | None, name: str) -> ModelSource:
    policy = checkpoint / "policy"
    if (policy / "adapter_config.json").is_file() and not (policy / "config.json").is_file():
        raise ServeError(f"MODEL: {policy} holds LoRA adapters only (policy.lora); merge them into a model directory "
                         f"with `grpoctl export RUN_DIR DIR --step {checkpoint.name.split('_')[-1]}` and serve DIR")
    if not (policy / "config.json").is_file():
        raise ServeError(f"MODEL: {policy} holds no config.json: this checkpoint's policy is not a Hugging Face model "
                         "directory (a policy backend that saves another format); serve a model directory instead")
    return ModelSource(model_name=str(policy), saved_config=saved, label=f"checkpoint {checkpoint}", default_name=name)


def _no_checkpoint_choice(model: str, step: int | None, best: bool) -> None:
    if step is not None or best:
        raise ServeError(f"--step and --best choose among a run directory's checkpoints; {model} is not a run directory")


def _one_line(exc: ConfigError) -> str:
    return "; ".join(f"{_FLAG_OF.get(key, key)}: {message}" if key else message for key, message in exc.problems)


def check_listen(host: str, port: int, api_key: str | None) -> None:
    """Before any model is loaded: the host needs a key unless it is loopback, and the port must be free."""
    from grpo_sdk.serving.server import is_loopback

    if not is_loopback(host) and not api_key:
        raise ServeError(f"--host {host} would serve beyond this machine without an API key: set --api-key (or "
                         f"{API_KEY_ENV}), or listen on 127.0.0.1")
    if port == 0:
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:  # as http.server binds: IPv4, SO_REUSEADDR
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise ServeError(_listen_problem(host, port, exc)) from None


def _listen_problem(host: str, port: int, exc: OSError) -> str:
    return f"cannot listen on {host}:{port}: {exc.strerror or exc} (another --port, or --port 0 for any free one)"


def serve_config(request: ServeRequest, source: ModelSource, scratch: Path, registry: Any) -> Any:
    """The MasterConfig served by: the base sections of the run's (or built-in recipe's) config, or for
    a model directory its own context length (and at most half of it generated by default); then the
    -c files, the overrides, and last MODEL and the flags."""
    import yaml

    from grpo_sdk.config.files import read_yaml
    from grpo_sdk.config.loading import load_config

    base: dict[str, Any] = {}
    if source.saved_config is not None:
        saved = read_yaml(source.saved_config)
        base = {key: saved[key] for key in _SECTIONS if isinstance(saved.get(key), dict)}
        seed = (saved.get("grpo") or {}).get("seed")
        if seed is not None:
            base["grpo"] = {"seed": seed}
    elif (context := model_context(source.model_name)) is not None:  # a model directory: its own context length
        from grpo_sdk.config.schema import GenerationConfig

        default_new = attrs.fields(GenerationConfig).max_new_tokens.default
        base = {"policy": {"max_total_sequence_length": context,
                           "generation": {"max_new_tokens": min(default_new, max(1, context // 2))}}}
    base_file = scratch / "serve-base.yaml"
    base_file.write_text(yaml.safe_dump(base), encoding="utf-8")
    flags = [f"policy.model_name={json.dumps(source.model_name)}"]
    flags += [f"{key}={json.dumps(value)}" for key, value in request.flags.items()]
    if request.top_k_off:
        flags.append("policy.generation.top_k=null")
    try:
        return load_config([str(base_file), *request.files], [*request.overrides, *flags], registry)
    except ConfigError as exc:
        if len(exc.problems) == 1:
            raise ServeError(_one_line(exc)) from None
        raise ConfigError([(_FLAG_OF.get(key, key), message) for key, message in exc.problems]) from None


def model_context(model_dir: str) -> int | None:
    """The context length a local model directory's config.json declares, when it declares one."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = config.get(key) if isinstance(config, dict) else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 1:
            return value
    return None


def _serve(request: ServeRequest) -> None:
    from grpo_sdk.plugins.tools import tool_call_parser

    check_listen(request.host, request.port, request.api_key)
    try:
        tool_call_parser(request.tool_parser, "--tool-parser")
    except ConfigError as exc:
        raise ServeError(_one_line(exc)) from None
    source = model_source(request.model, request.step, request.best)
    registry = load_plugin_modules(request.plugin_modules)
    with tempfile.TemporaryDirectory(prefix="grpoctl-serve-") as scratch:
        cfg = serve_config(request, source, Path(scratch), registry)
        from grpo_sdk.trainer.launch import quiet_progress_bars

        with quiet_progress_bars():
            _serve_config(request, source, cfg, Path(scratch), registry)


def _serve_config(request: ServeRequest, source: ModelSource, cfg: MasterConfig, scratch: Path, registry: Any) -> None:
    import torch

    from grpo_sdk.config.schema import plugin_config
    from grpo_sdk.config.context import RunContext
    from grpo_sdk.core.machine import pick_device
    from grpo_sdk.core.models import load_tokenizer
    from grpo_sdk.core.records import SamplingParams
    from grpo_sdk.runtime import make_runtime
    from grpo_sdk.serving.endpoint import Endpoint, EndpointSettings
    from grpo_sdk.serving.engine import GenerationEngine
    from grpo_sdk.serving.server import RolloutServer
    from grpo_sdk.trainer.run_dir import initial_model_path

    if cfg.cluster.num_threads:
        torch.set_num_threads(cfg.cluster.num_threads)
    gen = cfg.policy.generation
    print(f"grpoctl serve: loading {source.label} ({gen.backend} backend)", file=sys.stderr, flush=True)
    model_path = initial_model_path(cfg.policy.model_name, scratch, cfg.grpo.seed)  # builtin:NAME is built here
    tokenizer_key = "policy.tokenizer.name" if cfg.policy.tokenizer.name else "MODEL"
    try:
        tokenizer = load_tokenizer(cfg.policy.tokenizer.name or model_path, key=tokenizer_key)
    except ModelLoadError as exc:  # a hub id that names nothing, a directory without a tokenizer
        raise ServeError(str(exc)) from None
    context = RunContext(config=cfg, run_dir=scratch, model_path=model_path,
                         tokenizer_path=cfg.policy.tokenizer.name or model_path,
                         device=pick_device(cfg.cluster.device) if cfg.cluster.runtime == "local" else cfg.cluster.device,
                         seed=cfg.grpo.seed, needs_reference=False, registry=registry,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    opened: list[Any] = []  # what to close, in the order it was opened
    try:
        runtime = make_runtime(cfg, registry)
        opened.append(runtime.shutdown)
        generation = runtime.build("generation", gen.backend, plugin_config(gen, gen.backend), context)
        if callable(getattr(generation, "shutdown", None)):
            opened.append(generation.shutdown)
        engine = GenerationEngine(generation, pad_token_id=tokenizer.pad_token_id, max_queue=request.max_queue)
        defaults = SamplingParams(max_new_tokens=gen.max_new_tokens, temperature=gen.temperature, top_p=gen.top_p,
                                  top_k=gen.top_k, stop_token_ids=tuple(gen.stop_token_ids))
        settings = EndpointSettings(model_name=request.model_name or source.default_name, sampling="request",
                                    defaults=defaults, max_total_tokens=cfg.policy.max_total_sequence_length,
                                    request_timeout_s=request.request_timeout_s, tool_parser=request.tool_parser)
        endpoint = Endpoint(engine, tokenizer, settings)
        try:
            server = RolloutServer(endpoint, host=request.host, port=request.port, api_key=request.api_key,
                                   log_requests=request.log_requests)
        except OSError as exc:  # taken while the model loaded
            raise ServeError(_listen_problem(request.host, request.port, exc)) from None
        except ConfigError as exc:
            raise ServeError(_one_line(exc)) from None
        with StopSignals() as stop:
            engine.start()
            opened.append(engine.stop)
            server.start()
            opened.append(server.stop)
            print(banner(server, settings.model_name, source.label, gen.backend, request.api_key is not None), flush=True)
            signum = stop.wait()
            print(f"grpoctl serve: {signal_name(signum)}: shutting down after {engine.served} generations",
                  file=sys.stderr, flush=True)
            _close(opened)
    finally:  # whatever is still open (a failed start, a second signal): newest first
        _close(opened)


def _close(opened: list[Any]) -> None:
    while opened:
        opened.pop()()


def banner(server: Any, model_name: str, label: str, backend: str, keyed: bool) -> str:
    """The line that says the endpoint listens: its base URL and a request to try."""
    body = json.dumps({"model": model_name, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 16})
    auth = f' -H "Authorization: Bearer ${API_KEY_ENV}"' if keyed else ""
    return (f"serving {model_name} ({label}, {backend}) at {server.base_url}  try: curl -s "
            f"{server.base_url}/chat/completions -H 'Content-Type: application/json'{auth} -d '{body}'")


class StopSignals:
    """While serving: the first SIGINT, SIGTERM or SIGHUP asks for a clean shutdown (``wait`` returns
    it); another one while shutting down stops at once (``StopNow``: exit 128 + its number). The
    handlers in place before (grpoctl's ``STOP``) come back on exit."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._event = threading.Event()
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        for signum in SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)

    def _handle(self, signum: int, frame: object) -> None:
        if self.signum is not None:
            raise StopNow(signum)
        self.signum = signum
        self._event.set()

    def wait(self) -> int:
        while not self._event.wait(0.5):  # a timeout: the main thread wakes to run a handler on every platform
            pass
        return self.signum
