"""The smallest stand-in with a weight-update group: what the collective transport's own tests drive.

Not any engine's protocol (the engine stand-ins are sglang_server, trtllm_server, dynamo_server):
``/join`` joins the trainer's group as the engines do (``EngineModel.join_group``), ``/receive``
receives one broadcast per listed tensor and loads them, ``/digest`` sums each weight (what the
test compares with the policy's), ``/fail_next`` makes the next ``/receive`` answer 400 before
receiving anything (an engine that rejects an update), ``/joins`` counts the joins.
"""

from __future__ import annotations

from engine_servers.base import HTTPFailure, main


def routes(model, args):
    state = {"joins": 0, "fail_next": False}

    def join(body, query):
        model.join_group(master_address=body["master_address"], master_port=body["master_port"],
                         rank=body["rank_offset"], world_size=body["world_size"], group_name=body["group_name"],
                         backend=body["backend"], timeout_s=30)
        state["joins"] += 1
        return {"success": True}

    def receive(body, query):
        if state["fail_next"]:
            state["fail_next"] = False
            raise HTTPFailure(400, f"rejected the update of {body['names'][0]}")
        model.receive(body["names"], body["dtypes"], body["shapes"], body["group_name"],
                      version=body["version"] if body["last"] else None)
        return {"success": True}

    def fail_next(body, query):
        state["fail_next"] = True
        return {}

    def digest(body, query):
        return {"version": model.weight_version,
                "sums": {name: float(t.double().sum()) for name, t in model.hf.model.state_dict().items()}}

    return {("POST", "/join"): join, ("POST", "/receive"): receive, ("POST", "/fail_next"): fail_next,
            ("GET", "/digest"): digest, ("GET", "/joins"): lambda body, query: state["joins"]}


if __name__ == "__main__":
    main(routes)
