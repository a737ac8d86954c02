"""Start one NeMo-Gym server in this process, without Ray; run by grpo-sdk with NeMo-Gym's Python.

usage: python launch.py APP     (APP: the path of an app.py, or a package of NeMo-Gym's holding one,
                                 e.g. responses_api_agents.simple_agent)

The server reads its config as NeMo-Gym's ``gym env start`` gives it: ``NEMO_GYM_CONFIG_DICT`` (the
whole config, JSON) and ``NEMO_GYM_CONFIG_PATH`` (its own top-level key). Every NeMo-Gym server calls
``initialize_ray()`` when it starts, which starts a local Ray cluster per process unless the config
names one; the simple agent, the vllm_model model server and simple resources servers never use Ray,
so it is a no-op here. The process exits when grpo-sdk (``GRPO_SDK_PARENT_PID``) is gone, so a killed
trainer leaves no server behind.
"""

import importlib.util
import os
import runpy
import sys
import threading
import time


def app_path(target: str) -> str:
    if target.endswith(".py"):
        return os.path.abspath(target)
    spec = importlib.util.find_spec(target)
    if spec is None or not spec.submodule_search_locations:
        sys.exit(f"launch.py: no package {target!r} in this Python ({sys.executable})")
    path = os.path.join(list(spec.submodule_search_locations)[0], "app.py")
    if not os.path.isfile(path):
        sys.exit(f"launch.py: {target!r} has no app.py ({path})")
    return path


def watch_parent(pid: int) -> None:
    while True:
        if os.getppid() != pid:
            os._exit(0)
        time.sleep(0.5)


def main() -> None:
    path = app_path(sys.argv[1])
    parent = os.environ.get("GRPO_SDK_PARENT_PID")
    if parent:
        threading.Thread(target=watch_parent, args=(int(parent),), daemon=True).start()
    import nemo_gym.server_utils

    nemo_gym.server_utils.initialize_ray = lambda: None
    os.chdir(os.path.dirname(path))
    sys.path.insert(0, os.path.dirname(path))  # an app.py may import modules next to it
    sys.argv = [path]
    print(f"launch.py: {os.environ.get('NEMO_GYM_CONFIG_PATH')} runs {path}", flush=True)
    runpy.run_path(path, run_name="__main__")


if __name__ == "__main__":
    main()
