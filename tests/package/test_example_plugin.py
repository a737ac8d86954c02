"""The example third-party backend in examples/grpo-hf-generate works as docs/plugins.md says:
installed as a distribution, it is listed with its origin and trains when selected by config.

It is "installed" as a dist-info folder on the path (see helpers.FakeSite); a real pip install
into a fresh virtual environment is the plugin-experience issue's test.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "grpo-hf-generate"


@pytest.fixture(scope="module")
def site(make_site):
    site = make_site()
    package = EXAMPLE / "src" / "grpo_hf_generate"
    site.add("grpo-hf-generate", version="0.1.0",
             entry_points={"grpo_sdk.generation": {"hf_generate": "grpo_hf_generate.spec:SPEC"}},
             files={f"grpo_hf_generate/{f.name}": f.read_text() for f in package.glob("*.py")})
    return site


def test_the_example_plugin_is_listed_with_its_distribution(site):
    result = site.grpoctl("plugins", "list", "--json", "--kind", "generation")
    assert result.returncode == 0, result.stderr
    rows = {r["name"]: r for r in json.loads(result.stdout)["components"]}
    assert rows["hf_generate"]["status"] == "ok"
    assert (rows["hf_generate"]["dist"], rows["hf_generate"]["version"]) == ("grpo-hf-generate", "0.1.0")


def test_the_example_plugin_trains_and_agrees_with_the_policy_on_logprobs(site):
    result = site.grpoctl("run", "--run-dir", "run", "policy.generation.backend=hf_generate",
                          "grpo.max_num_steps=3", "grpo.num_prompts_per_step=4", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (site.root / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    # the plugin's sampling logprobs match what the hf policy computes for the same tokens
    assert all(abs(r["token_mult_prob_error"] - 1.0) < 1e-3 for r in rows), [r["token_mult_prob_error"] for r in rows]
    assert [r["generation/weight_version"] for r in rows] == [0.0, 1.0, 2.0]


def test_an_invalid_plugin_option_is_a_config_error(site):
    result = site.grpoctl("config", "validate", "policy.generation.backend=hf_generate",
                          "policy.generation.hf_generate.num_beams=4")
    assert result.returncode == 2
    assert "policy.generation.hf_generate.num_beams" in result.stderr
