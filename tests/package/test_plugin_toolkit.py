"""The documented submodules of the public plugin API: ``grpo_sdk.plugins.toolkit`` (no torch),
``grpo_sdk.plugins.tensors`` and ``grpo_sdk.plugins.training`` (torch) and ``grpo_sdk.plugins.tools``
(tool environments, no torch),
pinned like ``grpo_sdk.plugins`` itself, and the worker-group protocols the Ray runtime implements
for weight-sync transports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import grpo_sdk.plugins as api
from grpo_sdk.plugins import tensors, toolkit, tools, training

TOOLKIT_NAMES = [
    "HTTPClient", "LossConfig", "MAX_THREADS", "MAX_TOKENS", "MasterConfig", "RemovedOption", "advantage_input",
    "average_optimizer_steps", "background_event_loop", "check_model_source", "dump_config", "forget_policy",
    "free_port", "fsync_dir", "host_store", "import_module_here_too", "join_process_group", "leave_process_group",
    "load_pretrained", "load_tokenizer", "model_facts", "node_ip", "non_negative", "pick_device", "positive",
    "publish_policy", "published_policy", "require_engine", "store_address_op", "sum_micro_batches", "tcp_store",
    "write_text_atomic",
]
TENSORS_NAMES = [
    "DTYPES", "GroupLayout", "calculate_kl", "draw_row_seeds", "left_pad", "masked_mean", "position_ids_for", "process_logits",
    "read_weights", "row_uniforms", "sample_rows", "sample_token", "shifted_moments", "signed_seed", "token_logprobs",
    "whiten", "write_weights",
]
TRAINING_NAMES = [
    "TrainsGlobalBatches", "all_gather_rows", "all_reduce_metrics", "any_rank", "broadcast_json", "clip_gradients",
    "describe_rows", "lr_lambda", "make_optimizer", "max_over_ranks", "row_share", "select_rows",
    "train_global_batches",
]
TOOLS_NAMES = [
    "HermesParser", "INVALID_TOOL_CALL", "PARSERS", "ParsedTurn", "Tool", "ToolCall", "ToolCallParser", "ToolEnvironment",
    "argument_problem", "tool_call_parser",
]
DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_the_submodules_names_are_pinned_and_resolve():
    assert sorted(toolkit.__all__) == TOOLKIT_NAMES, "grpo_sdk.plugins.toolkit is public: change it deliberately"
    assert sorted(tensors.__all__) == TENSORS_NAMES, "grpo_sdk.plugins.tensors is public: change it deliberately"
    assert sorted(tools.__all__) == TOOLS_NAMES, "grpo_sdk.plugins.tools is public: change it deliberately"
    assert sorted(training.__all__) == TRAINING_NAMES, "grpo_sdk.plugins.training is public: change it deliberately"
    for module in (toolkit, tensors, tools, training):
        for name in module.__all__:
            assert getattr(module, name, None) is not None, f"{module.__name__}.{name} does not resolve"


def test_the_submodules_are_documented():
    for page in ("plugins.md", "compatibility.md"):
        text = (DOCS / page).read_text()
        assert all(f"grpo_sdk.plugins.{m}" in text for m in ("toolkit", "tensors", "training", "tools")), page


def test_the_toolkit_imports_no_heavy_module():
    heavy = ("torch", "transformers", "ray")
    code = ("import sys, json\nfrom grpo_sdk.plugins.toolkit import *\nfrom grpo_sdk.plugins.tools import *\n"
            f"print(json.dumps(sorted(m for m in {heavy!r} if m in sys.modules)))\n")
    result = subprocess.run([sys.executable, "-c", code], env={**os.environ, "OMP_NUM_THREADS": "1"},
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1]) == []


def test_atomic_write_and_metric_sums(tmp_path):
    toolkit.write_text_atomic(tmp_path / "a.txt", "one")
    toolkit.write_text_atomic(tmp_path / "a.txt", "two")
    assert (tmp_path / "a.txt").read_text() == "two" and sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"]
    step = toolkit.sum_micro_batches([{"loss": 0.25, "ratio_max": 1.5}, {"loss": 0.5, "ratio_max": 1.2}])
    assert step == {"loss": 0.75, "ratio_max": 1.5}
    assert toolkit.average_optimizer_steps([step, {"loss": 0.25, "ratio_max": 2.0}]) == {"loss": 0.5, "ratio_max": 2.0}
    assert toolkit.pick_device("cpu") == "cpu"
    assert isinstance(toolkit.node_ip(), str)


def test_weights_files_round_trip(tmp_path):
    import torch

    embed = torch.arange(6.0).reshape(2, 3)
    pairs = [("embed", embed), ("lm_head", embed), ("bias", torch.ones(3, dtype=torch.bfloat16))]  # tied
    assert tensors.write_weights(pairs, tmp_path / "w.safetensors") == (3, 6 * 4 + 6 * 4 + 3 * 2)
    back = dict(tensors.read_weights(tmp_path / "w.safetensors"))
    assert sorted(back) == ["bias", "embed", "lm_head"]
    assert torch.equal(back["lm_head"], embed) and back["bias"].dtype == torch.bfloat16


def test_the_runtime_implements_the_worker_group_protocols():
    from grpo_sdk.runtime.groups import GenerationGroup, PolicyGroup
    from grpo_sdk.runtime.workers import ComponentWorker

    assert isinstance(ComponentWorker(), api.Worker)
    assert isinstance(PolicyGroup(None, []), api.WorkerGroup)
    assert isinstance(GenerationGroup(None, [], tokenizer_path="unused"), api.WorkerGroup)


def test_transports_refuse_in_process_components_naming_the_runtime():
    import pytest

    from grpo_sdk.weight_sync.driver import SyncDeadline, require_worker_groups

    with pytest.raises(TypeError, match=r"cluster.runtime=ray\); got object and object. In one process"):
        require_worker_groups("weight_sync.backend=collective broadcasts", object(), object(),
                              ". In one process use weight_sync.backend=inprocess")
    assert SyncDeadline.of("collective", None, 600.0) == SyncDeadline(600.0, "cluster.call_timeout_s", 660.0)
    assert SyncDeadline.of("cuda_ipc", 30.0, 600.0) == SyncDeadline(30.0, "weight_sync.cuda_ipc.timeout_s", 660.0)


class _LinearPolicy:
    """The least a policy needs for ``train_global_batches``: logprobs linear in one weight per token id."""

    def __init__(self, global_rows, micro_rows, max_grad_norm=None):
        from types import SimpleNamespace

        import torch

        self.model = torch.nn.Embedding(8, 1)
        torch.nn.init.constant_(self.model.weight, 0.5)
        self.params = list(self.model.parameters())
        self.optimizer = torch.optim.SGD(self.params, lr=0.1)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: 1.0)
        self.policy_cfg = SimpleNamespace(train_global_batch_size=global_rows, train_micro_batch_size=micro_rows,
                                          max_grad_norm=max_grad_norm)
        self.optimizer_steps, self.device, self.kl_needs_unfiltered = 0, torch.device("cpu"), False

    def logprobs(self, micro, *, with_unfiltered):
        return self.model(micro.input_ids).squeeze(-1) * micro.token_mask


def _batch(rows=4, seq=3):
    import torch

    from grpo_sdk.plugins import TrainBatch

    ids = torch.arange(rows * seq).reshape(rows, seq) % 8
    mask = torch.ones(rows, seq)
    mask[:, 0] = 0
    return TrainBatch(input_ids=ids, attention_mask=torch.ones_like(ids), token_mask=mask, sample_mask=torch.ones(rows),
                      generation_logprobs=torch.zeros(rows, seq), group_ids=torch.zeros(rows, dtype=torch.long),
                      rewards=torch.zeros(rows))


def _mean_loss(logprobs, batch, *, global_valid_seqs, global_valid_toks):
    loss = (logprobs * batch.token_mask).sum() / global_valid_toks
    return loss, {"loss": float(loss.detach())}


def test_train_global_batches_does_not_depend_on_the_micro_batch_size():
    """The loss is divided by the global batch's counts, so micro-batches of 1 or 4 rows step alike."""
    import torch

    from grpo_sdk.plugins.training import train_global_batches

    runs = {}
    for micro_rows in (1, 4):
        policy = _LinearPolicy(global_rows=2, micro_rows=micro_rows)
        metrics = train_global_batches(policy, _batch(), _mean_loss, logprobs=policy.logprobs)
        runs[micro_rows] = (policy.model.weight.detach().clone(), metrics, policy.optimizer_steps)
    assert runs[1][2] == runs[4][2] == 2  # two global batches of two rows: two optimizer steps
    torch.testing.assert_close(runs[1][0], runs[4][0])
    assert runs[1][1]["loss"] == pytest.approx(runs[4][1]["loss"]) and runs[1][1]["lr"] == 0.1


def test_train_global_batches_names_the_step_and_rows_of_a_non_finite_loss():
    import torch

    from grpo_sdk.plugins import NonFiniteError
    from grpo_sdk.plugins.training import train_global_batches

    def nan_at_row_3(logprobs, batch, **counts):  # row 3 is the only one starting with token 1
        loss, metrics = _mean_loss(logprobs, batch, **counts)
        return (loss * float("nan") if bool((batch.input_ids[:, 0] == 1).any()) else loss), metrics

    policy = _LinearPolicy(global_rows=2, micro_rows=1)
    with pytest.raises(NonFiniteError, match=r"in optimizer step 2, rows 3\.\.3"):
        train_global_batches(policy, _batch(), nan_at_row_3, logprobs=policy.logprobs)
    assert policy.optimizer_steps == 1  # the first global batch's step was taken
    assert torch.isfinite(policy.model.weight).all()
