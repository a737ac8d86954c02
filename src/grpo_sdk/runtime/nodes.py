"""Which nodes of a Ray cluster a run uses (``cluster.num_nodes``), and the record of where its workers went.

``cluster.num_nodes = N > 1`` means the run uses N nodes, not "at most N": its bundles (one per
policy rank and generation replica, see ``ray_runtime``) are cut into N contiguous, near-equal
blocks, and block j is pinned to node j (a per-bundle label selector on ``ray.io/node-id``). A
placement strategy alone cannot say this: ``PACK`` puts every bundle on one node when one node
holds them all (always so on CPUs), and ``STRICT_SPREAD`` wants a node per bundle. Contiguous, so
neighbouring policy ranks share a node (FSDP's collectives stay on it as far as they can), and
without colocation the policy's ranks come first and generation's replicas after them: on two
nodes with as many ranks as replicas, training on one node and generation on the other, as
NeMo-RL's non-colocated layout.

The nodes: the alive ones whose resources hold the largest block, the driver's node first (files
it wrote read the same there), then by node id. Fewer than N is an error naming
``cluster.num_nodes`` and listing the cluster's nodes, before anything is reserved.

Pure functions over the dicts ``ray.nodes()`` returns; no Ray import here.
"""

from __future__ import annotations

from typing import Any, Iterable

from grpo_sdk.core.errors import GrpoSdkError

NODE_LABEL = "ray.io/node-id"  # the label Ray gives every node: its id
SHOWN_ID = 8  # hex digits of a node id in messages (as `ray status` abbreviates them)


def short(node_id: str | None) -> str:
    return (node_id or "?")[:SHOWN_ID]


def node_of_bundles(bundles: int, num_nodes: int) -> list[int]:
    """The node (0..num_nodes-1) of each bundle: contiguous blocks whose sizes differ by at most one,
    every node used. ``bundles < num_nodes`` cannot use every node (the config check refuses it)."""
    if bundles < num_nodes:
        raise ValueError(f"{bundles} bundles cannot span {num_nodes} nodes")
    return [i * num_nodes // bundles for i in range(bundles)]


def block_resources(bundle: dict[str, float], node_of: list[int], num_nodes: int) -> list[dict[str, float]]:
    """What each node's block of bundles takes."""
    counts = [node_of.count(j) for j in range(num_nodes)]
    return [{k: v * n for k, v in bundle.items()} for n in counts]


def fits(resources: dict[str, float], needed: dict[str, float]) -> bool:
    return all(resources.get(k, 0.0) + 1e-9 >= v for k, v in needed.items())


def describe_node(node: dict[str, Any]) -> str:
    res = node.get("Resources") or {}
    what = f"CPU {res.get('CPU', 0):g}, GPU {res.get('GPU', 0):g}" if node.get("Alive") else "dead"
    return f"node {short(node.get('NodeID'))} ({node.get('NodeManagerAddress', '?')}, {what})"


def choose_nodes(nodes: Iterable[dict[str, Any]], blocks: list[dict[str, float]], *, driver_node: str | None,
                 address: str | None) -> list[str]:
    """The ids of ``len(blocks)`` alive nodes, node j for block j (see the module docstring)."""
    nodes = list(nodes)
    alive = [n for n in nodes if n.get("Alive")]
    largest = max(blocks, key=lambda b: sum(b.values()))
    able = sorted((n for n in alive if fits(n.get("Resources") or {}, largest)),
                  key=lambda n: (n["NodeID"] != driver_node, n["NodeID"]))
    wanted = len(blocks)
    if len(able) >= wanted:
        return [n["NodeID"] for n in able[:wanted]]
    listing = "; ".join(describe_node(n) for n in nodes) or "none"
    where = f"the Ray cluster at {address}" if address else "the Ray cluster"
    if len(alive) < wanted:
        problem = f"{where} has {len(alive)} alive node(s)"
    else:
        problem = (f"only {len(able)} of the {len(alive)} alive nodes of {where} can hold a block of "
                   f"{_show(largest)} (the run's bundles split over {wanted} nodes)")
    raise GrpoSdkError(f"cluster.num_nodes={wanted}, but {problem}: {listing}. Start more nodes "
                       "(`ray start --address=HEAD:PORT` on each) or lower cluster.num_nodes")


def _show(resources: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:g}" for k, v in resources.items())


def placement_record(num_nodes: int, nodes: list[str] | None, workers: Iterable[Any]) -> dict[str, Any]:
    """What ``<run dir>/placement.json`` holds: the nodes chosen (null on one node, where Ray picks
    it) and, for every worker, the node it reported from inside its own process."""
    return {"num_nodes": num_nodes, "nodes": nodes,
            "workers": [{"role": w.role, "index": w.index, "pid": w.pid, "node_ip": w.node, "node_id": w.node_id}
                        for w in workers]}
