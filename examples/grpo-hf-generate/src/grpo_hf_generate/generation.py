"""A Generation backend on ``model.generate``: the protocol in about 60 lines."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo_sdk.plugins import GenerationInput, GenerationOutput, RunContext, SamplingParams


class HFGenerateGeneration:
    def __init__(self, config, context: RunContext):
        self.model = AutoModelForCausalLM.from_pretrained(context.model_path).to(context.device).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(context.tokenizer_path)
        self.device = context.device
        self.weight_version = 0
        torch.manual_seed(context.seed)

    @torch.inference_mode()
    def generate(self, prompts: GenerationInput, sampling: SamplingParams) -> GenerationOutput:
        pad = self.tokenizer.pad_token_id
        stop_ids = [self.tokenizer.eos_token_id, *sampling.stop_token_ids]
        out = self.model.generate(
            input_ids=prompts.input_ids.to(self.device), attention_mask=prompts.attention_mask.to(self.device),
            do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k or 0,
            max_new_tokens=sampling.max_new_tokens, eos_token_id=stop_ids, pad_token_id=pad,
            output_scores=True, return_dict_in_generate=True)
        tokens = out.sequences[:, prompts.input_ids.shape[1]:]
        # `scores` are the processed logits each token was sampled from (temperature, top-k/p applied).
        scores = torch.stack(out.scores, dim=1).float()
        logprobs = torch.log_softmax(scores, dim=-1).gather(-1, tokens[..., None]).squeeze(-1)
        is_stop = torch.isin(tokens, torch.tensor(stop_ids, device=tokens.device))
        # a row ends at its first stop token (included); everything after it is padding
        after_stop = (is_stop.cumsum(1) - is_stop.long()) > 0
        lengths = (~after_stop).sum(1)
        truncated = ~is_stop.any(1)
        tokens = tokens.masked_fill(after_stop, pad)
        logprobs = logprobs.masked_fill(after_stop, 0.0)
        return GenerationOutput(response_ids=tokens.cpu(), response_lengths=lengths.cpu(), logprobs=logprobs.cpu(),
                                truncated=truncated.cpu(), weight_version=self.weight_version)

    @torch.no_grad()
    def update_weights(self, weights, *, version: int) -> None:
        own = self.model.state_dict()
        for name, tensor in weights:
            own[name].copy_(tensor)
        self.weight_version = version

    def prepare_for_generation(self) -> None:
        pass

    def finish_generation(self) -> None:
        pass

    def shutdown(self) -> None:
        self.model = None
