#!/usr/bin/env bash
# Wheels the GPU machine needs for benchmarks/gpu/check_megatron.py, fetched here (it has no network).
#
# Planned for: Python 3.12 (cp312), x86_64, torch 2.11 already installed, no network; its image
# already has numpy, packaging, transformers (5.17), safetensors, tokenizers, einops, pluggy, typer,
# rich, pyyaml and attrs (/work/.library/device/KINDS.md). What it lacks:
#   megatron-core 0.19.2  the newest release; cp312 only (Requires-Python >= 3.12); needs torch >= 2.6,
#                         numpy, packaging >= 24.2 (all on the machine)
#   mbridge 0.15.1        pure Python, no hard requirements
#   cattrs 26.2.1         grpo-sdk's config structuring; needs attrs >= 25.4 and typing-extensions >= 4.14,
#   attrs 26.1.0, typing-extensions 4.15.0  carried too: the image's versions are not recorded
#   grpo-sdk              this working tree as a wheel (no dependencies): the registry finds the
#                         built-in backends through its entry points, which PYTHONPATH=src alone lacks
# Transformer Engine and Apex are not carried (CUDA builds, hundreds of MB): the check builds with
# Megatron-Core's local layer spec and no fused softmax instead.
#
# The wheels and the working tree travel together and must fit in 64 MiB; this prints both sizes.
#
#   bash benchmarks/gpu/megatron_wheels.sh [DIR]   # default DIR: .whl (must be git-ignored); wheels in DIR/megatron
#
# Layout: DIR/megatron/common/ (mbridge, cattrs, attrs, typing-extensions, grpo-sdk) and one
# DIR/megatron/mcore-VERSION/ per megatron-core version (MCORE_VERSIONS, default "0.16.1 0.19.2").
# Then on the GPU machine (device tool: carry [".whl"], timeout_s 600):
#   bash benchmarks/gpu/run_check_megatron.sh 0.16.1 0.19.2
set -euo pipefail

cd "$(git rev-parse --show-toplevel)"
dest=${1:-.whl}/megatron
if ! git check-ignore -q "$dest/x.whl"; then
    echo "megatron_wheels: $dest is not git-ignored; wheels must never be committed. Run" >&2
    echo "  echo /${dest%%/*}/ >> .git/info/exclude" >&2
    exit 2
fi
# 0.16.1: the version the policy is written and CI-tested against (Python 3.11 lane); it has a cp312
# wheel too. 0.19.2: the newest; needs mbridge's ModelType patch, which the policy applies (bridging.py).
versions=${MCORE_VERSIONS:-0.16.1 0.19.2}
python=${PYTHON:-python3}
rm -rf "$dest"
mkdir -p "$dest/common"

# pip matches each manylinux tag exactly: list the ones megatron-core's wheels carry and older ones.
download=(timeout 300 "$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12
          --implementation cp)
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
           manylinux2014_x86_64 manylinux1_x86_64; do
    download+=(--platform "$tag")
done
"${download[@]}" -d "$dest/common" mbridge==0.15.1 cattrs==26.2.1 attrs==26.1.0 typing-extensions==4.15.0
for version in $versions; do
    "${download[@]}" -d "$dest/mcore-$version" "megatron-core==$version"
done
# setuptools builds in ./build (git-ignored); removed again unless it was there before.
had_build=$([ -e build ] && echo 1 || echo 0)
timeout 300 "$python" -m pip wheel --quiet --no-deps --no-build-isolation -w "$dest/common" . >&2
[ "$had_build" = 1 ] || rm -rf build

echo "wheels in $dest:"
for whl in "$dest"/*/*.whl; do
    printf '  %8d KiB  %s\n' $(( $(stat -c %s "$whl") / 1024 )) "${whl#$dest/}"
    unzip -p "$whl" '*.dist-info/METADATA' | grep '^Requires-Dist' | grep -v 'extra ==' | sed 's/^/              /' || true
done
wheels=$(du -cb "$dest"/*/*.whl | tail -1 | cut -f1)
# What travels besides: tracked files plus untracked ones git does not ignore.
tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
limit=$((64 * 1024 * 1024))
printf 'wheels %.2f MiB + working tree %.2f MiB = %.2f MiB of the 64 MiB carry limit\n' \
    "$(echo "$wheels / 1048576" | bc -l)" "$(echo "$tree / 1048576" | bc -l)" "$(echo "($wheels + $tree) / 1048576" | bc -l)"
if [ $((wheels + tree)) -gt $limit ]; then
    echo "over the limit" >&2
    exit 1
fi
