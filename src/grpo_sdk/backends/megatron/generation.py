"""megatron generation: sampling on a Megatron-Core ``GPTModel`` with Megatron-Core's KV cache.

What runs: a batched decode loop of this module over the mcore ``GPTModel``, whose attention keeps its
keys and values in Megatron-Core's ``StaticInferenceContext`` (the KV cache of mcore's static
inference path, megatron/core/inference/contexts/static_context.py). Sampling is the hf backend's
(``sample_rows``): ``process_logits`` (temperature, top-k, top-p) then ``log_softmax``, so each token's
logprob is that of the distribution it was drawn from (processed logprobs), each row drawing from its
own seeded stream (``GenerationInput.seeds``, else seeds drawn from this backend's generator), so with
the same seeds the two backends sample the same tokens; EOS and ``stop_token_ids`` end a row, and
``GenerationInput.max_new_tokens`` bounds each row.

Why not Megatron-Core's engines (measured with megatron-core 0.16.1 on this CPU, cpu_shims applied):

* ``DynamicInferenceEngine``: the ``DynamicInferenceContext`` builds; then, one shim at a time,
  ``TextGenerationController`` fails at text_generation_controllers/text_generation_controller.py:115
  (``pin_memory=True``: "requires a CUDA or other accelerator backend"), the engine at
  engines/dynamic_engine.py:256 (``torch.cuda.Event``: "Tried to instantiate dummy base class Event")
  and its first step at dynamic_engine.py:1191 (``torch.cuda.nvtx.range_push``: "NVTX functions not
  installed"). With those three patched too, the step stops at transformer/attention.py:926,
  ``assert HAVE_FA3 or is_fa_min_version("2.7.3")`` -> ``ModuleNotFoundError: No module named
  'flash_attn'``: its paged-KV attention is flash-attn's CUDA kernels (``flash_decode_and_prefill``,
  attention.py:756), so the dynamic engine cannot run without CUDA.
* ``StaticInferenceEngine(legacy=True)``: runs here with those extra shims and its greedy tokens equal
  a plain argmax loop's, but in 0.16.1 its logprobs are raw (``log_softmax`` of the unprocessed
  logits; design/megatron-config.md §2b), it reseeds torch's global RNG on every ``generate``
  (static_engine.py:270) and it ends a request only on one ``termination_id``.

So this loop uses the static engine's KV cache and does the sampling itself. The plan on GPU is the
dynamic engine (megatron-core 0.19.2: ``InferenceConfig(logprobs_mode="processed_logprobs")``,
``add_request`` + ``step_modern``; design/megatron-config.md §2c); it is not built, and nothing here
has run on a GPU.

Megatron-Core's RoPE ignores ``position_ids`` (see the policy's ``_sequence_logprobs``), so each
left-padded prompt is rolled to start at column 0. Prompts of different lengths then share one KV
cache offset: decoding starts at the shortest prompt's end, and a longer prompt feeds its own next
token until it runs out (as mcore's static controller does), so every token sits at its true position.

Weights: colocated with the megatron policy in one process (``colocated``), the generation runs on the
policy's model itself: ``update_weights`` has nothing to load and does not read the weights it is
given (so the policy's Hugging Face export never runs). Otherwise it builds its own model from the
model directory through mbridge and ``update_weights`` imports Hugging Face-named tensors through the
bridge's name mapping, in place.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Iterable

import torch
from safetensors.torch import load_file, save_file

from grpo_sdk.backends.megatron import colocated
from grpo_sdk.backends.megatron.bridging import adapt_bridge
from grpo_sdk.backends.megatron.policy import causal_padding_mask, init_parallel_state
from grpo_sdk.plugins import GenerationInput, GenerationOutput, RunContext, SamplingParams
from grpo_sdk.plugins.tensors import DTYPES, draw_row_seeds, sample_rows
from grpo_sdk.plugins.toolkit import load_tokenizer


class _InMemoryWeights:
    """The two reads mbridge's ``load_weights`` makes of a checkpoint (mbridge/core/bridge.py:188, 200),
    answered from tensors in memory: the bridge then does its own HF -> mcore conversion (QKV and
    gate/up fusion, vocab padding, TP split) and copies into the parameters in place."""

    def __init__(self, weights: dict[str, torch.Tensor]):
        self.weights = weights

    def load_some_hf_weight(self, names: list[str]) -> dict[str, torch.Tensor]:
        missing = [n for n in names if n not in self.weights]
        if missing:
            raise KeyError(f"megatron generation: update_weights lacks {len(missing)} weight(s) the model "
                           f"needs, e.g. {missing[:3]} (it takes every weight of the model at once)")
        return {n: self.weights[n] for n in names}

    def load_one_hf_weight(self, name: str) -> torch.Tensor:
        return self.load_some_hf_weight([name])[name]


def load_hf_weights(bridge: Any, models: list, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Copy Hugging Face-named ``weights`` into the mcore ``models`` through ``bridge``; returns the
    number of tensors given. mbridge reads a checkpoint only through ``_get_safetensor_io(path)``, so
    an instance attribute answering from memory replaces it for this call."""
    given = dict(weights)
    bridge._get_safetensor_io = lambda _path: _InMemoryWeights(given)
    try:
        bridge.load_weights(models, "<in memory>")
    finally:
        del bridge._get_safetensor_io
    return len(given)


class MegatronGeneration:
    """Samples with the mcore ``GPTModel``: the policy's own when colocated in one process, else its own.

    ``policy`` (a ``MegatronPolicy``) shares that policy's model explicitly; without it a colocated
    run finds the policy the runtime built first (``colocated.published_policy``).
    """

    def __init__(self, config: Any, context: RunContext, *, policy: Any = None):
        cfg = context.config
        self.device = torch.device(context.device)
        self.cpu = not torch.cuda.is_available()
        if self.cpu:
            from grpo_sdk.backends.megatron import cpu_shims

            cpu_shims.apply()  # process-wide, as the policy leaves them
        if context.eos_token_id is None:
            tokenizer = load_tokenizer(context.tokenizer_path)
            self.eos_token_id, self.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
        else:
            self.eos_token_id, self.pad_token_id = context.eos_token_id, context.pad_token_id
        self.generator = torch.Generator(device=self.device).manual_seed(context.seed)
        self.weight_version = 0
        if policy is None and colocated.shares_policy_model(cfg):
            policy = colocated.published_policy(context)
            if policy is None:
                warnings.warn("megatron generation: colocated, but no megatron policy of this run was published "
                              "in this process (colocated.publish_policy); it builds a model of its own, refit with "
                              "the policy's weights in Hugging Face names", RuntimeWarning, stacklevel=2)
        self.policy = policy
        if policy is not None:
            self.bridge, self.model, self.vocab_size = policy.bridge, policy.model, policy.vocab_size
        else:
            self._build(context)

    @property
    def shares_policy_model(self) -> bool:
        return self.policy is not None

    def _build(self, context: RunContext) -> None:
        from mbridge import AutoBridge

        init_parallel_state(None, context)  # TP = PP = 1 (the policy's, when it built it first)
        precision = context.config.policy.precision
        self.bridge = AutoBridge.from_pretrained(context.model_path, dtype=DTYPES[precision])
        adapt_bridge(self.bridge)
        # No dropout (its HF config may have some): sampling is from the eval-mode distribution.
        self.bridge.config.hidden_dropout = self.bridge.config.attention_dropout = 0.0
        self.models = self.bridge.get_model(bf16=precision == "bfloat16", fp16=precision == "float16",
                                            use_cpu_initialization=self.cpu, wrap_with_ddp=False)
        self.bridge.load_weights(self.models, context.model_path)
        (self.model,) = self.models
        self.model.to(self.device).eval().requires_grad_(False)
        self.vocab_size = self.bridge.hf_config.vocab_size

    # --- sampling -------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, prompts: GenerationInput, sampling: SamplingParams) -> GenerationOutput:
        ids, mask = prompts.input_ids.to(self.device), prompts.attention_mask.to(self.device)
        rows, width = ids.shape
        new_tokens = sampling.max_new_tokens
        if rows == 0:
            empty = torch.zeros((0, 0), dtype=torch.long)
            return GenerationOutput(response_ids=empty, response_lengths=torch.zeros(0, dtype=torch.long),
                                    logprobs=empty.float(), truncated=torch.zeros(0, dtype=torch.bool),
                                    weight_version=self.weight_version)
        lead = (mask.cumsum(-1) == 0).sum(-1)  # leading padding per row
        prompt_len = mask.sum(-1)
        cols = torch.arange(width, device=self.device)
        total = width + new_tokens
        seq = torch.full((rows, total), self.pad_token_id, dtype=torch.long, device=self.device)
        seq[:, :width] = ids.gather(1, (cols[None] + lead[:, None]) % width)  # each prompt from column 0

        stop_ids = torch.tensor([self.eos_token_id, *sampling.stop_token_ids], device=self.device)
        tokens = torch.full((rows, new_tokens), self.pad_token_id, dtype=torch.long, device=self.device)
        logprobs = torch.zeros((rows, new_tokens), dtype=torch.float32, device=self.device)
        lengths = torch.zeros(rows, dtype=torch.long, device=self.device)
        finished = torch.zeros(rows, dtype=torch.bool, device=self.device)
        row_index = torch.arange(rows, device=self.device)
        budgets = torch.full((rows,), new_tokens, dtype=torch.long, device=self.device)
        if prompts.max_new_tokens is not None:
            budgets = torch.minimum(budgets, prompts.max_new_tokens.to(self.device).long())
        # The backend's own generator moves only when the caller gave neither seeds nor sampling.seed.
        seeds = prompts.seeds if prompts.seeds is not None else draw_row_seeds(self.generator, rows, sampling.seed)

        start = int(prompt_len.min())
        if start == 0:
            raise ValueError("megatron generation: a prompt has no tokens")
        forward = _CachedForward(self.model, rows, total, self.device)
        last_logits = forward(seq[:, :start], 0)
        for position in range(start, total):
            # ``last_logits`` predict the token at ``position``; a row samples once its prompt is behind it.
            sampled_rows = (position >= prompt_len) & ~finished & (lengths < budgets)
            if bool(sampled_rows.any()):
                token, token_logprob = sample_rows(last_logits[:, :self.vocab_size], sampling, seeds, lengths)
                slot = lengths.clamp(max=new_tokens - 1)
                tokens[row_index, slot] = torch.where(sampled_rows, token, tokens[row_index, slot])
                logprobs[row_index, slot] = torch.where(sampled_rows, token_logprob, logprobs[row_index, slot])
                lengths += sampled_rows.long()
                finished |= sampled_rows & torch.isin(token, stop_ids)
                seq[:, position] = torch.where(sampled_rows, token, seq[:, position])
            if position + 1 == total or not bool((~finished & (lengths < budgets)).any()):
                break
            last_logits = forward(seq[:, position:position + 1], position)
        width_out = int(lengths.max())
        return GenerationOutput(
            response_ids=tokens[:, :width_out].cpu(), response_lengths=lengths.cpu(),
            logprobs=logprobs[:, :width_out].cpu(), truncated=(~finished).cpu(), weight_version=self.weight_version,
        )

    # --- weights and state ----------------------------------------------------------------------

    @torch.no_grad()
    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, version: int) -> None:
        """Colocated: the policy's model already holds the new weights, so ``weights`` is not read (a
        lazy ``named_weights()`` then never converts anything). Otherwise Hugging Face-named tensors,
        every weight of the model, imported in place through the bridge."""
        if self.policy is None:
            load_hf_weights(self.bridge, [self.model], weights)
        self.weight_version = version

    def save_checkpoint(self, path: str) -> None:
        """The sampling RNG: with it, a resumed run samples exactly what the original would have."""
        Path(path).mkdir(parents=True, exist_ok=True)
        save_file({"generator": self.generator.get_state()}, str(Path(path) / "rng.safetensors"))

    def load_checkpoint(self, path: str) -> None:
        self.generator.set_state(load_file(str(Path(path) / "rng.safetensors"))["generator"])

    def prepare_for_generation(self) -> None:
        # Colocated: the policy trains in train mode and returns to eval; sampling must not use dropout.
        self.model.eval()

    def finish_generation(self) -> None:
        pass  # the KV cache lives only inside one generate call

    def shutdown(self) -> None:
        self.model = self.models = self.policy = self.bridge = None


class _CachedForward:
    """Forward passes over one batch with Megatron-Core's static-inference KV cache: the first call
    prefills columns ``0..n-1``, each later one appends one column at ``position``."""

    def __init__(self, model: Any, rows: int, total: int, device: torch.device):
        from megatron.core.inference.contexts.static_context import StaticInferenceContext

        self.model = model
        self.context = StaticInferenceContext(max_batch_size=rows, max_sequence_length=total)
        self.full_mask = torch.ones((1, total), dtype=torch.long, device=device)

    def __call__(self, ids: torch.Tensor, position: int) -> torch.Tensor:
        rows, count = ids.shape
        positions = torch.arange(position, position + count, device=ids.device)[None].expand(rows, -1)
        # Queries ``position..position+count-1`` see keys ``0..position+count-1``, causally.
        mask = causal_padding_mask(self.full_mask[:, :position + count])[..., position:, :]
        logits = self.model(ids, positions, mask, inference_context=self.context, runtime_gather_output=True)
        self.context.increment_sequence_len_offset(count)
        return logits[:, -1]
