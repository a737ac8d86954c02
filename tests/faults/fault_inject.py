"""Fault injection for the fault campaign: a hook-plugin module loaded into a real `grpoctl run`
with ``-p fault_inject`` (tests/faults is put on PYTHONPATH).

``GRPO_FAULT=<point>[@<n>]`` acts the n-th time (default 1) the run reaches ``<point>``; the action
is SIGKILL, or ``GRPO_FAULT_ACTION=<SIGNAL>`` sends that signal to the process instead (a
scheduler's SIGTERM arriving exactly there), or ``GRPO_FAULT_ACTION=ENOSPC`` raises "No space
left on device" there (a disk filling up at that moment). The points are the windows where a crash
could lose or corrupt data:

=====================  ================================================================
checkpoint.contents     a checkpoint's policy/generation/RNG files are written, its state and
                        manifest are not (the directory is still ``.step_N.partial``)
checkpoint.renamed      ``step_N`` exists, ``latest_checkpoint_status.json`` is not yet rewritten
status.tmp              the status file's temporary copy is written, not yet renamed
prune.renamed           a pruned checkpoint is renamed to ``.step_N.removing``, not yet deleted
prune.halfway           half of a pruned checkpoint's files are deleted
initial_model           the built-in model's weights are written, its tokenizer is not
config.tmp              ``config.resolved.yaml``'s temporary copy is written, not yet renamed
metrics.line            half of a ``metrics.jsonl`` line is written and flushed
validation              a validation pass has started
step                    a training step has started
=====================  ================================================================

This is a test fixture, not part of grpo-sdk: it patches private functions by name.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal

from grpo_sdk.trainer import checkpoint as checkpoint_module
from grpo_sdk.trainer import trainer as trainer_module
from grpo_sdk.loggers import jsonl as jsonl_module
from grpo_sdk.recipes import tiny_model

POINT, _, NTH = os.environ.get("GRPO_FAULT", "").partition("@")
NTH = int(NTH or 1)
ACTION = os.environ.get("GRPO_FAULT_ACTION", "SIGKILL")
_seen = {"count": 0}


def reached(point: str) -> None:
    if point != POINT:
        return
    _seen["count"] += 1
    if _seen["count"] != NTH:
        return
    if ACTION == "ENOSPC":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), f"<fault injected at {point}>")
    os.kill(os.getpid(), getattr(signal, ACTION))


def _wrap(owner, name, before=None, after=None):
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        if before:
            before(*args, **kwargs)
        out = original(*args, **kwargs)
        if after:
            after(*args, **kwargs)
        return out

    setattr(owner, name, wrapper)


_wrap(trainer_module.GRPOTrainer, "_write_checkpoint", after=lambda *a, **k: reached("checkpoint.contents"))
_wrap(trainer_module.GRPOTrainer, "validate", before=lambda *a, **k: reached("validation"))
_wrap(trainer_module.GRPOTrainer, "train_step", before=lambda *a, **k: reached("step"))


def _status(path, data):  # the first write_json_atomic of a save is the status file, after the rename
    reached("checkpoint.renamed")
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("{}")
    reached("status.tmp")
    _original_status(path, data)


_original_status = checkpoint_module.write_json_atomic
checkpoint_module.write_json_atomic = _status


def _remove(self, path):
    doomed = self.directory / f".{path.name}.removing"
    os.replace(path, doomed)
    reached("prune.renamed")
    files = sorted(p for p in doomed.rglob("*") if p.is_file())
    for p in files[: len(files) // 2]:
        p.unlink()
    reached("prune.halfway")
    shutil.rmtree(doomed, ignore_errors=True)


checkpoint_module.CheckpointManager._remove = _remove

_build = tiny_model.BUILDERS["tiny-gpt2"]


def _build_then_fault(out_dir, seed, **kwargs):
    out = _build(out_dir, seed, **kwargs)
    (out / "tokenizer.json").unlink()  # as if the kill came before the tokenizer was saved
    reached("initial_model")
    tiny_model.build_char_tokenizer().save_pretrained(out)
    return out


tiny_model.BUILDERS["tiny-gpt2"] = _build_then_fault

_write_text = trainer_module.write_text_atomic


def _config_write(path, text):
    if path.name == "config.resolved.yaml":
        path.with_name(f".{path.name}.tmp").write_text(text[: len(text) // 2])
        reached("config.tmp")
    _write_text(path, text)


trainer_module.write_text_atomic = _config_write

_log = jsonl_module.JSONLLogger.log_metrics


def _log_metrics(self, step, metrics):
    if POINT == "metrics.line" and _seen["count"] + 1 == NTH:
        self.file.write('{"step": %d, "reward/me' % step)
        self.file.flush()
    reached("metrics.line")
    _log(self, step, metrics)


jsonl_module.JSONLLogger.log_metrics = _log_metrics
