#!/usr/bin/env bash
# On the GPU machine, in ONE device call (no network there): installs the wheels that
# benchmarks/gpu/build_carry.sh put in benchmarks/gpu/carry, then runs the GPU checks that exist,
# check_hf.py first (issue 42 item 1; said MISSING if it is absent), then check_megatron.py once per
# megatron-core version in MCORE_VERSIONS, all inside BUDGET_S seconds of wall clock. Device tool:
#
#   run(command="bash benchmarks/gpu/run_all.sh", carry=["benchmarks/gpu/carry"], timeout_s=600)
#
#   bash benchmarks/gpu/run_all.sh [--setup-only]   # --setup-only: install and import, run no check
#
# TRL (carry/trl, optional) is installed beside and reported: whether `from trl import GRPOTrainer`
# works there (datasets needs the image's pyarrow >= 24) is printed, never a setup failure.
# Environment: BUDGET_S (default 540: the whole script, install included, so that a 600 s call
# returns with its files), HF_TIMEOUT (300) and MEGATRON_TIMEOUT (280): the most each check gets,
# cut to what is left of the budget; MCORE_VERSIONS (default "0.16.1", CI's version; "0.16.1 0.19.2"
# runs both if time is left), CARRY (the wheel folder), CARRY_SITE (default /tmp/carry-site),
# PYTHON (default python3: the image's, which holds torch), OUT (where results go).
#
# The wheels go into a scratch --target that PYTHONPATH puts before the image's site-packages: the
# carried (CI-tested) versions shadow the image's, and the image's torch, numpy and CUDA libraries are
# used as they are. The repo's src/ goes first on PYTHONPATH, so the code under test is this working
# tree even if the carried grpo-sdk wheel is older; the wheel supplies the entry points (a warning
# says so when pyproject.toml changed since the wheel was built).
#
# Writes to $OUT (default /tmp/gpu-checks), at most 7 files (the device tool returns 8):
# run_all.log (this output), check_hf.{log,json}, check_megatron-VERSION.{log,json}.
# Exit status: 0 every check that exists ran and passed; 1 a check failed or ran out of time;
# 2 the setup failed (no wheels, the install or an import failed, no CUDA).
set -uo pipefail

cd "$(dirname "$0")/../.."
repo=$PWD
carry=${CARRY:-benchmarks/gpu/carry}
site=${CARRY_SITE:-/tmp/carry-site}
out=${OUT:-/tmp/gpu-checks}
python=${PYTHON:-python3}
budget=${BUDGET_S:-540}
setup_only=0
[ "${1:-}" = --setup-only ] && setup_only=1
deadline=$((SECONDS + budget))
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PIP_NO_INDEX=1 PIP_NO_INPUT=1

# A check's time: its cap, cut to what is left of the budget less a margin for the summary.
time_for() {
    local left=$((deadline - SECONDS - 15))
    [ "$left" -lt "$1" ] && echo "$left" || echo "$1"
}

install() {  # install TARGET WHEEL...
    local target=$1; shift
    rm -rf "$target"
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
        --target "$target" "$@"
}

setup() {
    echo "=== setup ($(date -u +%FT%TZ)); budget ${budget}s"
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    if ! ls "$carry"/common/*.whl >/dev/null 2>&1; then
        echo "SETUP FAILED: no wheels under $carry/common: run bash benchmarks/gpu/build_carry.sh where there is" \
             "network and name $carry in the device call's carry"
        return 2
    fi
    echo "carry: $(ls "$carry"/common/*.whl | wc -l) common wheels, $(du -sh "$carry" | cut -f1)"
    if [ -f "$carry/pyproject.sha256" ] && ! sha256sum --status -c "$carry/pyproject.sha256"; then
        echo "WARNING: pyproject.toml changed since the carried grpo-sdk wheel was built: its entry points may" \
             "be stale (rebuild with build_carry.sh)"
    fi
    local t0=$SECONDS
    # TRL (optional, carry/trl) goes into the same site: check_hf.py imports it if it can.
    install "$site" "$carry"/common/*.whl $(ls "$carry"/trl/*.whl 2>/dev/null) \
        || { echo "SETUP FAILED: pip install of $carry/common"; return 2; }
    export PYTHONPATH=$repo/src:$site${PYTHONPATH:+:$PYTHONPATH} PATH=$site/bin:$PATH
    echo "installed into $site in $((SECONDS - t0)) s"
    # What is imported from where: the versions each check's results go with.
    "$python" - "$setup_only" <<'EOF' || { echo "SETUP FAILED: an import"; return 2; }
import importlib, importlib.metadata as md, sys
print("python", sys.version.split()[0], sys.executable)
for mod in ("grpo_sdk", "transformers", "safetensors", "tokenizers", "huggingface_hub", "attrs", "cattrs",
            "pluggy", "typer", "rich", "yaml", "numpy"):
    importlib.import_module(mod)
try:
    import torch
except ImportError as exc:
    if sys.argv[1] != "1":
        raise
    print("torch: not importable (--setup-only):", exc)
else:
    import accelerate, peft  # both import torch
    cuda = torch.cuda.is_available()
    print("torch", torch.__version__, "cuda", cuda, torch.cuda.get_device_name(0) if cuda else "")
    if not cuda and sys.argv[1] != "1":
        sys.exit("no CUDA device")
try:  # optional: reported, never a setup failure (datasets needs the image's pyarrow >= 24)
    import trl
    from trl import GRPOTrainer  # trl's top level is lazy: this is what check_hf.py would use
    print("trl", trl.__version__, "GRPOTrainer imports")
except Exception as exc:
    print(f"trl: not importable: {type(exc).__name__}: {exc}")
import grpo_sdk
print("grpo_sdk from", grpo_sdk.__file__)
for name in ("grpo-sdk", "transformers", "huggingface-hub", "tokenizers", "safetensors", "peft", "accelerate",
             "cattrs", "typer", "numpy", "torch", "trl", "datasets", "pyarrow", "pandas"):
    try:
        print(f"  {name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"  {name} absent")
EOF
    grpoctl --help >/dev/null || { echo "SETUP FAILED: grpoctl --help"; return 2; }
    echo "grpoctl --help: ok"
}

# run_check NAME CAP SCRIPT [PYTHONPATH prefix]: its full log and JSON in $OUT, warnings kept out of here.
run_check() {
    local name=$1 cap=$2 script=$3 prefix=${4:-} t
    t=$(time_for "$cap")
    if [ "$t" -lt 60 ]; then
        echo "=== $name: SKIPPED (${t}s of the budget left)"
        results+=("$name SKIPPED")
        status=1
        return
    fi
    echo "=== $name: up to ${t}s"
    local t0=$SECONDS
    PYTHONPATH=$prefix$PYTHONPATH timeout -k 15 "$t" "$python" "$script" --json "$out/$name.json" 2>&1 \
        | tee "$out/$name.log" | grep -v -i -E 'warning|deprecat|^\s*$|tp_group = |return cls\('
    local rc=${PIPESTATUS[0]} verdict
    case $rc in
        0) verdict=PASS ;;
        124|137) verdict="TIMEOUT after ${t}s" ;;
        *) verdict="FAIL (exit $rc)" ;;
    esac
    echo "=== $name: $verdict in $((SECONDS - t0)) s"
    results+=("$name $verdict")
    [ "$rc" = 0 ] || status=1
}

main() {
    setup || return 2
    [ "$setup_only" = 1 ] && { echo "setup only: no check run"; return 0; }
    status=0
    results=()
    if [ -f benchmarks/gpu/check_hf.py ]; then
        run_check check_hf "${HF_TIMEOUT:-300}" benchmarks/gpu/check_hf.py
    else
        echo "=== check_hf: MISSING (benchmarks/gpu/check_hf.py, issue 42 item 1, is absent): not run"
        results+=("check_hf MISSING")
    fi
    local version
    for version in ${MCORE_VERSIONS:-0.16.1}; do
        if ! ls "$carry/mcore-$version"/*.whl >/dev/null 2>&1; then
            echo "=== check_megatron-$version: no megatron-core $version wheel under $carry"
            results+=("check_megatron-$version NO-WHEEL")
            status=1
            continue
        fi
        install "/tmp/carry-mcore-$version" "$carry/mcore-$version"/*.whl \
            || { results+=("check_megatron-$version INSTALL-FAILED"); status=1; continue; }
        run_check "check_megatron-$version" "${MEGATRON_TIMEOUT:-280}" benchmarks/gpu/check_megatron.py \
            "/tmp/carry-mcore-$version:"
    done
    echo "=== summary after $SECONDS s of ${budget}s"
    printf '  %s\n' "${results[@]}"
    return $status
}

mkdir -p "$out"
main 2>&1 | tee "$out/run_all.log"
exit "${PIPESTATUS[0]}"
