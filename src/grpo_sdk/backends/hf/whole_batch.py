"""The hf generation's whole-batch loop (``policy.generation.hf.continuous_batching=false``, and always
with ``compile``): every row decodes until the longest ends, each row prefilled on its own, one
generator for the batch. The loop before issue 35, kept for the compiled path (its graphs need static
shapes: a preallocated ``StaticCache`` and fixed-width masks) and as the benchmarks' "today".

A mixin of ``HFGeneration``: it reads the host's ``_forward``, ``_gate``, ``generator``, token ids
and ``_between_decode_steps`` seam.
"""

from __future__ import annotations

import torch

from grpo_sdk.plugins import GenerationInput, GenerationOutput, SamplingParams
from grpo_sdk.plugins.tensors import position_ids_for, sample_token


def stop_token_ids(eos_token_id: int, sampling: SamplingParams, device: torch.device) -> torch.Tensor:
    """The tokens that end a row: the tokenizer's EOS (unless ``ignore_eos``) and ``stop_token_ids``."""
    eos = () if sampling.ignore_eos else (eos_token_id,)
    return torch.tensor([*eos, *sampling.stop_token_ids], dtype=torch.long, device=device)


def row_budgets(prompts: GenerationInput, new_tokens: int, device: torch.device) -> torch.Tensor:
    """``[B]``: each row's token budget (``GenerationInput.max_new_tokens``, capped at ``new_tokens``)."""
    if prompts.max_new_tokens is None:
        return torch.full((prompts.input_ids.shape[0],), new_tokens, dtype=torch.long, device=device)
    return prompts.max_new_tokens.to(device=device, dtype=torch.long).clamp(0, new_tokens)



class WholeBatchLoop:
    def _generate(self, prompts: GenerationInput, sampling: SamplingParams) -> GenerationOutput:
        input_ids = prompts.input_ids.to(self.device)
        attention_mask = prompts.attention_mask.to(self.device)
        rows, new_tokens = input_ids.shape[0], sampling.max_new_tokens
        stop_ids = stop_token_ids(self.eos_token_id, sampling, self.device)
        budgets = row_budgets(prompts, new_tokens, self.device)
        tokens = torch.full((rows, new_tokens), self.pad_token_id, dtype=torch.long, device=self.device)
        logprobs = torch.zeros((rows, new_tokens), dtype=torch.float32, device=self.device)
        lengths = torch.zeros(rows, dtype=torch.long, device=self.device)
        stopped = torch.zeros(rows, dtype=torch.bool, device=self.device)
        finished = budgets == 0

        generator = self.generator
        if sampling.seed is not None:  # e.g. validation: reproducible, and training's RNG stream is unaffected
            generator = torch.Generator(device=self.device).manual_seed(sampling.seed)
        start = self._start_compiled if self.compiled_forward is not None else self._start_eager
        versions = []  # versions[t]: the weights whose forward pass gave the logits token t was sampled from
        with self._gate.generation():
            with self._gate.forward():
                version = first_version = self.weight_version
                last_logits, decode = start(input_ids, attention_mask, new_tokens)
            for t in range(new_tokens):
                versions.append(version)
                token, token_logprob = sample_token(last_logits, sampling, generator)
                alive = ~finished
                tokens[:, t] = torch.where(alive, token, self.pad_token_id)
                logprobs[:, t] = torch.where(alive, token_logprob, 0.0)
                lengths += alive.long()
                stopped |= alive & torch.isin(token, stop_ids)
                finished |= stopped | (lengths >= budgets)
                if t + 1 == new_tokens or bool(finished.all()):
                    break
                self._between_decode_steps(t + 1)
                with self._gate.forward(stale=lambda v=version: self.weight_version != v):
                    if self.weight_version != version and self._gate.recompute_kv_cache:
                        version = self.weight_version
                        last_logits, decode = self._recompute(input_ids, attention_mask, tokens, t + 1, new_tokens)
                    else:
                        version = self.weight_version  # keep: the new weights read the old weights' cache
                        last_logits = decode(tokens[:, t:t + 1], t)
        width = int(lengths.max()) if rows else 0
        return GenerationOutput(
            response_ids=tokens[:, :width].cpu(), response_lengths=lengths.cpu(), logprobs=logprobs[:, :width].cpu(),
            truncated=(~stopped).cpu(), weight_version=first_version,
            token_weight_versions=self._token_versions(versions, lengths, width),
        )

    def _recompute(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, tokens: torch.Tensor, k: int,
                   new_tokens: int):
        """Re-prefill prompt + the ``k`` tokens so far under the current weights (AReaL style): the last
        logits (of token ``k``) and a decode step that continues on the fresh cache. Always eager: a
        compiled re-prefill would compile a new graph for every swap point."""
        rows = input_ids.shape[0]
        ids = torch.cat([input_ids, tokens[:, :k]], dim=1)
        mask = torch.cat([attention_mask, attention_mask.new_ones((rows, k))], dim=1)
        last_logits, decode = self._start_eager(ids, mask, new_tokens - k)
        return last_logits, lambda token, t: decode(token, t - k)

    @staticmethod
    def _token_versions(versions: list[int], lengths: torch.Tensor, width: int) -> torch.Tensor | None:
        """``[B, width]`` versions of each token (padding: the oldest), or None when one version sampled all."""
        if len(set(versions)) <= 1:
            return None
        columns = torch.tensor(versions[:width], dtype=torch.long)
        valid = torch.arange(width)[None, :] < lengths.cpu()[:, None]
        return torch.where(valid, columns[None, :], versions[0])

    def _start_eager(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, new_tokens: int):
        """Prefill with a growing (dynamic) KV cache; returns the last logits and a decode step."""
        rows, width = input_ids.shape
        positions = position_ids_for(attention_mask)
        # The mask of every decode step is a prefix of this one: slicing beats a torch.cat per token.
        full_mask = torch.cat([attention_mask, attention_mask.new_ones((rows, new_tokens))], dim=1)
        out = self._forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=True,
                            **self.prefill_args)
        state = {"cache": getattr(out, self.cache_arg), "position": positions[:, -1:] + 1}

        def decode(token: torch.Tensor, t: int) -> torch.Tensor:
            out = self._forward(input_ids=token, attention_mask=full_mask[:, :width + t + 1],
                                position_ids=state["position"], use_cache=True, **{self.cache_arg: state["cache"]})
            state["cache"], state["position"] = getattr(out, self.cache_arg), state["position"] + 1
            return out.logits[:, -1]

        return out.logits[:, -1], decode

    def _start_compiled(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, new_tokens: int):
        """Prefill into a preallocated (static) KV cache with fixed-shape masks, so the compiled graphs
        are reused: one prefill and one decode graph per (rows, padded prompt width)."""
        from transformers import StaticCache

        extra = -input_ids.shape[1] % self.config.prompt_bucket
        if extra:  # left-pad to the bucket: fewer distinct shapes, fewer compilations
            input_ids = torch.nn.functional.pad(input_ids, (extra, 0), value=self.pad_token_id)
            attention_mask = torch.nn.functional.pad(attention_mask, (extra, 0), value=0)
        rows, width = input_ids.shape
        total = width + new_tokens
        cache = StaticCache(config=self.model.config, max_cache_len=total)
        padding = torch.cat([attention_mask.bool(), attention_mask.new_ones((rows, new_tokens), dtype=torch.bool)], 1)
        causal = torch.ones((width, total), dtype=torch.bool, device=self.device).tril()
        columns = torch.arange(total, device=self.device)
        positions = position_ids_for(attention_mask)
        # 4D boolean masks are used as given (no per-call mask building); SDPA reads them directly.
        out = self.compiled_forward(input_ids=input_ids, attention_mask=padding[:, None, None, :] & causal,
                                    position_ids=positions, use_cache=True, **self.prefill_args,
                                    **{self.cache_arg: cache})
        state = {"position": positions[:, -1:] + 1}

        def decode(token: torch.Tensor, t: int) -> torch.Tensor:
            mask = (padding & (columns <= width + t))[:, None, None, :]
            out = self.compiled_forward(input_ids=token, attention_mask=mask, position_ids=state["position"],
                                        use_cache=True, **{self.cache_arg: cache})
            state["position"] = state["position"] + 1
            return out.logits[:, -1]

        return out.logits[:, -1], decode
