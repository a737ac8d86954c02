"""What the code environment's sandbox costs: per-snippet wall time, and throughput by num_workers.

    python benchmarks/sandbox_overhead.py                  # 40 snippets, workers 1 2 4 8
    python benchmarks/sandbox_overhead.py --snippets 200 --workers 1 4 16

Prints, for a trivial snippet (``def add``, one test) on this machine:

* the baseline: ``python -I -c pass`` as a bare subprocess (what any process-per-snippet design pays),
  and ``python -I -B -c <the harness>`` without the sandbox around it;
* one snippet in the sandbox, run one after another: median and p90 wall time, and the part of it
  that is the sandbox (the difference from the harness alone): namespaces, mounts, the uid lease,
  the bootstrap's own interpreter;
* a batch through ``run_many`` at each ``num_workers``: snippets per second.

Numbers from one run are in docs/sandbox.md. Nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

from grpo_sdk.environments.sandbox import Sandbox
from grpo_sdk.environments.sandbox_boot import HARNESS
from grpo_sdk.environments.specs import CodeEnvConfig

CODE = "def add(a, b):\n    return a + b"
TESTS = ["assert add(1, 2) == 3"]


def timed(fn, n: int) -> list[float]:
    out = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def summary(seconds: list[float]) -> str:
    ms = sorted(1000 * s for s in seconds)
    p90 = ms[min(len(ms) - 1, int(0.9 * len(ms)))]
    return f"median {statistics.median(ms):6.1f} ms   p90 {p90:6.1f} ms"


def harness_alone(workdir: str) -> None:
    with open(f"{workdir}/solution.py", "w") as f:
        f.write(CODE)
    with open(f"{workdir}/tests.json", "w") as f:
        f.write('["assert add(1, 2) == 3"]')
    # fd 3 for the report: /dev/null stands in for the pipe
    subprocess.run(f"exec 3>/dev/null; exec {sys.executable} -I -B -c \"$HARNESS\"", shell=True, cwd=workdir,
                   env={"HARNESS": HARNESS, "PATH": "/usr/bin:/bin"}, check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--snippets", type=int, default=40, help="snippets per measurement")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4, 8], help="num_workers to compare")
    args = parser.parse_args()

    import tempfile

    start = time.perf_counter()
    sandbox = Sandbox(CodeEnvConfig(num_workers=max(args.workers)))
    print(f"probe (first sandbox, at construction): {1000 * (time.perf_counter() - start):.1f} ms")
    print(f"layers: {', '.join(sandbox.layers)}; uid switch: {sandbox.uid_switch}; "
          f"missing: {sandbox.missing or 'none'}")
    bare = timed(lambda: subprocess.run([sys.executable, "-I", "-c", "pass"], check=True), args.snippets)
    with tempfile.TemporaryDirectory() as workdir:
        harness = timed(lambda: harness_alone(workdir), args.snippets)
    one = timed(lambda: sandbox.run(CODE, TESTS), args.snippets)
    print(f"python -I -c pass           {summary(bare)}")
    print(f"harness, no sandbox         {summary(harness)}")
    print(f"one snippet in the sandbox  {summary(one)}")
    print(f"the sandbox's share         {1000 * (statistics.median(one) - statistics.median(harness)):6.1f} ms "
          "(median difference)")
    for workers in args.workers:
        box = Sandbox(CodeEnvConfig(num_workers=workers))
        jobs = [(CODE, TESTS)] * args.snippets
        start = time.perf_counter()
        results = box.run_many(jobs)
        elapsed = time.perf_counter() - start
        box.close()
        assert all(r.outcome == "passed" for r in results), [r.reason for r in results if r.outcome != "passed"]
        print(f"num_workers={workers:<3} {args.snippets} snippets in {elapsed:6.2f} s: "
              f"{args.snippets / elapsed:6.1f} snippets/s")
    sandbox.close()


if __name__ == "__main__":
    main()
