"""A two-node Ray cluster on this machine, in a process of its own: ``python two_node_cluster.py CPUS``.

Ray's own test utility (``ray.cluster_utils.Cluster``) starts a head node and one worker node,
each a raylet of its own with ``CPUS`` logical CPUs, both on loopback (the environment must set
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``: Ray then takes 127.0.0.1 as every node's address). The
nodes share the machine's cores, memory and filesystem; nothing goes over a real network.

A process of its own because a pytest process may already be connected to another cluster (the
session's ``ray_cluster``), and one process talks to one cluster. Protocol, one JSON line each:

* on start: ``{"address": GCS, "nodes": [NODE, NODE]}`` (head first), where NODE is
  ``{"node_id": hex, "raylet_pid": int, "head": bool}``;
* stdin ``add``: another worker node like the first; answers its NODE;
* stdin closed (the test ended, or its process died): every node is stopped, then this exits.
"""

from __future__ import annotations

import json
import os
import sys

# Health checks every 0.5 s, a node dead after 4 missed ones: a lost node is noticed within
# seconds (Ray's defaults take up to ~30 s), so the node-death test stays short.
SYSTEM_CONFIG = {"health_check_period_ms": 500, "health_check_timeout_ms": 1000, "health_check_failure_threshold": 4}
OBJECT_STORE_BYTES = 100 * 1024 * 1024


def describe(node, head: bool) -> dict:
    return {"node_id": node.node_id, "raylet_pid": node.all_processes["raylet"][0].process.pid, "head": head}


def forget_address(address: str) -> None:
    """Ray writes the head's address to /tmp/ray/ray_current_cluster, and a plain ``ray.init()``
    anywhere on the machine would join this cluster: remove it (when it is still ours)."""
    from ray._common.utils import get_ray_address_file

    path = get_ray_address_file(None)
    try:
        with open(path) as f:
            if f.read().strip() == address:
                os.remove(path)
    except OSError:
        pass


def watch_new_processes(before: dict[int, int]) -> object:
    """The runtime's watchdog over this process's children started since ``before`` (a node's
    raylet and GCS) and their descendants: Ray's agents outlive a stopped node by a minute."""
    from grpo_sdk.runtime.local_cluster import _children, _start_watchdog

    return _start_watchdog({pid: t for pid, t in _children(os.getpid()).items() if before.get(pid) != t})


def main() -> None:
    from ray.cluster_utils import Cluster

    from grpo_sdk.runtime.local_cluster import _children

    cpus = int(sys.argv[1])
    node_args = {"num_cpus": cpus, "object_store_memory": OBJECT_STORE_BYTES, "include_dashboard": False}
    before, watchdogs = _children(os.getpid()), []
    cluster = Cluster(initialize_head=True, head_node_args={**node_args, "_system_config": SYSTEM_CONFIG})
    try:
        forget_address(cluster.address)
        worker = cluster.add_node(**node_args)
        cluster.wait_for_nodes(timeout=60)
        watchdogs.append(watch_new_processes(before))
        print(json.dumps({"address": cluster.address,
                          "nodes": [describe(cluster.head_node, True), describe(worker, False)]}), flush=True)
        for line in sys.stdin:
            if line.strip() == "add":
                before = _children(os.getpid())
                node = cluster.add_node(**node_args)
                watchdogs.append(watch_new_processes(before))
                print(json.dumps(describe(node, False)), flush=True)
    finally:
        for node in list(cluster.worker_nodes) + [cluster.head_node]:
            try:  # a node whose raylet a test killed: its other processes still go
                node.kill_all_processes(check_alive=False, allow_graceful=False, wait=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        for watchdog in filter(None, watchdogs):  # closing its stdin: it kills what is left, then exits
            watchdog.stdin.close()
            watchdog.wait(timeout=30)


if __name__ == "__main__":
    main()
