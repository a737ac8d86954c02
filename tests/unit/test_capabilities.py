"""Capabilities are an enum that ``ComponentSpec`` validates (docs/plugins.md, "Capabilities"): a
typo or a capability of another kind fails at spec construction with the valid ones listed; the
names earlier releases declared and nothing read warn and are dropped; each one is documented."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from grpo_sdk.plugins import Capability, ComponentSpec

DOCS = Path(__file__).resolve().parents[2] / "docs"


def spec(kind: str, capabilities) -> ComponentSpec:
    return ComponentSpec(name="acme", kind=kind, impl="acme.impl:Impl", capabilities=capabilities)


def test_strings_are_converted_to_members():
    declared = spec("environment", {"generates_prompts"}).capabilities
    assert declared == {Capability.GENERATES_PROMPTS} and all(isinstance(c, Capability) for c in declared)
    assert "generates_prompts" in declared  # readers may still compare with the string
    assert spec("estimator", [Capability.GROUP_BASELINE, "kl_in_reward"]).capabilities == {
        Capability.GROUP_BASELINE, Capability.KL_IN_REWARD}


def test_a_typo_fails_at_construction_listing_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown capability 'generates_prompt'; the valid ones: cuda_ipc, "
                                         r"dynamic_batching, generates_prompts, group_baseline"):
        spec("environment", {"generates_prompt"})
    with pytest.raises(ValueError, match="not the string"):
        spec("environment", "generates_prompts")  # a bare string would be read as its letters


def test_a_capability_of_another_kind_fails():
    with pytest.raises(ValueError, match=r"'cuda_ipc' is for generation components, not environment ones "
                                         r"\(valid for environment: generates_prompts, multi_turn, runs_agents, tool_calls\)"):
        spec("environment", {"cuda_ipc"})
    # The generation kind's list, pinned: in_flight_weight_updates (async GRPO), receives_broadcast (engines) and
    # lora_adapters (adapter-only LoRA sync) joined cuda_ipc.
    with pytest.raises(ValueError, match=r"\(valid for generation: cuda_ipc, in_flight_weight_updates, lora_adapters, "
                       r"receives_broadcast\)"):
        spec("generation", {"kl_in_reward"})
    # The policy kind's: what the config checks require of a policy for its batching keys (issue 20).
    with pytest.raises(ValueError, match=r"\(valid for policy: dynamic_batching, logprob_chunks, sequence_packing\)"):
        spec("policy", {"cuda_ipc"})


@pytest.mark.parametrize("removed", ["colocated", "inprocess", "disk", "sleep", "collective", "reward_components"])
def test_removed_capabilities_warn_and_are_dropped(removed):
    with pytest.warns(DeprecationWarning, match=f"capability '{removed}' is deprecated and ignored"):
        declared = spec("generation", {removed, "cuda_ipc"}).capabilities
    assert declared == {Capability.CUDA_IPC}


def test_the_json_row_lists_plain_names(registry):
    row = registry.info("environment", "reverse_digits").to_json()
    assert row["capabilities"] == ["generates_prompts"] and type(row["capabilities"][0]) is str


def test_every_built_in_declares_only_members(registry):
    for kind, name in [("generation", "hf"), ("weight_sync", "collective"), ("estimator", "opd")]:
        info = registry.info(kind, name)
        assert info is not None and info.spec is not None
        assert all(isinstance(c, Capability) for c in info.spec.capabilities)


def test_every_capability_is_documented_with_its_kind():
    from grpo_sdk.core.capabilities import CAPABILITY_KINDS

    text = (DOCS / "plugins.md").read_text()
    rows = dict(re.findall(r"^\| `(\w+)` \| (\w+) \|", text, re.MULTILINE))
    assert rows == {c.value: kind for c, kind in CAPABILITY_KINDS.items()}
