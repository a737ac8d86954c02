"""hf generation: a batched sampling loop over a transformers model with a KV cache.

A hand-written loop rather than ``model.generate``: it returns the logprob of every sampled
token under exactly the distribution it sampled from, stops each row at its first stop token,
and carries none of ``generate``'s per-token machinery (logits processors, stopping criteria),
which dominates the cost on small models.
"""

from __future__ import annotations

import inspect
from typing import Iterable

import torch

from grpo_sdk.algorithms.sampling import process_logits
from grpo_sdk.backends.hf.config import HFGenerationConfig
from grpo_sdk.backends.hf.loading import load_model, position_ids_for
from grpo_sdk.core.context import RunContext
from grpo_sdk.core.models import load_tokenizer
from grpo_sdk.core.records import GenerationInput, GenerationOutput, SamplingParams


class HFGeneration:
    """Samples with a private copy of the model; ``update_weights`` copies new weights in place."""

    def __init__(self, config: HFGenerationConfig | None, context: RunContext):
        config = config or HFGenerationConfig()
        self.device = torch.device(context.device)
        self.model = load_model(context.model_path, dtype=context.config.policy.precision, device=context.device,
                                attn_implementation=config.attn_implementation)
        self.model.requires_grad_(False)
        tokenizer = load_tokenizer(context.tokenizer_path)
        self.eos_token_id = tokenizer.eos_token_id
        self.pad_token_id = tokenizer.pad_token_id
        self.generator = torch.Generator(device=self.device).manual_seed(context.seed)
        self.weight_version = 0
        self._weights = dict(self.model.state_dict())
        # transformers 5.2x renamed `past_key_values` to `cache`; speak whichever this version knows.
        self.cache_arg = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"

    @torch.inference_mode()
    def generate(self, prompts: GenerationInput, sampling: SamplingParams) -> GenerationOutput:
        input_ids = prompts.input_ids.to(self.device)
        attention_mask = prompts.attention_mask.to(self.device)
        rows = input_ids.shape[0]
        stop_ids = torch.tensor([self.eos_token_id, *sampling.stop_token_ids], device=self.device)
        tokens = torch.full((rows, sampling.max_new_tokens), self.pad_token_id, dtype=torch.long, device=self.device)
        logprobs = torch.zeros((rows, sampling.max_new_tokens), dtype=torch.float32, device=self.device)
        lengths = torch.zeros(rows, dtype=torch.long, device=self.device)
        finished = torch.zeros(rows, dtype=torch.bool, device=self.device)

        positions = position_ids_for(attention_mask)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=True)
        next_position = positions[:, -1:] + 1
        for t in range(sampling.max_new_tokens):
            logits = process_logits(out.logits[:, -1, :].float(), sampling.temperature, sampling.top_k,
                                    sampling.top_p)
            step_logprobs = torch.log_softmax(logits, dim=-1)
            token = torch.multinomial(step_logprobs.exp(), 1, generator=self.generator).squeeze(-1)
            token_logprob = step_logprobs.gather(-1, token[:, None]).squeeze(-1)
            alive = ~finished
            tokens[:, t] = torch.where(alive, token, self.pad_token_id)
            logprobs[:, t] = torch.where(alive, token_logprob, 0.0)
            lengths += alive.long()
            finished |= torch.isin(token, stop_ids)
            if t + 1 == sampling.max_new_tokens or bool(finished.all()):
                break
            attention_mask = torch.cat([attention_mask, torch.ones_like(attention_mask[:, :1])], dim=1)
            out = self.model(input_ids=tokens[:, t:t + 1], attention_mask=attention_mask, position_ids=next_position,
                             use_cache=True, **{self.cache_arg: getattr(out, self.cache_arg)})
            next_position = next_position + 1
        width = int(lengths.max()) if rows else 0
        return GenerationOutput(
            response_ids=tokens[:, :width].cpu(), response_lengths=lengths.cpu(), logprobs=logprobs[:, :width].cpu(),
            truncated=(~finished).cpu(), weight_version=self.weight_version,
        )

    @torch.no_grad()
    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, version: int) -> None:
        for name, tensor in weights:
            target = self._weights.get(name)
            if target is None:
                raise KeyError(f"hf generation has no weight named {name!r}")
            target.copy_(tensor)
        self.weight_version = version

    def prepare_for_generation(self) -> None:
        pass  # one private model on one device: nothing to wake up

    def finish_generation(self) -> None:
        pass

    def shutdown(self) -> None:
        self.model = None
        self._weights = {}
