"""The ``nemo_gym`` environment's spec and config: NVIDIA NeMo-Gym's own servers play the rollouts.

Light (no torch, no nemo-gym): ``grpoctl plugins list`` and ``config validate`` import it. The
servers run in their own Python >= 3.12 virtual environment (``.ci/nemo-gym-venv`` builds it);
the config check makes sure that interpreter is there and has nemo-gym, before the model loads.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from grpo_sdk.plugins import ComponentSpec, EndpointConfig, option

if TYPE_CHECKING:
    from grpo_sdk.plugins.toolkit import MasterConfig

NEMO_GYM_VERSION = "0.4.0"  # what .ci/nemo-gym-venv installs and the plugin is tested with
PYTHON_ENV = "GRPO_SDK_NEMO_GYM_PYTHON"
VENV_ENV = "GRPO_SDK_NEMO_GYM_VENV"
BUILTIN_RESOURCES = {"builtin:calculator"}  # shipped with grpo-sdk: environments/nemo_gym/gym_apps/
KEY = "env.nemo_gym"


def default_python() -> Path:
    """$GRPO_SDK_NEMO_GYM_PYTHON, else the python of $GRPO_SDK_NEMO_GYM_VENV or of the venv
    ``.ci/nemo-gym-venv`` caches (~/.cache/grpo-sdk/venv-nemo-gym-<version>)."""
    if os.environ.get(PYTHON_ENV):
        return Path(os.environ[PYTHON_ENV]).expanduser()
    venv = os.environ.get(VENV_ENV) or f"~/.cache/grpo-sdk/venv-nemo-gym-{NEMO_GYM_VERSION}"
    return Path(venv).expanduser() / "bin" / "python"


def _positive(instance: Any, attribute: Any, value: float) -> None:
    if value <= 0:
        raise ValueError(f"{attribute.name} must be positive, got {value}")


@attrs.frozen(kw_only=True)
class NemoGymConfig:
    python: str | None = option(None, "The interpreter of a Python >= 3.12 virtual environment holding nemo-gym "
                                f"(the servers run there; grpo-sdk itself stays on its own Python). null: "
                                f"${PYTHON_ENV}, else <${VENV_ENV} or ~/.cache/grpo-sdk/venv-nemo-gym-"
                                f"{NEMO_GYM_VERSION}>/bin/python, the one .ci/nemo-gym-venv builds.")
    resources_server: str = option("builtin:calculator", "The resources server (tools and /verify): "
                                   "'builtin:calculator' (shipped with grpo-sdk: an add tool and an exact-answer "
                                   "reward), the name of one NeMo-Gym ships (resources_servers/<name>, e.g. "
                                   "example_multi_step), or the path of an app.py written with NeMo-Gym's base "
                                   "classes.")
    resources_server_config: dict[str, Any] = option(factory=dict, help="Extra fields of the resources server's "
                                                     "config block (its own options, e.g. the calculator's modulus "
                                                     "and result_format).")
    agent: str = option("simple_agent", "The agent server: the name of one NeMo-Gym ships "
                        "(responses_api_agents/<name>) or the path of an app.py.")
    agent_config: dict[str, Any] = option(factory=dict, help="Extra fields of the agent server's config block.")
    model_server_config: dict[str, Any] = option(factory=dict, help="Extra fields of NeMo-Gym's vllm_model block "
                                                 "(the model server that calls grpo-sdk's endpoint), e.g. "
                                                 "uses_reasoning_parser or chat_template_kwargs.")
    use_reward_components: bool = option(False, "true: the rollout's rewards are /verify's reward_components "
                                         "(named, e.g. for gdpo), not its reward; false: the reward, with the "
                                         "components logged as env/verify/reward_components/<name>.")
    max_steps: int = option(8, "Model calls the agent may make in one rollout (simple_agent's max_steps); "
                            "without a bound it loops until the model stops calling tools.",
                            validator=_positive)
    startup_timeout_s: float = option(120.0, "Seconds the servers may take to answer GET / after they start; "
                                      "past it the run stops, naming the server and showing its log.",
                                      validator=_positive)
    timeout_s: float = option(600.0, "Seconds one rollout (a POST to the agent's /run) may take; past it the "
                              "rollout fails (env.on_reward_error).", validator=_positive)
    max_concurrency: int = option(64, "Rollouts posted to /run at once.",
                                  validator=[attrs.validators.gt(0), attrs.validators.le(4096)])
    log_dir: str | None = option(None, "Where the servers' logs go (one file per server). null: "
                                 "<run_dir>/nemo_gym.")
    endpoint: EndpointConfig = option(factory=EndpointConfig, help="The rollout endpoint NeMo-Gym's model "
                                      "server calls (its base_url).")


def resolve_python(options: NemoGymConfig) -> Path:
    return Path(options.python).expanduser() if options.python else default_python()


def check_python(python: Path, configured: bool) -> str | None:
    """What is wrong with ``python`` as NeMo-Gym's interpreter, or None."""
    what = f"{python}" if configured else f"null means {python}, which"
    fix = (f"build it with .ci/nemo-gym-venv (a Python >= 3.12 venv with nemo-gym=={NEMO_GYM_VERSION}), or point "
           f"{KEY}.python or ${PYTHON_ENV} at one")
    if not python.exists():
        return f"{what}: no such interpreter; {fix}" if configured else f"{what} does not exist; {fix}"
    if not os.access(python, os.X_OK):
        return f"{python} is not executable; {fix}"
    probe = ("import sys, importlib.util as u\n"
             "ok = sys.version_info >= (3, 12) and u.find_spec('nemo_gym') is not None\n"
             "print('%d.%d' % sys.version_info[:2], 'ok' if ok else 'missing')")
    try:
        out = subprocess.run([str(python), "-I", "-c", probe], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{python} cannot be run ({exc}); {fix}"
    words = out.stdout.split()
    if out.returncode != 0 or len(words) != 2:
        last = (out.stderr.strip().splitlines() or ["no output"])[-1]
        return f"{python} failed to start ({last}); {fix}"
    if words[1] != "ok":
        return f"{python} is Python {words[0]} without nemo-gym (NeMo-Gym needs Python >= 3.12); {fix}"
    return None


def check_nemo_gym(config: MasterConfig, options: NemoGymConfig | None, registry: Any) -> list[tuple[str, str]]:
    options = options or NemoGymConfig()
    problems = []
    problem = check_python(resolve_python(options), configured=options.python is not None)
    if problem is not None:
        problems.append((f"{KEY}.python", problem))
    for name, value, builtin in (("resources_server", options.resources_server, BUILTIN_RESOURCES),
                                 ("agent", options.agent, set())):
        if value.endswith(".py") and not Path(value).expanduser().is_file():
            problems.append((f"{KEY}.{name}", f"{value!r}: no such file (give an app.py, or the name of a server "
                                              "NeMo-Gym ships)"))
        elif value.startswith("builtin:") and value not in builtin:
            problems.append((f"{KEY}.{name}", f"{value!r} is not built in (built in: "
                                              f"{', '.join(sorted(builtin)) or 'none'})"))
        elif not value.strip():
            problems.append((f"{KEY}.{name}", "must name a server"))
    return problems


NEMO_GYM = ComponentSpec(
    name="nemo_gym",
    kind="environment",
    impl="grpo_sdk.environments.nemo_gym.environment:NemoGymEnvironment",
    config="grpo_sdk.environments.nemo_gym_spec:NemoGymConfig",
    check="grpo_sdk.environments.nemo_gym_spec:check_nemo_gym",
    capabilities={"runs_agents", "tool_calls"},
    summary="NVIDIA NeMo-Gym's own servers (a resources server, an agent, its vllm_model model server over the "
            "rollout endpoint) play the rollouts; rewards from /verify, metrics from /aggregate_metrics.",
)
