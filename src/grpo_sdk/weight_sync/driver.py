"""The driver side the two Ray transports (``collective``, ``cuda_ipc``) share.

Both run a sync the same way: the policy ranks and the generation replicas each run one worker
operation (``send_op`` / ``receive_op``), all in flight together, under one deadline; policy
rank 0 answers ``(tensors, bytes)``. What differs (forming a broadcast group and its plan, or
connecting to a store and checking GPU placement) stays in each transport.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import attrs

from grpo_sdk.plugins import SyncStats, WorkerGroup

GROUP_TIMEOUT_MARGIN_S = 60.0  # the group's / store's timeout exceeds the driver's deadline: the driver names the culprit


@attrs.frozen
class SyncDeadline:
    """One deadline for every call of a sync (``timeout``, named in errors by ``key``), and the
    transport's own timeout (a process group, a store), ``GROUP_TIMEOUT_MARGIN_S`` beyond it."""

    timeout: float
    key: str
    group_timeout: float

    @classmethod
    def of(cls, transport: str, timeout_s: float | None, call_timeout_s: float) -> SyncDeadline:
        """``weight_sync.<transport>.timeout_s`` when set, else ``cluster.call_timeout_s``."""
        timeout = float(timeout_s or call_timeout_s)
        key = f"weight_sync.{transport}.timeout_s" if timeout_s else "cluster.call_timeout_s"
        return cls(timeout=timeout, key=key,
                   group_timeout=max(timeout, float(call_timeout_s)) + GROUP_TIMEOUT_MARGIN_S)

    def wait(self, group: WorkerGroup, calls: Sequence[Any]) -> list[Any]:
        # "wait": each side finishes its part (a broadcast, every acknowledgement) before it raises, so a
        # dead peer is reported as the WorkerError naming it, not as its peers' errors.
        return group.wait(calls, timeout=self.timeout, on_app_error="wait", deadline_key=self.key)


def require_worker_groups(what: str, policy: Any, generation: Any, hint: str = "") -> None:
    """TypeError unless both sides are worker groups (``cluster.runtime=ray``); ``what`` says why."""
    if not (isinstance(policy, WorkerGroup) and isinstance(generation, WorkerGroup)):
        raise TypeError(f"{what} and needs the Ray runtime's worker groups (cluster.runtime=ray); got "
                        f"{type(policy).__name__} and {type(generation).__name__}{hint}")


def send_and_receive(policy: WorkerGroup, generation: WorkerGroup, deadline: SyncDeadline, *, name: str,
                     send: tuple[Callable[..., Any], ...], receive: tuple[Callable[..., Any], ...], version: int,
                     start: float) -> SyncStats:
    """``send`` (an operation and its arguments) on every policy rank and ``receive`` on every replica,
    together; the stats from policy rank 0's ``(tensors, bytes)``, timed from ``start``."""
    calls = (policy.submit(*send, name=f"{name}_send")
             + generation.submit(*receive, name=f"{name}_receive"))
    num_tensors, num_bytes = deadline.wait(policy, calls)[0]
    return SyncStats(version=version, num_tensors=num_tensors, num_bytes=num_bytes,
                     seconds=time.perf_counter() - start)
