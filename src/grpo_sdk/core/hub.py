"""The Hugging Face hub, reached within seconds or not at all.

huggingface_hub retries a failed download five times with backoff (1+2+4+8+8 s), and
transformers asks for two files, so a hub name on a machine without network took ~50 s of
"Retrying in 8s" before its error (measured: Qwen/Qwen2.5-0.5B, DNS failing at once; a dropped
connection costs the 10 s etag timeout on top of each try). Instead, before anything loads from
the hub, one request with a short timeout and no retry (``probe``) says whether the endpoint
answers; when it does not, loads run in offline mode (``offline_mode``), which serves what the
local cache holds and fails at once otherwise, and the error says what to do (``offline_hint``).

``HF_HUB_OFFLINE=1`` (or ``HF_DATASETS_OFFLINE=1``, ``TRANSFORMERS_OFFLINE=1``) skips the probe:
offline is then declared, not guessed. ``HF_ENDPOINT`` (a mirror), ``HF_TOKEN`` and the usual
``HTTPS_PROXY`` are honoured because the probe goes through huggingface_hub's own HTTP client.

Importing this module imports nothing heavy; huggingface_hub is imported when a function needs it.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import time
from typing import Iterator

PROBE_SECONDS = 5.0  # a TLS handshake through a slow proxy fits; a dead network is told within it
PROBE_REUSE_SECONDS = 60.0  # a run's tokenizer, model and dataset loads share one probe
OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")


# huggingface_hub's repo id rule (utils._validators.REPO_ID_REGEX): an optional namespace, a name.
_REPO_ID = re.compile(r"^(?:[\w\-.]{1,96}/)?[\w\-.]{1,96}$")
_probed: dict[str, tuple[float, str | None]] = {}


def is_hub_id(name: str) -> bool:
    """Whether ``name`` could name a hub repo ("org/name" or "name"), as huggingface_hub validates it."""
    return (bool(_REPO_ID.match(name)) and "--" not in name and ".." not in name and not name.endswith(".git")
            and not name.startswith((".", "-")) and not name.endswith((".", "-")))


def declared_offline() -> str | None:
    """The variable that declares offline mode (``HF_HUB_OFFLINE=1``), or None."""
    for name in OFFLINE_VARIABLES:
        if os.environ.get(name, "").strip().upper() in ("1", "ON", "YES", "TRUE"):
            return name
    return None


def offline_hint(local: str) -> str:
    """What to do when a hub name cannot be loaded offline; ``local`` names the local alternative."""
    declared = declared_offline()
    reach = (f"unset {declared} on a machine that reaches the hub" if declared else
             "if a hub is reachable through other settings, set HF_ENDPOINT (a mirror), HF_TOKEN or HTTPS_PROXY "
             "(HF_HUB_OFFLINE=1 uses the cache without trying the hub)")
    return f"use {local}, or download it first where the hub is reachable (the cache is under HF_HOME), or {reach}"


def endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


def probe(timeout: float = PROBE_SECONDS) -> str | None:
    """None when the hub endpoint answers (any HTTP status: a mirror may not serve ``/``); else why
    not: the offline variable, or the network error. One request, no retry, reused for a minute."""
    declared = declared_offline()
    if declared:
        return f"{declared}=1 is set"
    where = endpoint()
    seen = _probed.get(where)
    if seen is not None and time.monotonic() - seen[0] < PROBE_REUSE_SECONDS:
        return seen[1]
    from huggingface_hub.utils import get_session

    try:
        get_session().head(where, timeout=timeout, follow_redirects=False)
        reason = None
    except Exception as exc:  # noqa: BLE001 - any failure to get an answer means "not reachable"
        reason = f"no answer from {where} within {timeout:g} s: {type(exc).__name__}: {exc}"
    _probed[where] = (time.monotonic(), reason)
    return reason


@contextlib.contextmanager
def offline_mode() -> Iterator[None]:
    """huggingface_hub (and transformers, and datasets once imported) in offline mode: the cache only.

    The libraries read ``HF_HUB_OFFLINE`` once, at import, into module constants that every request
    consults (``huggingface_hub.constants.is_offline_mode``, ``datasets.config.HF_HUB_OFFLINE``), so
    setting the variable now would change nothing: the constants are set for the block instead."""
    from huggingface_hub import constants

    targets = [(constants, "HF_HUB_OFFLINE")]
    if "datasets" in sys.modules:
        import datasets.config

        targets += [(datasets.config, "HF_HUB_OFFLINE"), (datasets.config, "HF_DATASETS_OFFLINE")]
    saved = [(module, name, getattr(module, name)) for module, name in targets]
    for module, name in targets:
        setattr(module, name, True)
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


def in_cache(repo_id: str, filenames: tuple[str, ...] = ("config.json", "tokenizer_config.json"),
             repo_type: str = "model") -> bool:
    """Whether the local hub cache holds one of ``filenames`` of ``repo_id`` (no network)."""
    from huggingface_hub import try_to_load_from_cache

    for filename in filenames:
        found = try_to_load_from_cache(repo_id, filename, repo_type=repo_type)
        if isinstance(found, str):
            return True
    return False
