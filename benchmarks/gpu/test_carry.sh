#!/usr/bin/env bash
# Tests the carry plan here (issue 42 item 2): the wheels benchmarks/gpu/build_carry.sh built install
# with no index into a FRESH Python 3.12 venv and work there, as they must on the GPU machine.
#
#   bash benchmarks/gpu/test_carry.sh   # env: CARRY_DIR (default benchmarks/gpu/carry), PYTHON312
#
# What stands in for the GPU machine's image: a fresh venv of Python 3.12 holding numpy 2.4.6 (the
# image has numpy 2.5.2, which is not carried), downloaded here into a scratch folder: the only step
# that needs the network. No torch: torch is not in the carry and must not be downloaded (an unpinned
# one pulls a multi-GB CUDA build), so what imports torch (peft, accelerate, megatron.core, mbridge,
# the checks themselves) is only shown to stop at `import torch` and at nothing else.
#
# Steps, each with no network where `unshare -n` works here (said when it does not):
#   1. venv A: pip install --no-index --no-deps every carried wheel (common + megatron-core 0.16.1);
#      the light imports; grpoctl --help (grpo_sdk without torch); `pip check` lists only torch missing.
#   2. venv B (numpy only, as the image): run_all.sh --setup-only, the GPU machine's own install
#      (--target + PYTHONPATH) and import step, as the device call runs it.
# Exit status: 0 passed, 1 a step failed, 2 not runnable (no python3.12, no carry, no network).
set -euo pipefail

cd "$(git rev-parse --show-toplevel)"
carry=$(realpath -m "${CARRY_DIR:-benchmarks/gpu/carry}")
# pyenv's shim for python3.12 exists but fails where the active version is another: each is tried.
py312=
pyenv_312=$(ls -d "$(pyenv root 2>/dev/null || echo ~/.pyenv)"/versions/3.12*/bin/python3.12 2>/dev/null | tail -1)
for candidate in "${PYTHON312:-}" "$(command -v python3.12)" "$pyenv_312"; do
    if [ -n "$candidate" ] && "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
        py312=$candidate
        break
    fi
done
if [ -z "$py312" ]; then
    echo "test_carry: no Python 3.12 (set PYTHON312)" >&2
    exit 2
fi
if ! ls "$carry"/common/*.whl >/dev/null 2>&1; then
    echo "test_carry: no wheels under $carry/common: run bash benchmarks/gpu/build_carry.sh first" >&2
    exit 2
fi
mcore=$(ls -d "$carry"/mcore-0.16.1 2>/dev/null || ls -d "$carry"/mcore-* | head -1)
tmp=$(mktemp -d /tmp/test-carry.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
# The config here (find-links /opt/wheels, a constraint) must not help the offline installs.
export PIP_CONFIG_FILE=/dev/null
offline=()
if unshare -n true 2>/dev/null; then
    offline=(unshare -n)
    echo "offline steps run under unshare -n (no network at all)"
else
    echo "unshare -n is not available: offline steps rely on --no-index alone"
fi
fail() { echo "test_carry: FAIL: $*" >&2; exit 1; }

# The image's numpy, standing in: the one download.
if ! nice -n 19 timeout 120 "$py312" -m pip download -q --no-deps --only-binary=:all: --disable-pip-version-check \
        -d "$tmp/image" numpy==2.4.6; then
    echo "test_carry: could not download numpy (network unreachable?)" >&2
    exit 2
fi
# Venv A gets no pip of its own (ensurepip costs seconds): this python's pip installs into it (pip
# --python), with no bytecode compiled (most of an install's time, and none of what is tested). Venv B
# has pip, as the image has: run_all.sh calls its python's pip.
pip=("${offline[@]}" nice -n 19 "$py312" -m pip --disable-pip-version-check)
"$py312" -m venv --without-pip "$tmp/A"
"$py312" -m venv "$tmp/B"
for v in A B; do
    "${pip[@]}" --python "$tmp/$v/bin/python" install -q --no-index --no-deps --no-compile "$tmp"/image/*.whl
done

echo "=== 1. every carried wheel into a fresh venv, no index, no deps"
t0=$SECONDS
"${pip[@]}" --python "$tmp/A/bin/python" install -q --no-index --no-deps --no-compile \
    --find-links "$carry/common" "$carry"/common/*.whl "$mcore"/*.whl $(ls "$carry"/trl/*.whl 2>/dev/null) \
    || fail "pip install --no-index"
echo "installed $(ls "$carry"/common/*.whl "$mcore"/*.whl "$carry"/trl/*.whl 2>/dev/null | wc -l) wheels in $((SECONDS - t0)) s"
"${offline[@]}" "$tmp/A/bin/python" - <<'EOF' || fail "imports"
import importlib, importlib.metadata, sys
import grpo_sdk, transformers, safetensors, tokenizers, huggingface_hub, attrs, cattrs, pluggy, typer, rich, yaml
import numpy, regex, kernels, pydantic
from transformers import PreTrainedTokenizerFast  # lazy in transformers: loads tokenizers for real
assert "torch" not in sys.modules, "a light import pulled torch in"
# These import torch first thing: without torch here they must stop there and nowhere else.
for mod in ("peft", "accelerate", "megatron.core", "mbridge"):
    try:
        importlib.import_module(mod)
    except ModuleNotFoundError as exc:
        assert exc.name == "torch", f"{mod}: missing {exc.name}, not torch"
    else:
        raise AssertionError(f"{mod} imported without torch?")
# datasets (TRL's, optional) needs what the image has beside torch: pyarrow, pandas, xxhash.
try:
    importlib.import_module("datasets")
except ModuleNotFoundError as exc:
    assert exc.name in {"pyarrow", "pandas", "xxhash", "torch"}, f"datasets: missing {exc.name}"
    print(f"datasets stops at import {exc.name} (the image has it)")
print("imports: ok (grpo_sdk", grpo_sdk.__version__, "transformers", transformers.__version__,
      "tokenizers", tokenizers.__version__, "cattrs", importlib.metadata.version("cattrs") + ");",
      "peft, accelerate, megatron.core and mbridge stop at import torch only")
EOF
"${offline[@]}" "$tmp/A/bin/grpoctl" --help >"$tmp/help.txt" || fail "grpoctl --help"
grep -q -i usage "$tmp/help.txt" || fail "grpoctl --help printed no usage"
echo "grpoctl --help: ok ($(wc -l <"$tmp/help.txt") lines)"
# pip check: every requirement of every carried wheel is met, torch's aside (it is the image's), and
# for TRL's datasets and trl the image's pyarrow, pandas, xxhash and jinja2.
"${pip[@]}" --python "$tmp/A/bin/python" check >"$tmp/check.txt" 2>&1 || true
if grep -v -E "requires torch, which is not installed\.$" "$tmp/check.txt" \
        | grep -v -E "^(trl|datasets) [^ ]+ requires (pyarrow|pandas|xxhash|jinja2), which is not installed\.$" \
        | grep -v -i "^No broken" | grep .; then
    fail "pip check found requirements the carry does not meet (above)"
fi
echo "pip check: only torch is missing ($(grep -c 'requires torch' "$tmp/check.txt") packages require it)" \
     "and, for trl/datasets, what the image has ($(grep -c -v 'requires torch' "$tmp/check.txt") lines)"

echo "=== 2. run_all.sh --setup-only: the GPU machine's install step, into a venv holding only numpy"
"${offline[@]}" env PYTHON="$tmp/B/bin/python" CARRY="$carry" CARRY_SITE="$tmp/site" OUT="$tmp/out" \
    bash benchmarks/gpu/run_all.sh --setup-only || fail "run_all.sh --setup-only"
echo "test_carry: PASS"
