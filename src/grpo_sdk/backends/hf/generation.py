"""hf generation: sampling over a transformers model with a KV cache.

Hand-written rather than ``model.generate``: it returns the logprob of every sampled token under
exactly the distribution it sampled from, stops each row at its first stop token or its budget, and
carries none of ``generate``'s per-token machinery (logits processors, stopping criteria), which
dominates the cost on small models. Two loops: the continuous-batching sampler (sampler.py, the
default: finished rows leave, waiting rows join, one prefill per prompt, per-row seeds, a prefix
cache for continuations; it also serves ``AsyncGeneration``'s submit / poll), and the whole-batch
loop below (``continuous_batching=false``, and always with ``compile``, whose graphs need static
shapes), which decodes every row until the longest ends.

In-flight weight updates (async GRPO, docs/async.md): ``update_weights`` from another thread lands
between two decode steps, never inside a forward pass (``StepGate``). The tokens sampled after it
carry the new version in ``token_weight_versions``; before the next token the request either
re-prefills prompt + tokens so far under the new weights (``resume_generation(recompute_kv_cache=
True)``, AReaL style) or continues on the KV cache the old weights wrote (Magistral style). Either
way a token's logprob is that of the distribution it was sampled from, never re-scored.

One model in one process: when the hf policy lives in the same process (``cluster.runtime=local``;
``policy.generation.hf.share_policy_model``, config.py says when), the generation samples with the
policy's own module, found with ``grpo_sdk.plugins.toolkit.published_policy``: no second copy, and ``update_weights``
reads nothing (the module already holds the trained weights) but still moves the weight version.
It samples under ``torch.no_grad`` (never ``inference_mode``, whose tensors a module could cache and
training could not use), under the policy's autocast, and touches no gradient or optimizer state;
the policy's ``offload`` leaves a shared module in place. With a copy of its own, the generation
loads the model in ``policy.precision`` and samples under the same autocast as the policy.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import time
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch.func import functional_call

from grpo_sdk.backends.hf import lora
from grpo_sdk.backends.hf.config import (
    SHARE_KEY,
    HFGenerationConfig,
    policy_autocast,
    shares_policy_model,
)
from grpo_sdk.backends.hf.loading import autocast_context, load_model
from grpo_sdk.backends.hf.sampler import ContinuousSampler, Request, request_output
from grpo_sdk.backends.hf.step_gate import StepGate
from grpo_sdk.backends.hf.whole_batch import WholeBatchLoop, row_budgets, stop_token_ids
from grpo_sdk.plugins import (
    GenerationInput,
    GenerationOutput,
    RunContext,
    SamplingParams,
)
from grpo_sdk.plugins.tensors import DTYPES, draw_row_seeds
from grpo_sdk.plugins.toolkit import load_tokenizer, published_policy


class HFGeneration(WholeBatchLoop):
    """Samples with the hf policy's own module when it can (see the module docstring), else with a private
    copy of the model into which ``update_weights`` copies new weights in place.

    Implements ``PausesForRefit`` and declares ``in_flight_weight_updates``.
    """

    def __init__(self, config: HFGenerationConfig | None, context: RunContext):
        self.config = config = config or HFGenerationConfig()
        self.device = torch.device(context.device)
        # Compiled decoding passes 4D boolean masks, which SDPA reads as-is and eager attention does not.
        attn = "sdpa" if config.compile else config.attn_implementation
        self.policy = self._shared_policy(config, context)
        autocast = policy_autocast(context.config) if config.autocast == "policy" else config.autocast
        self.autocast_dtype = DTYPES.get(autocast)
        self.autocast = autocast_context(self.device, autocast)
        if self.policy is not None:
            self.model = self.policy.model
            self.policy.shared_with_generation = True
            self._weights = {}
        else:
            self.model = load_model(context.model_path, dtype=context.config.policy.precision,
                                    device=context.device, attn_implementation=attn)
            self.model.requires_grad_(False)
            self._weights = dict(self.model.state_dict())
        tokenizer = load_tokenizer(context.tokenizer_path)
        self.eos_token_id = tokenizer.eos_token_id
        self.pad_token_id = tokenizer.pad_token_id
        self.generator = torch.Generator(device=self.device).manual_seed(context.seed)
        self.weight_version = 0
        # transformers 5.2x renamed `past_key_values` to `cache`; speak whichever this version knows.
        forward_args = inspect.signature(self.model.forward).parameters
        self.cache_arg = "cache" if "cache" in forward_args else "past_key_values"
        self.prefill_args = {"logits_to_keep": 1} if "logits_to_keep" in forward_args else {}
        self.compiled_forward = torch.compile(self.model.forward, dynamic=False) if config.compile else None
        self._gate = StepGate(timeout_s=context.config.cluster.call_timeout_s)
        self._low_precision: tuple[int, dict[str, torch.Tensor]] | None = None  # (weight version, casts)
        self._folded: dict | None = None  # a shared LoRA policy's layers while it samples (_base_modules)
        # The continuous-batching sampler (sampler.py); compile keeps the whole-batch loop's static shapes.
        self.sampler = ContinuousSampler(self, config.max_num_seqs, config.prefix_cache_tokens) \
            if config.continuous_batching and not config.compile else None
        self._engine_lock = threading.Lock()  # one thread runs a sampler step at a time; any may drive it
        self._submitted: dict[str, Request] = {}  # AsyncGeneration requests not yet polled
        if self.sampler is not None:
            # AsyncGeneration only with the sampler (instance attributes, so ``isinstance`` answers per
            # backend): the whole-batch loop cannot take requests one at a time, and a caller that sees
            # no submit (the rollouts, the serving engine) batches its requests into generate instead.
            self.submit, self.poll, self.cancel = self._submit, self._poll, self._cancel

    def _shared_policy(self, config: HFGenerationConfig, context: RunContext):
        """The hf policy of this run and process whose module this generation samples with, or None."""
        if not shares_policy_model(context.config, config):
            return None
        policy = published_policy(context)
        if policy is None or getattr(policy, "model", None) is None or not hasattr(policy, "shared_with_generation"):
            if config.share_policy_model is True:
                raise RuntimeError(f"{SHARE_KEY}=true, but no hf policy of this run was built in this process before "
                                   "the generation (the runtime builds the policy first)")
            return None  # auto: e.g. a generation built on its own
        if torch.device(policy.device) != self.device:
            raise RuntimeError(f"{SHARE_KEY}: the hf policy is on {policy.device}, the generation on {self.device}")
        return policy

    @property
    def shares_policy_model(self) -> bool:
        return self.policy is not None

    @contextlib.contextmanager
    def _sampling_mode(self):
        if self.policy is None:
            with torch.inference_mode():
                yield
            return
        # A shared module keeps training: no inference tensors may end up cached in it. Its trained
        # parameters are frozen while it samples: CPU kernels take another path for weights that
        # require grad (last-bit differences, measured), and a copy's weights do not.
        trained = [p for p in self.model.parameters() if p.requires_grad]
        try:
            for param in trained:
                param.requires_grad_(False)
            with torch.no_grad():
                yield
        finally:
            for param in trained:
                param.requires_grad_(True)

    def generate(self, prompts: GenerationInput, sampling: SamplingParams) -> GenerationOutput:
        if self.sampler is not None:
            return self._generate_continuous(prompts, sampling)
        with self._sampling_mode(), self.autocast(), self._base_modules() as self._folded:
            try:
                return self._generate(prompts, sampling)
            finally:
                self._low_precision = self._folded = None  # the casts live for one call: weights move in training

    # --- the continuous-batching sampler: generate, and AsyncGeneration's submit / poll / cancel -----

    def _seeds(self, prompts: GenerationInput, sampling: SamplingParams) -> list[int]:
        """Each row's sampling seed: the caller's, else drawn from this backend's RNG (one draw per call,
        so a checkpointed RNG resumes exactly), or from ``sampling.seed`` (validation)."""
        if prompts.seeds is not None:
            return [int(s) for s in prompts.seeds.tolist()]
        return draw_row_seeds(self.generator, prompts.input_ids.shape[0], sampling.seed).tolist()

    def _add(self, request_id: object, prompts: GenerationInput, sampling: SamplingParams) -> Request:
        budgets = row_budgets(prompts, sampling.max_new_tokens, torch.device("cpu")).tolist()
        stops = frozenset(stop_token_ids(self.eos_token_id, sampling, torch.device("cpu")).tolist())
        with self._engine_lock:
            return self.sampler.add(request_id, prompts, sampling, self._seeds(prompts, sampling), budgets, stops)

    def _step(self) -> None:
        """One sampler step, under the locks and modes a forward pass needs (callers hold no lock). A
        failure fails every request in the sampler: their state is the error's."""
        with self._engine_lock:
            if self.sampler.idle:
                return
            with self._sampling_mode(), self.autocast(), self._base_modules() as self._folded:
                try:
                    self.sampler.step(self._between_decode_steps)
                except BaseException as exc:
                    self.sampler.fail(exc)
                    raise
                finally:
                    self._folded = None
                    if self.sampler.idle:
                        self._low_precision = None  # the casts live while rows run: weights move in training

    def _generate_continuous(self, prompts: GenerationInput, sampling: SamplingParams) -> GenerationOutput:
        with self._gate.generation():
            request = self._add(object(), prompts, sampling)
            while request.open and request.error is None:
                self._step()
        if request.error is not None:
            raise request.error
        return request_output(request, self.pad_token_id)

    def _submit(self, request_id: str, prompts: GenerationInput, sampling: SamplingParams) -> None:
        """Queue a request; ``poll`` runs the sampler (in the caller's thread) and returns it when done."""
        if request_id in self._submitted:
            raise ValueError(f"hf generation: request {request_id!r} was submitted and not yet polled")
        self._submitted[request_id] = self._add(request_id, prompts, sampling)

    def _poll(self, timeout_s: float) -> list[tuple[str, GenerationOutput | BaseException]]:
        """Run sampler steps until a submitted request finishes or ``timeout_s`` passes; every finished
        request (or its error). While paused (without keeping requests in flight) nothing runs."""
        deadline = time.monotonic() + timeout_s
        while True:
            done = [(rid, r) for rid, r in list(self._submitted.items()) if r.open == 0 or r.error is not None]
            if done or not self._submitted or time.monotonic() >= deadline:
                for rid, _ in done:
                    del self._submitted[rid]
                return [(rid, r.error if r.error is not None else request_output(r, self.pad_token_id))
                        for rid, r in done]
            with self._gate.polling() as admitted:
                if not admitted:
                    time.sleep(min(0.01, max(0.0, deadline - time.monotonic())))
                    continue
                with contextlib.suppress(Exception):  # the failed requests carry the error to their poll
                    self._step()

    def _cancel(self, request_ids) -> None:
        ids = set(request_ids)
        with self._engine_lock:
            self.sampler.cancel(ids)
        for rid in ids:
            self._submitted.pop(rid, None)

    def _base_modules(self):
        """A shared LoRA policy under autocast samples as the merged model: its base Linears in place of
        peft's layers, each adapter folded into the base weight's cast (as the merged weight sync folds
        them). Elsewhere nothing changes."""
        if getattr(self.policy, "lora", None) is None or self.autocast_dtype is None:
            return contextlib.nullcontext()
        return lora.base_modules(self.model)

    def _forward(self, **kwargs):
        """The model's forward pass. Under autocast, the Linear weights are cast to the autocast dtype
        once per weight version and reused by every decode step: autocast itself caches a cast only
        for weights that require grad (sampling freezes them), so it would recast every weight at every
        token (~0.8 GB of memory traffic per token at 135M parameters). Autocast's cast of a weight is
        a plain rounding, so the tokens and logprobs are bit-identical; the embedding, norms and
        everything autocast leaves in float32 stay as they are."""
        if self.autocast_dtype is None or self.compiled_forward is not None:
            return self.model(**kwargs)
        if self._low_precision is None or self._low_precision[0] != self.weight_version:
            folded = self._folded or {}  # a LoRA layer's base Linear now sits at its name: cast with A and B in it
            casts = {f"{name}.weight": module.weight.to(self.autocast_dtype) if name not in folded else
                     lora.fold(folded[name], module.weight, folded[name].lora_A[lora.ADAPTER].weight,
                               folded[name].lora_B[lora.ADAPTER].weight, self.autocast_dtype)
                     for name, module in self.model.named_modules() if isinstance(module, torch.nn.Linear)}
            self._low_precision = (self.weight_version, casts)
        # tie_weights=False: a tied output embedding takes the cast, the input embedding keeps float32
        return functional_call(self.model, self._low_precision[1], (), kwargs, tie_weights=False, strict=False)
    def _between_decode_steps(self, next_token: int) -> None:
        """Called after token ``next_token - 1`` was sampled, before the forward pass that gives the
        logits of token ``next_token``: where an in-flight update lands. A seam for tests (a subclass
        overrides it to place a weight update at an exact step); does nothing here."""

    @torch.no_grad()
    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, version: int) -> None:
        """Copy in place; during a ``generate`` in another thread this waits for the running forward
        pass (at most one decode step) and the generation continues under the new weights. Sharing the
        policy's module: ``weights`` is not read (a lazy iterator never runs), only the version moves."""
        if self.policy is not None:
            with self._gate.update():
                self.weight_version = version
            return
        with self._gate.update():
            for name, tensor in weights:
                target = self._weights.get(name)
                if target is None:
                    raise KeyError(f"hf generation has no weight named {name!r}")
                target.copy_(tensor)
            self.weight_version = version

    def pause_generation(self, *, keep_in_flight: bool) -> None:
        """New ``generate`` calls wait until ``resume_generation``; ``keep_in_flight=False`` also waits
        for the running call to return. ``True`` returns at once: a running call keeps decoding and,
        if an update lands before the resume, waits at its next step for the resume to say whether
        to recompute its cache."""
        self._gate.pause(keep_in_flight=keep_in_flight)

    def resume_generation(self, *, recompute_kv_cache: bool) -> None:
        """Let new calls in; requests in flight across an update re-prefill under the new weights
        (``recompute_kv_cache=True``) or keep their cache. The choice holds for updates made without
        a pause too (default: keep)."""
        self._gate.resume(recompute_kv_cache=recompute_kv_cache)

    def save_checkpoint(self, path: str) -> None:
        """The sampling RNG: with it, a resumed run samples exactly what the original would have."""
        Path(path).mkdir(parents=True, exist_ok=True)
        save_file({"generator": self.generator.get_state()}, str(Path(path) / "rng.safetensors"))

    def load_checkpoint(self, path: str) -> None:
        self.generator.set_state(load_file(str(Path(path) / "rng.safetensors"))["generator"])

    def prepare_for_generation(self) -> None:
        if self.policy is not None and next(self.model.parameters()).device != self.device:
            self.policy.onload()  # an offload before the module was shared: sample where the policy trains

    def finish_generation(self) -> None:
        if self.sampler is not None:
            self.sampler.prefixes.clear()  # a colocated policy trains next: hold no KV

    def shutdown(self) -> None:
        if self.policy is not None:
            self.policy.shared_with_generation = False
        self.model = self.policy = None
        self._weights = {}
