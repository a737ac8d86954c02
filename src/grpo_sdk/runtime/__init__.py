"""Runtimes: where the components of a run live.

The training loop asks its runtime to build every component and then talks to what it gets back
through the protocols only, so the same loop drives components in this process (``local``, the
default) or on a Ray cluster (``ray``: worker groups, replicas and actor pools that implement the
same protocols).

A runtime has two methods::

    runtime.build(kind, name, config, context) -> component   # implements the kind's protocol
    runtime.shutdown()
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from grpo_sdk.config.schema import MasterConfig


class LocalRuntime:
    """Every component in this process, constructed as ``Impl(config, context)``; environments
    (user code: reward functions, sandboxes, graders) answer within ``cluster.call_timeout_s``."""

    def __init__(self, registry: Any, call_timeout_s: float = 1800.0):
        self.registry = registry
        self.call_timeout_s = call_timeout_s

    def build(self, kind: str, name: str, config: Any, context: Any) -> Any:
        component = self.registry.load_impl(kind, name)(config, context)
        if kind == "environment":
            from grpo_sdk.runtime.deadlines import EnvironmentDeadline

            return EnvironmentDeadline(component, name, self.call_timeout_s)
        return component

    def shutdown(self) -> None:
        pass


def make_runtime(config: MasterConfig, registry: Any) -> Runtime:
    """The runtime ``cluster.runtime`` selects; ``ray`` is imported only when selected."""
    if config.cluster.runtime == "ray":
        from grpo_sdk.runtime.ray_runtime import RayRuntime

        return RayRuntime(config, registry)
    return LocalRuntime(registry, config.cluster.call_timeout_s)
