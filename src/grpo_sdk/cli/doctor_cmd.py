"""`grpoctl doctor`: what a bug report needs: versions, devices, and every plugin's status."""

from __future__ import annotations

import importlib.metadata as md
import json
import platform
import sys

import typer

from grpo_sdk.cli.common import get_registry, guarded
from grpo_sdk.core.errors import ExitCode

PACKAGES = ("grpo-sdk", "torch", "transformers", "attrs", "cattrs", "pluggy", "typer", "ray", "vllm",
            "sglang", "tensorrt-llm", "megatron-core")


def _devices() -> dict:
    try:
        import torch
    except Exception as exc:  # noqa: BLE001 - a broken torch is exactly what doctor reports
        return {"torch_error": f"{type(exc).__name__}: {exc}"}
    info = {"cpu_threads": torch.get_num_threads(), "cuda_available": torch.cuda.is_available(), "gpus": []}
    if info["cuda_available"]:
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        info["cuda_version"] = torch.version.cuda
    return info


def doctor(as_json: bool = typer.Option(False, "--json", help="Machine-readable output.")) -> None:
    """Versions, interpreter, devices and per-plugin status; exit 4 if something is broken."""
    def body() -> None:
        versions = {}
        for name in PACKAGES:
            try:
                versions[name] = md.version(name)
            except md.PackageNotFoundError:
                versions[name] = None
        registry = get_registry()
        report = {
            "python": sys.version.split()[0], "executable": sys.executable, "platform": platform.platform(),
            "packages": versions, "devices": _devices(),
            "components": [i.to_json() for i in registry.list()],
            "hooks": [h.to_json() for h in registry.hook_plugins],
        }
        problems = [f"{c['kind']} {c['name']}: {c['status']}: {c['problem']}" for c in report["components"]
                    if c["status"] in ("broken", "conflict", "incompatible-api")]
        problems += [f"hook plugin {h['name']}: {h['problem']}" for h in report["hooks"] if h["status"] != "ok"]
        if "torch_error" in report["devices"]:
            problems.append(f"torch does not import: {report['devices']['torch_error']}")
        report["problems"] = problems
        if as_json:
            print(json.dumps(report, indent=2))
        else:
            print(f"python      {report['python']} ({report['executable']})")
            print(f"platform    {report['platform']}")
            for name, version in versions.items():
                print(f"{name:<14}{version or '-'}")
            print(f"devices     {json.dumps(report['devices'])}")
            for c in report["components"]:
                hint = f"  -> {c['hint']}" if c["hint"] else ""
                print(f"{c['kind']:<12} {c['name']:<16} {c['status']}{hint}")
            print(f"install extras into this interpreter: {sys.executable} -m pip install 'grpo-sdk[vllm]'")
            for p in problems:
                print(f"problem: {p}")
        if problems:
            raise typer.Exit(int(ExitCode.ENVIRONMENT))

    guarded(body)
