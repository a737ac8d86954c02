"""A fingerprint of a training run: what a behaviour-preserving change must leave identical.

Prints the SHA-256 of the run's metrics.jsonl with the wall-clock metrics (``timing/*``,
``perf/*``) dropped, and of the final checkpoint's weights. Two runs of the same recipe on the
same machine (CPU, one thread) give the same two digests; a refactor that gives others changed
behaviour. Issue 34 used it to show the redesign changed nothing:

    taskset -c 0 grpoctl run --run-dir /tmp/before      # on the old commit
    taskset -c 0 grpoctl run --run-dir /tmp/after       # on the new one
    python benchmarks/recipe_fingerprint.py /tmp/before /tmp/after
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

WALL_CLOCK = ("timing/", "perf/")


def metrics_digest(run_dir: Path) -> tuple[str, int]:
    digest, lines = hashlib.sha256(), 0
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = {k: v for k, v in json.loads(line).items() if not k.startswith(WALL_CLOCK)}
        digest.update(json.dumps(row, sort_keys=True).encode() + b"\n")
        lines += 1
    return digest.hexdigest(), lines


def weights_digest(run_dir: Path) -> tuple[str, str]:
    status = json.loads((run_dir / "checkpoints" / "latest_checkpoint_status.json").read_text())
    policy = Path(status["path"]) / "policy"
    digest, paths = hashlib.sha256(), sorted(policy.glob("*.safetensors"))
    if not paths:
        raise SystemExit(f"{policy}: no *.safetensors")
    for path in paths:
        digest.update(path.read_bytes())
    return digest.hexdigest(), policy.parent.name


def main(run_dirs: list[str]) -> int:
    if not run_dirs:
        print(__doc__, file=sys.stderr)
        return 2
    seen = set()
    for name in run_dirs:
        run_dir = Path(name)
        metrics, lines = metrics_digest(run_dir)
        weights, checkpoint = weights_digest(run_dir)
        seen.add((metrics, weights))
        print(f"{run_dir}: metrics {metrics[:16]} ({lines} lines), weights {weights[:16]} ({checkpoint})")
    if len(run_dirs) > 1:
        print("identical" if len(seen) == 1 else "DIFFERENT")
    return 0 if len(seen) == 1 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
