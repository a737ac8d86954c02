"""In-flight weight updates in the hf generation backend (async GRPO, design/async-grpo.md §3.4-3.5):
a swap placed at an exact decode step, the versions and logprobs of the tokens on either side of it
(recompute: teacher-forced logprobs under the new weights; keep: a reference loop that keeps the
cache), concurrent updates never tearing a forward pass, ``PausesForRefit`` and its deadlines, the
Ray proxy and merge, and the contract kit's check of the capability."""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch

from helpers import prompt_batch
from grpo_sdk.backends.hf.generation import HFGeneration
from grpo_sdk.backends.hf.forward import position_ids_for, sequence_logprobs
from grpo_sdk.config.loading import load_config
from grpo_sdk.config.context import RunContext
from grpo_sdk.core.records import GenerationOutput, SamplingParams
from grpo_sdk.plugins import AsyncGeneration, GrpoSdkError, PausesForRefit
from grpo_sdk.plugins.tensors import process_logits

PROMPTS = ["1>", "12345>", "987>", "55555555>"]
SAMPLING = SamplingParams(max_new_tokens=10, temperature=1.0)


def make_context(model_dir, registry, *overrides):
    cfg = load_config(None, [f"policy.model_name={model_dir}", *overrides], registry)
    return RunContext(config=cfg, run_dir=model_dir, model_path=str(model_dir), tokenizer_path=str(model_dir),
                      device="cpu", seed=0, needs_reference=False)


class SwapAtStep(HFGeneration):
    """Test-only: ``at_step[k]()`` runs in the backend's seam ``_between_decode_steps`` right before the
    forward pass that gives the logits of token ``k``, so a weight update lands exactly there."""

    def __init__(self, config, context):
        super().__init__(config, context)
        self.at_step: dict[int, object] = {}

    def _between_decode_steps(self, next_token: int) -> None:
        action = self.at_step.pop(next_token, None)
        if action is not None:
            action()


@pytest.fixture(scope="module")
def inputs(tokenizer):
    return prompt_batch(tokenizer, PROMPTS)


@pytest.fixture
def gen(tiny_model_dir, registry):
    return SwapAtStep(None, make_context(tiny_model_dir, registry))


def perturbed(model, seed: int):
    """A copy of ``model`` with every parameter moved (tied ones once), and its weights to send."""
    other = copy.deepcopy(model)
    noise = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in other.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=noise))
    return other, list(other.state_dict().items())


def response_mask(out: GenerationOutput) -> torch.Tensor:
    return torch.arange(out.response_ids.shape[1])[None] < out.response_lengths[:, None]


def teacher_forced(model, inputs, out, sampling=SAMPLING) -> torch.Tensor:
    """``[B, R]`` logprobs of the sampled tokens under ``model``, one forward pass over prompt + response."""
    ids = torch.cat([inputs.input_ids, out.response_ids], 1)
    mask = torch.cat([inputs.attention_mask, response_mask(out).long()], 1)
    with torch.no_grad():
        logprobs = sequence_logprobs(model, ids, mask, temperature=sampling.temperature, top_k=sampling.top_k,
                                     top_p=sampling.top_p)
    return logprobs[:, inputs.input_ids.shape[1]:]


def keep_cache_reference(old, new, inputs, out, k: int, cache_arg: str, sampling=SAMPLING) -> torch.Tensor:
    """``[B, R]`` logprobs of the sampled tokens when the logits of token j come from ``old`` for j < k
    and from ``new`` for j >= k, on one KV cache that ``old`` started (the Magistral-style keep)."""
    width = inputs.input_ids.shape[1]
    tokens = out.response_ids
    positions = position_ids_for(inputs.attention_mask)
    full_mask = torch.cat([inputs.attention_mask, torch.ones_like(tokens)], 1)
    result = torch.zeros(tokens.shape)
    with torch.no_grad():
        step = old(input_ids=inputs.input_ids, attention_mask=inputs.attention_mask, position_ids=positions,
                   use_cache=True)
        for j in range(tokens.shape[1]):
            logits = process_logits(step.logits[:, -1].float(), sampling.temperature, sampling.top_k, sampling.top_p)
            result[:, j] = torch.log_softmax(logits, -1).gather(-1, tokens[:, j:j + 1]).squeeze(-1)
            model = old if j + 1 < k else new
            step = model(input_ids=tokens[:, j:j + 1], attention_mask=full_mask[:, :width + j + 1],
                         position_ids=positions[:, -1:] + 1 + j, use_cache=True,
                         **{cache_arg: getattr(step, cache_arg)})
    return result


def swap(gen, weights, version, *, recompute: bool):
    """The async collector's refit with in-flight updates: pause (keeping requests), update, resume."""
    def action():
        gen.pause_generation(keep_in_flight=True)
        gen.update_weights(weights, version=version)
        gen.resume_generation(recompute_kv_cache=recompute)
    return action


# --- a swap at decode step k ----------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("recompute", [True, False], ids=["recompute", "keep"])
def test_a_swap_at_step_k_versions_the_tokens_and_keeps_their_sampling_logprobs(gen, inputs, k, recompute):
    old = copy.deepcopy(gen.model)
    new, weights = perturbed(gen.model, seed=1)
    gen.at_step[k] = swap(gen, weights, 1, recompute=recompute)
    out = gen.generate(inputs, SAMPLING)
    assert not gen.at_step, "the swap did not happen (every row stopped before step k)"
    valid = response_mask(out)
    assert out.weight_version == 0  # the oldest token's
    versions = out.token_weight_versions
    assert versions is not None and versions.shape == out.response_ids.shape and versions.dtype == torch.long
    columns = torch.arange(versions.shape[1])[None].expand_as(versions)
    assert torch.equal(versions[valid], (columns[valid] >= k).long())
    assert torch.all(versions[~valid] == 0)

    before = valid & (columns < k)
    after = valid & (columns >= k)
    assert int(after.sum()) > 0
    torch.testing.assert_close(out.logprobs[before], teacher_forced(old, inputs, out)[before], atol=1e-5, rtol=0)
    under_new = teacher_forced(new, inputs, out)
    kept = keep_cache_reference(old, new, inputs, out, k, gen.cache_arg)
    if recompute:  # AReaL: the cache is rebuilt under the new weights
        torch.testing.assert_close(out.logprobs[after], under_new[after], atol=1e-5, rtol=0)
        assert (out.logprobs[after] - kept[after]).abs().max() > 1e-3
    else:  # Magistral: the new weights read the old weights' cache
        torch.testing.assert_close(out.logprobs[after], kept[after], atol=1e-5, rtol=0)
        assert (out.logprobs[after] - under_new[after]).abs().max() > 1e-3


def test_without_a_swap_every_token_has_the_call_s_version(gen, inputs):
    gen.update_weights(perturbed(gen.model, seed=2)[1], version=3)
    out = gen.generate(inputs, SAMPLING)
    assert out.token_weight_versions is None and out.weight_version == 3


def test_rows_that_stopped_before_the_swap_have_only_old_tokens(gen, tokenizer, inputs):
    digits = tuple(tokenizer.convert_tokens_to_ids(list("0123456789")))
    sampling = SamplingParams(max_new_tokens=10, stop_token_ids=digits)  # 11 of 25 tokens stop: early stops
    many = prompt_batch(tokenizer, PROMPTS * 8)
    k = 2
    gen.at_step[k] = swap(gen, perturbed(gen.model, seed=3)[1], 5, recompute=True)
    out = gen.generate(many, sampling)
    assert not gen.at_step
    short = out.response_lengths <= k
    assert short.any() and (~short).any(), "the seed gives rows on both sides of step 2"
    assert torch.all(out.token_weight_versions[short] == 0)
    assert torch.all(out.token_weight_versions[~short].amax(1) == 5)


# --- concurrency ----------------------------------------------------------------------------------


def checksum(model) -> float:
    return float(sum(p.detach().double().sum() for p in model.parameters()))


def test_concurrent_updates_never_tear_a_forward_pass(gen, inputs):
    """Another thread swaps weights as fast as it can while generate decodes: every forward pass sees
    exactly one version's weights (its checksum before and after the pass is one of the versions')."""
    versions = {}
    for version in range(1, 9):
        other, weights = perturbed(gen.model, seed=10 + version)
        versions[version] = (weights, checksum(other))
    expected = {0: checksum(gen.model), **{v: c for v, (_, c) in versions.items()}}
    seen, started, done = [], threading.Event(), threading.Event()
    gen.model.register_forward_pre_hook(lambda module, args: seen.append(["pre", checksum(module)]))
    gen.model.register_forward_hook(lambda module, args, output: seen[-1].append(checksum(module)))
    gen.at_step[1] = started.set

    def updater():
        started.wait(30)
        for version in versions:  # increasing, each once: a version seen again would be ambiguous
            if done.is_set():
                return
            gen.update_weights(versions[version][0], version=version)

    thread = threading.Thread(target=updater)
    thread.start()
    try:
        out = gen.generate(inputs, SamplingParams(max_new_tokens=48))
    finally:
        done.set()
        thread.join(30)
    assert len(set(out.token_weight_versions.flatten().tolist())) >= 2, "no update landed during the call"
    for _, before, after in seen:
        assert before == after, "the weights changed during a forward pass"
        assert any(abs(before - c) < 1e-6 * max(1.0, abs(c)) for c in expected.values()), "a mix of versions"
    # Each sampled token carries the version of the weights of the pass that gave its logits.
    # Pass j gave the logits of token j: the longest row's tokens carry the versions of the passes.
    per_pass = [min(expected, key=lambda v: abs(expected[v] - before)) for _, before, _ in seen]
    longest = int(out.response_lengths.argmax())
    assert out.token_weight_versions[longest].tolist() == per_pass
    assert per_pass == sorted(per_pass) and len(set(per_pass)) >= 2


# --- PausesForRefit -------------------------------------------------------------------------------


def run_in_thread(fn):
    result: dict = {}

    def target():
        try:
            result["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            result["error"] = exc
        result["at"] = time.monotonic()

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, result


def count_forwards(gen) -> list[int]:
    count = [0]
    gen.model.register_forward_pre_hook(lambda module, args: count.__setitem__(0, count[0] + 1))
    return count


@pytest.mark.parametrize("keep_in_flight", [True, False])
def test_a_generate_call_while_paused_waits_for_resume(gen, inputs, keep_in_flight):
    forwards = count_forwards(gen)
    gen.pause_generation(keep_in_flight=keep_in_flight)
    thread, result = run_in_thread(lambda: gen.generate(inputs, SAMPLING))
    thread.join(0.3)
    assert thread.is_alive() and forwards[0] == 0
    gen.resume_generation(recompute_kv_cache=False)
    thread.join(30)
    assert "error" not in result and result["value"].response_ids.shape[0] == len(PROMPTS)


def test_a_pause_without_resume_is_a_clear_error_within_the_deadline(tiny_model_dir, registry, inputs):
    gen = SwapAtStep(None, make_context(tiny_model_dir, registry, "cluster.call_timeout_s=0.5"))
    gen.pause_generation(keep_in_flight=True)
    began = time.monotonic()
    with pytest.raises(GrpoSdkError, match=r"a generate call waited for resume_generation for 0\.5 s "
                                           r"\(cluster\.call_timeout_s\); every pause_generation must be followed"):
        gen.generate(inputs, SAMPLING)
    assert time.monotonic() - began < 5


def test_pause_without_keeping_in_flight_waits_for_the_running_call(gen, inputs):
    forwards = count_forwards(gen)
    reached, go = threading.Event(), threading.Event()
    gen.at_step[3] = lambda: (reached.set(), go.wait(30))
    generating, generated = run_in_thread(lambda: gen.generate(inputs, SAMPLING))
    assert reached.wait(30)
    pausing, paused = run_in_thread(lambda: (gen.pause_generation(keep_in_flight=False), forwards[0])[1])
    pausing.join(0.3)
    assert pausing.is_alive(), "pause returned while a generate call was running"
    go.set()
    generating.join(30)
    pausing.join(30)
    assert "error" not in generated and "error" not in paused
    # When the pause returned, the call had made every forward pass it makes (one per token).
    assert paused["value"] == forwards[0] == int(generated["value"].response_lengths.max())
    later, result = run_in_thread(lambda: gen.generate(inputs, SAMPLING))  # refused until resume
    later.join(0.3)
    assert later.is_alive()
    gen.resume_generation(recompute_kv_cache=False)
    later.join(30)
    assert "value" in result


def test_pause_keeping_in_flight_returns_at_once_and_the_call_finishes(gen, inputs):
    gen.at_step[2] = lambda: gen.pause_generation(keep_in_flight=True)  # returns: would hang here otherwise
    out = gen.generate(inputs, SAMPLING)  # no update landed: nothing waits for the resume
    assert out.token_weight_versions is None and int(out.response_lengths.max()) > 2
    gen.resume_generation(recompute_kv_cache=False)


def test_an_update_during_a_keep_pause_holds_the_request_until_resume(gen, inputs):
    forwards = count_forwards(gen)
    landed, at_swap = threading.Event(), []
    weights = perturbed(gen.model, seed=4)[1]

    def action():
        gen.pause_generation(keep_in_flight=True)
        gen.update_weights(weights, version=1)
        at_swap.append(forwards[0])
        landed.set()

    gen.at_step[3] = action
    thread, result = run_in_thread(lambda: gen.generate(inputs, SAMPLING))
    assert landed.wait(30)
    thread.join(0.3)
    assert thread.is_alive() and forwards[0] == at_swap[0], "the request decoded before the resume said how"
    gen.resume_generation(recompute_kv_cache=False)
    thread.join(30)
    versions, lengths = result["value"].token_weight_versions, result["value"].response_lengths
    longer = lengths > 3  # the rows that sampled a token after the swap
    assert longer.any() and versions[:, :3].eq(0).all() and versions[longer, 3].eq(1).all()


def test_a_request_waiting_for_resume_gets_a_clear_error_within_the_deadline(tiny_model_dir, registry, inputs):
    gen = SwapAtStep(None, make_context(tiny_model_dir, registry, "cluster.call_timeout_s=0.5"))
    weights = perturbed(gen.model, seed=5)[1]
    gen.at_step[2] = lambda: (gen.pause_generation(keep_in_flight=True), gen.update_weights(weights, version=1))
    with pytest.raises(GrpoSdkError, match=r"a request in flight across a weight update waited for "
                                           r"resume_generation for 0\.5 s"):
        gen.generate(inputs, SAMPLING)


# --- protocols, the Ray proxy and merge, the contract kit ------------------------------------------


def test_the_hf_backend_pauses_for_refit_and_takes_requests_asynchronously(gen):
    assert isinstance(gen, PausesForRefit) and isinstance(gen, AsyncGeneration)  # continuous batching (issue 35)
    assert issubclass(HFGeneration, PausesForRefit)

    class Blocking:
        def generate(self, prompts, sampling): ...

    class Streaming(Blocking):
        def submit(self, request_id, prompts, sampling): ...

        def poll(self, timeout_s): return []

        def cancel(self, request_ids): ...

    assert not isinstance(Blocking(), PausesForRefit) and not isinstance(Blocking(), AsyncGeneration)
    assert isinstance(Streaming(), AsyncGeneration)


def test_the_generation_proxy_pauses_for_refit_only_when_every_replica_does():
    from grpo_sdk.runtime.groups import GenerationGroup
    from grpo_sdk.runtime.workers import optional_methods

    class NoRuntime:
        failure = None
        call_timeout = 5.0

    class Pausing:
        def pause_generation(self, *, keep_in_flight): ...

        def resume_generation(self, *, recompute_kv_cache): ...

    group = GenerationGroup(NoRuntime(), [], tokenizer_path="unused")
    assert not isinstance(group, PausesForRefit)
    assert optional_methods(Pausing()) == ["pause_generation", "resume_generation"]
    group.methods = optional_methods(Pausing())  # what every worker reported
    assert isinstance(group, PausesForRefit)
    group.methods = ["pause_generation"]  # not every replica has both
    assert not isinstance(group, PausesForRefit)


def output(rows: int, width: int, version: int, token_versions=None) -> GenerationOutput:
    return GenerationOutput(response_ids=torch.full((rows, width), 7), response_lengths=torch.full((rows,), width),
                            logprobs=torch.zeros(rows, width), truncated=torch.zeros(rows, dtype=torch.bool),
                            weight_version=version, token_weight_versions=token_versions)


def test_merging_replicas_concatenates_token_versions():
    from grpo_sdk.runtime.groups import merge_generation_outputs

    plain = merge_generation_outputs([output(2, 3, 4), output(1, 2, 5)], pad_token_id=0)
    assert plain.token_weight_versions is None and plain.weight_version == 4
    swapped = torch.tensor([[4, 5], [4, 4]])
    merged = merge_generation_outputs([output(1, 3, 3), output(2, 2, 4, swapped)], pad_token_id=0)
    assert merged.weight_version == 3
    assert merged.token_weight_versions.tolist() == [[3, 3, 3], [4, 5, 4], [4, 4, 4]]


class BlockingGeneration:
    """A generation backend without ``PausesForRefit``, for the contract kit (``impl`` names it)."""

    def __init__(self, config, context): ...

    def generate(self, prompts, sampling): ...

    def update_weights(self, weights, *, version): ...

    def prepare_for_generation(self): ...

    def finish_generation(self): ...

    def shutdown(self): ...


class MisnamedPause(BlockingGeneration):
    def pause_generation(self): ...

    def resume_generation(self, *, recompute_kv_cache): ...


@pytest.mark.parametrize("impl, message", [
    ("BlockingGeneration", (r"has no method pause_generation\(\*, keep_in_flight\) \(the in_flight_weight_updates "
                            r"capability: the PausesForRefit protocol\)")),
    ("MisnamedPause", (r"MisnamedPause\.pause_generation\(\) does not fit pause_generation\(\*, keep_in_flight\) "
                       r"of the in_flight_weight_updates capability: the PausesForRefit protocol: it does not accept "
                       r"the keyword argument keep_in_flight=")),
])
def test_the_contract_kit_requires_pauses_for_refit_of_a_declaring_backend(registry, impl, message):
    import attrs

    from grpo_sdk.plugins.registry import Registry
    from grpo_sdk.testing import ContractError, check_protocol

    assert check_protocol("generation", "hf", registry=registry) is HFGeneration
    hf = registry.info("generation", "hf")
    spec = attrs.evolve(hf.spec, name="blocking", impl=f"{__name__}:{impl}", config=None)
    extended = Registry(registry.list() + [attrs.evolve(hf, name="blocking", spec=spec)], registry.host)
    with pytest.raises(ContractError, match=message):
        check_protocol("generation", "blocking", registry=extended)
    plain = attrs.evolve(spec, capabilities=spec.capabilities - {"in_flight_weight_updates"})
    without = Registry(registry.list() + [attrs.evolve(hf, name="blocking", spec=plain)], registry.host)
    assert check_protocol("generation", "blocking", registry=without).__name__ == impl
