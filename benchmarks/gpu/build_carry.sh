#!/usr/bin/env bash
# Builds benchmarks/gpu/carry/: the wheels the GPU machine needs to run grpo-sdk's GPU checks offline
# (issue 42 item 2, "the carry plan"). Run it where there is network; the folder is git-ignored and
# travels to the GPU machine through the device tool's `carry` (64 MiB together with the working tree).
#
# Planned for the device image (/work/.library/device/KINDS.md): Python 3.12 (cp312), x86_64, torch
# 2.11 with its CUDA libraries and numpy 2.5.2 installed, no network. The image has other versions of
# several of these (transformers 5.17, huggingface_hub 1.x), and lacks some (cattrs, megatron-core,
# mbridge, kernels, httpx2); the checks are meant to run with the versions CI tests, so grpo-sdk's
# whole runtime closure is carried, pinned to the main venv's versions (Python 3.11 here; the same
# releases have cp312, abi3 or pure-Python wheels), and run_all.sh installs it into a scratch --target
# that shadows the image's copies. Never carried: torch and what only torch needs, triton, nvidia-*
# and anything else holding CUDA libraries (the script fails if one appears), and numpy (below).
# The list was found with pip's resolver against a torch stub with no requirements (grpo-sdk + peft +
# megatron-core + mbridge, constrained to the main venv's freeze); benchmarks/gpu/test_carry.sh checks
# it is complete (pip check in a fresh Python 3.12 venv, installed with no index).
#
#   bash benchmarks/gpu/build_carry.sh   # env: MCORE_VERSIONS (default "0.16.1 0.19.2"), WITH_TRL
#                                        #      (default 1), PYTHON, CARRY_DIR (default benchmarks/gpu/carry)
#
# Layout (the same as benchmarks/gpu/megatron_wheels.sh's, so run_check_megatron.sh reads it too):
#   carry/common/           grpo-sdk (this working tree, uncommitted changes included, as a wheel),
#                           its runtime closure, peft, accelerate, mbridge
#   carry/mcore-VERSION/    one megatron-core wheel per version (0.16.1: CI's; 0.19.2: the newest)
#   carry/trl/              trl, datasets, dill, multiprocess (WITH_TRL=0: none)
#   carry/pyproject.sha256  run_all.sh warns when pyproject.toml (the entry points) changed since
#
# Then on the GPU machine, one device call (carry ["benchmarks/gpu/carry"], timeout_s 600):
#   bash benchmarks/gpu/run_all.sh
# (benchmarks/gpu/README.md says what it runs and writes).
set -euo pipefail

cd "$(git rev-parse --show-toplevel)"
dest=${CARRY_DIR:-benchmarks/gpu/carry}
# Inside the repo the folder must be git-ignored: its wheels must never be committed.
if [[ "$(realpath -m "$dest")" == "$PWD"/* ]] && ! git check-ignore -q "$dest/common/x.whl"; then
    echo "build_carry: $dest is not git-ignored; wheels must never be committed (.gitignore lists it)" >&2
    exit 2
fi
python=${PYTHON:-python3}
versions=${MCORE_VERSIONS:-0.16.1 0.19.2}

# grpo-sdk's dependencies (pyproject.toml) with the extras the checks use (lora: peft; megatron:
# mbridge; accelerate comes with peft) and everything they need, minus torch's own needs and numpy:
# the image has numpy 2.5.2 (all of these need >=1.17), and carrying 2.4.6 would cost 16 of the 64 MiB
# that check_hf.py's additions need. test_carry.sh stands the image's numpy in with its own download.
COMMON=(
    attrs==26.1.0 cattrs==26.2.1 pluggy==1.7.0 typer==0.29.2 rich==15.0.0 pyyaml==6.0.4 packaging==26.4
    safetensors==0.8.0 transformers==5.25.0 tokenizers==0.23.3 huggingface-hub==2.4.0 peft==0.21.2
    accelerate==1.16.0 mbridge==0.15.1
    # transformers / huggingface_hub / kernels
    regex==2026.12.2 tqdm==4.70.1 kernels==0.19.1 tomlkit==0.15.3 hf-xet==1.8.0
    httpx2==2.17.0 httpcore2==2.17.0 h11==0.16.0 anyio==4.16.0 idna==3.21 truststore==0.10.5
    click==8.5.1 filelock==4.3.2 fsspec==2026.9.0 typing-extensions==4.16.0
    # typer / rich
    pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
    shellingham==1.5.4 annotated-doc==0.0.7 markdown-it-py==4.3.0 mdurl==0.1.2 pygments==2.21.0
    # peft / accelerate
    psutil==7.2.2
)
# TRL's GRPOTrainer, for check_hf.py's side-by-side figures (issue 42 item 1: "if TRL can travel"):
# 1.8 MiB with datasets, dill and multiprocess. What else they need is on the image (pyarrow, pandas,
# xxhash, jinja2), but datasets 5.2 needs pyarrow >= 24 and the image's version is not recorded:
# run_all.sh reports whether trl imports there, and fails nothing when it does not. WITH_TRL=0 leaves
# it out. The trl version is not the main venv's (it has none): the newest at the time of writing.
TRL=(trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19)

# Only what this script writes: CARRY_DIR may name a folder that holds other things.
rm -rf "$dest/common" "$dest"/mcore-* "$dest/trl" "$dest/pyproject.sha256"
mkdir -p "$dest/common"
# pip matches each manylinux tag exactly: name the ones these wheels carry and older ones.
download=(nice -n 19 timeout 300 "$python" -m pip download --quiet --no-deps --only-binary=:all:
          --python-version 3.12 --implementation cp)
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
           manylinux2014_x86_64 manylinux_2_12_x86_64 manylinux2010_x86_64 manylinux1_x86_64; do
    download+=(--platform "$tag")
done
"${download[@]}" -d "$dest/common" "${COMMON[@]}"
[ "${WITH_TRL:-1}" = 0 ] || "${download[@]}" -d "$dest/trl" "${TRL[@]}"
for version in $versions; do
    "${download[@]}" -d "$dest/mcore-$version" "megatron-core==$version"
done
# setuptools builds in ./build (git-ignored); removed again unless it was there before.
had_build=$([ -e build ] && echo 1 || echo 0)
nice -n 19 timeout 300 "$python" -m pip wheel --quiet --no-deps -w "$dest/common" . >&2
[ "$had_build" = 1 ] || rm -rf build
sha256sum pyproject.toml > "$dest/pyproject.sha256"

# Nothing that brings its own torch or CUDA: the GPU machine's torch must stay the one in use.
bad=$(find "$dest" -name '*.whl' | grep -i -E '/(torch|triton|nvidia_|cuda_|cupy|jax)[^/]*\.whl$' || true)
if [ -n "$bad" ]; then
    echo "build_carry: these must not be carried (the GPU machine has its own torch/CUDA):" >&2
    echo "$bad" >&2
    exit 1
fi
count=$(find "$dest/common" -name '*.whl' | wc -l)
if [ "$count" -ne $(( ${#COMMON[@]} + 1 )) ]; then
    echo "build_carry: expected $(( ${#COMMON[@]} + 1 )) wheels in $dest/common, found $count" >&2
    exit 1
fi

echo "wheels in $dest:"
for whl in "$dest"/*/*.whl; do
    printf '  %8d KiB  %s\n' $(( $(stat -c %s "$whl") / 1024 )) "${whl#$dest/}"
done
wheels=$(du -cb "$dest"/*/*.whl | tail -1 | cut -f1)
# What travels besides: tracked files plus untracked ones git does not ignore.
tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c %s 2>/dev/null \
       | awk '{s += $1} END {print s + 0}')
limit=$((64 * 1024 * 1024))
awk -v w="$wheels" -v t="$tree" 'BEGIN {printf "carry %.2f MiB + working tree %.2f MiB = %.2f MiB of the 64 MiB limit\n",
    w / 1048576, t / 1048576, (w + t) / 1048576}'
if [ $((wheels + tree)) -gt $limit ]; then
    echo "build_carry: OVER the 64 MiB limit: the device tool would refuse this call" >&2
    exit 1
fi
cat <<EOT

On the GPU machine (device tool: run, carry ["$dest"], timeout_s 600):
  bash benchmarks/gpu/run_all.sh
Test here, offline, in a fresh Python 3.12 venv (no torch): bash benchmarks/gpu/test_carry.sh
EOT
