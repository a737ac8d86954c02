"""Helpers for plugin authors that do not import torch: what the built-in components use.

Public, like ``grpo_sdk.plugins`` itself (docs/compatibility.md): the names in ``__all__``. The
built-in backends, estimators, environments, transports and loggers import nothing of grpo-sdk
but ``grpo_sdk.plugins`` and its submodules, so everything they need is here or in
``grpo_sdk.plugins.tensors`` (the helpers that import torch). Importing this module imports
neither torch nor transformers nor ray; the functions that need them import them when called.

* Config blocks: ``positive`` / ``non_negative`` validators for ``option(...)``, the size
  bounds ``MAX_TOKENS`` / ``MAX_THREADS``, ``RemovedOption`` (a key an earlier release had),
  ``LossConfig`` (the ``loss_fn`` section, ``context.config.loss_fn``), ``MasterConfig`` (the
  type of ``RunContext.config``) and ``dump_config`` (a config as plain YAML-ready data).
* Models: ``check_model_source`` (a missing local path is an error naming the key, before
  transformers guesses a hub id; a ``.gguf`` file must start like one), ``load_pretrained`` (a
  ``from_pretrained`` call that fails within seconds, with a hint, when a hub id meets an
  unreachable hub and an empty cache; a ``.gguf`` file or ``builtin:smollm2-135m-instruct`` loads
  from its cached model directory, converted on first use: docs/models.md),
  ``model_facts`` (a local model's config.json, read without torch, for config checks) and
  ``load_tokenizer`` (a Hugging Face tokenizer, pad token defaulting to EOS; imports transformers
  when called). A component that only needs the EOS and
  pad ids reads ``RunContext.eos_token_id`` / ``pad_token_id`` instead.
* Metrics: ``sum_micro_batches`` / ``average_optimizer_steps``, how a policy backend combines
  the loss's per-micro-batch metrics (sums; ``_min``/``_max`` keys take the extreme).
* Files: ``write_text_atomic`` (old content or all of the new, never a part) and ``fsync_dir``.
* Inference engines: ``HTTPClient`` (JSON to a server, every call under a deadline, errors that
  name the URL and the setting that holds it) and ``require_engine`` (for a config check: the
  engine is installed and a GPU is visible, else a ``PluginError``, exit code 3, with the install
  line); ``join_process_group`` / ``leave_process_group`` / ``host_store``: a weight-update
  process group built as the engines build theirs (SGLang's ``init_custom_process_group``), for
  a trainer's rank 0 or an engine-side receiver.
* Estimators: ``advantage_input``, the decorator for ``compute_advantages(self, batch:
  AdvantageInput)`` that also accepts plugin API 1's call ``(rewards, group_ids, mask, **extras)``
  (with a DeprecationWarning), as every built-in estimator does.
* Async code: ``background_event_loop`` (an asyncio loop running on its own daemon thread, for
  components whose caller may already run a loop, as in Jupyter).
* User code: ``import_module_here_too`` (a module the user names, e.g. ``my_rewards``, found
  among installed packages first, then in the current directory, for that import only).
* Colocation: ``publish_policy(context, policy)`` / ``published_policy(context)`` /
  ``forget_policy(context)``: a generation backend that can sample with its policy's own model (both
  in one process, ``cluster.runtime=local``) finds the policy the runtime built first with the same
  ``RunContext``, instead of loading a second copy (weakly held; the first policy published wins).
* The machine: ``pick_device`` (``cluster.device`` -> ``"cpu"``/``"cuda"``), ``node_ip`` (this
  node's address), ``free_port``, and, for weight-sync transports running code in Ray workers
  (``grpo_sdk.plugins.WorkerGroup``), ``tcp_store`` (a ``TCPStore`` served on the node's
  address only, on the socket ``Worker.store_address`` opened) and ``store_address_op`` (that
  call as a worker operation: ``group.submit(store_address_op, ranks=[0])``).

Example (a policy backend combining its loss metrics)::

    from grpo_sdk.plugins.toolkit import average_optimizer_steps, sum_micro_batches

    steps = [sum_micro_batches([mb1, mb2]), sum_micro_batches([mb3, mb4])]
    metrics = average_optimizer_steps(steps)
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from grpo_sdk.config.schema import MAX_THREADS, MAX_TOKENS, LossConfig, MasterConfig, RemovedOption, non_negative, positive
from grpo_sdk.config.checks.model import model_facts
from grpo_sdk.core.colocation import forget_policy, publish_policy, published_policy
from grpo_sdk.core.engines import HTTPClient, require_engine
from grpo_sdk.core.process_groups import host_store, join_process_group, leave_process_group
from grpo_sdk.core.files import fsync_dir, write_text_atomic
from grpo_sdk.core.imports import import_module_here_too
from grpo_sdk.core.machine import free_port, node_ip, pick_device, tcp_store
from grpo_sdk.core.metrics import average_optimizer_steps, sum_micro_batches
from grpo_sdk.core.models import check_model_source, load_pretrained, load_tokenizer
from grpo_sdk.plugins.advantage_calls import advantage_input


def dump_config(config: Any) -> Any:
    """A config (the run's ``MasterConfig`` or one block) as YAML-ready dicts and lists; selected
    plugin blocks are written out in full, as ``config.resolved.yaml`` holds them."""
    from grpo_sdk.config.loading import dump_config as dump

    return dump(config)


def background_event_loop(name: str) -> asyncio.AbstractEventLoop:
    """A new event loop running forever on a daemon thread called ``name``; submit work with
    ``asyncio.run_coroutine_threadsafe(coro, loop)`` and end it with
    ``loop.call_soon_threadsafe(loop.stop)`` (the loop closes itself once stopped)."""
    loop = asyncio.new_event_loop()
    threading.Thread(target=_serve, args=(loop,), name=name, daemon=True).start()
    return loop


def _serve(loop: asyncio.AbstractEventLoop) -> None:
    asyncio.set_event_loop(loop)
    try:
        loop.run_forever()
    finally:
        loop.close()


def store_address_op(worker: Any) -> tuple[str, int]:
    """``worker.store_address()`` as an operation for ``WorkerGroup.submit``/``run`` (a module
    function, so Ray pickles it by reference): the address of a TCPStore that worker will serve."""
    return worker.store_address()


__all__ = [
    "HTTPClient",
    "LossConfig",
    "MAX_THREADS",
    "MAX_TOKENS",
    "MasterConfig",
    "RemovedOption",
    "advantage_input",
    "average_optimizer_steps",
    "background_event_loop",
    "check_model_source",
    "dump_config",
    "forget_policy",
    "free_port",
    "host_store",
    "fsync_dir",
    "import_module_here_too",
    "join_process_group",
    "leave_process_group",
    "load_pretrained",
    "load_tokenizer",
    "model_facts",
    "node_ip",
    "non_negative",
    "pick_device",
    "positive",
    "publish_policy",
    "published_policy",
    "require_engine",
    "store_address_op",
    "sum_micro_batches",
    "tcp_store",
    "write_text_atomic",
]
