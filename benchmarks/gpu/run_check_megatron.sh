#!/usr/bin/env bash
# On the GPU machine (no network): install the wheels benchmarks/gpu/megatron_wheels.sh prepared
# (carried as .whl) into a scratch target per megatron-core version and run check_megatron.py with
# each, one after the other. Logs and JSON go to $OUT (or /tmp/check-megatron) as
# check_megatron-VERSION.{log,json}. Exit status: the first non-zero one of the checks.
#
#   bash benchmarks/gpu/run_check_megatron.sh [VERSION...]     # default: 0.16.1
#
# Each check runs under `timeout ${CHECK_TIMEOUT:-280}` so that two fit in one 600 s device call.
set -uo pipefail

cd "$(dirname "$0")/../.."
wheels=${WHEELS:-.whl/megatron}
out=${OUT:-/tmp/check-megatron}
mkdir -p "$out"
python=${PYTHON:-python3}
[ $# -gt 0 ] || set -- 0.16.1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
"$python" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.cuda.is_available())' || exit 2
status=0
for version in "$@"; do
    site=/tmp/site-mcore-$version
    if ! ls "$wheels/mcore-$version"/*.whl >/dev/null 2>&1; then
        echo "no megatron-core $version wheel under $wheels (run benchmarks/gpu/megatron_wheels.sh first)"
        [ "$status" != 0 ] || status=2
        continue
    fi
    rm -rf "$site"
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
        "$wheels"/common/*.whl "$wheels/mcore-$version"/*.whl || { [ "$status" != 0 ] || status=2; continue; }
    echo "=== megatron-core $version"
    PYTHONPATH=$site timeout "${CHECK_TIMEOUT:-280}" "$python" benchmarks/gpu/check_megatron.py \
        --json "$out/check_megatron-$version.json" 2>&1 | tee "$out/check_megatron-$version.log" \
        | grep -v -i -E 'warning|deprecat|^\s*$|tp_group = |return cls\('
    rc=${PIPESTATUS[0]}
    echo "=== megatron-core $version: exit $rc"
    [ "$status" != 0 ] || status=$rc
done
exit "$status"
