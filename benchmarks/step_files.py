"""How many source files a reader opens to follow one GRPO step: the grpo_sdk files whose
functions run during one step of a recipe (default: the built-in one), with their line counts.

It traces calls, on every thread, from the end of step ``--after`` to the end of the next step
(rollout, scoring, logprobs, advantages, training, weight sync, logging), so setup and the run's
end are not counted; ``api.py`` is this script's own callback. Files
that only define records or protocols (no function of theirs runs) are not counted either; the
list at the end names them when the step's code imports them. Issue 34's goal: at most 12 files.

    python benchmarks/step_files.py                       # the built-in recipe
    python benchmarks/step_files.py -c recipe.yaml k=v    # another
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
from pathlib import Path

import grpo_sdk

SRC = Path(grpo_sdk.__file__).resolve().parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-c", "--config", action="append", default=[])
    parser.add_argument("--after", type=int, default=2, help="trace the step after this one")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    files: dict[str, int] = {}

    def profile(frame, event, arg):
        if event == "call":
            name = frame.f_code.co_filename
            if name.startswith(str(SRC)):
                files[name] = files.get(name, 0) + 1

    def on_step(step: int, metrics: dict) -> None:
        # Threads too: the environment is called on a helper thread under its deadline.
        if step == args.after:
            threading.setprofile(profile)
            sys.setprofile(profile)
        elif step == args.after + 1:
            sys.setprofile(None)
            threading.setprofile(None)

    overrides = [f"grpo.max_num_steps={args.after + 2}", "grpo.val_period=0", "checkpointing.enabled=false",
                 *args.overrides]
    with tempfile.TemporaryDirectory() as run_dir:
        grpo_sdk.train(args.config or None, overrides, run_dir=run_dir, on_step=on_step)
    total = 0
    for name in sorted(files):
        lines = len(Path(name).read_text().splitlines())
        total += lines
        print(f"{Path(name).relative_to(SRC)}: {lines} lines, {files[name]} calls")
    packages = {Path(n).relative_to(SRC).parts[0] for n in files}
    print(f"{len(files)} files ({total} lines) in {len(packages)} packages run during one step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
