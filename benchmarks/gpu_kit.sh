#!/usr/bin/env bash
# What a session lent a GPU carries to the device machine for benchmarks/gpu_check.py (benchmarks/README.md,
# "The GPU check"): the wheels of the packages lmiserve imports that the device's image lacks, or holds at
# another version than constraints.txt, fetched for the image's Python (3.12) into .gpu/whl, which git
# ignores (.git/info/exclude). It prints their size, the working tree's, and the one device command.
#
#   benchmarks/gpu_kit.sh                 # fetch the wheels (PyPI), check the sizes, print the command
#   STEPS=tests,step-profile BUDGET=200 benchmarks/gpu_kit.sh   # some steps, a smaller budget (a second call)
#   PYTHON_VERSION=3.11 DEST=/tmp/whl benchmarks/gpu_kit.sh   # the same wheels for this machine's Python
#                                                           # (a rehearsal of the install: benchmarks/README.md)
#
# The device's image (its package list: the device tool's KINDS.md) has torch, triton, numpy, numba,
# safetensors, accelerate, huggingface_hub, jinja2, pillow, httpx, grpcio, protobuf, prometheus-client, tqdm,
# pytest and pytest-xdist; not starlette, uvicorn, pydantic, gguf, llguidance, platformdirs nor
# pytest-asyncio nor jsonschema (the structured-output tests check outputs with it) nor compressed-tensors
# and loguru (the quantized tests' W4A16 checkpoints are written by the package), and transformers,
# tokenizers, pytest and peft (the LoRA graph tests make their adapters with it) at other versions (or
# unknown ones).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON_VERSION="${PYTHON_VERSION:-3.12}"
DEST="${DEST:-.gpu/whl}"
# the names, at the versions of this checkout's .venv (what `make test` tested: constraints.txt's pins)
PACKAGES=(
  transformers tokenizers
  starlette uvicorn
  pydantic pydantic-core annotated-types typing-inspection typing-extensions
  gguf llguidance platformdirs
  pytest pluggy iniconfig pytest-asyncio
  jsonschema jsonschema-specifications referencing rpds-py
  peft
  compressed-tensors loguru
)
LIMIT_MIB=64  # what one device call carries: the working tree and the carried paths together
PY="${VENV_PYTHON:-.venv/bin/python}"

if [ -d .git ] && ! grep -qxF '/.gpu/' .git/info/exclude 2>/dev/null; then
  mkdir -p .git/info && echo '/.gpu/' >>.git/info/exclude
fi

mapfile -t pins < <("$PY" - "${PACKAGES[@]}" <<'PYEOF'
import sys
from importlib import metadata

for name in sys.argv[1:]:
    print(f"{name}=={metadata.version(name)}")
PYEOF
)
if [ "${#pins[@]}" -ne "${#PACKAGES[@]}" ]; then
  echo "gpu_kit: $PY lacks some of: ${PACKAGES[*]} (run \`make test\` once to build .venv)" >&2
  exit 1
fi

# BUDGET=seconds: the check's budget (default 480: a first call, with the machine's start, in one call's
# 600 s; a second call on the still-warm machine has what the session's 900 s of device time leave)
budget=${BUDGET:-480}
check_limit=$(( budget + 45 ))  # the check writes its summary however it ends; then the copies
call_limit=$(( budget + 100 ))
if [ "$call_limit" -gt 600 ]; then
  echo "gpu_kit: BUDGET=$budget leaves no room in a device call's 600 s (at most 500)" >&2
  exit 1
fi

rm -rf "$DEST" && mkdir -p "$DEST"
tag="${PYTHON_VERSION/./}"
platforms=()  # pip matches a manylinux tag exactly: every glibc up to the image's (Ubuntu 24.04: 2.39)
for n in $(seq 39 -1 17); do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYTHON_VERSION" --implementation cp \
  --abi "cp$tag" --abi abi3 --abi none \
  "${platforms[@]}" --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any \
  -d "$DEST" "${pins[@]}"

wheels_mib=$(du -sm "$DEST" | cut -f1)
tree_mib=$(( ( $( (git ls-files -z; git ls-files -z --others --exclude-standard) | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1) + 1048575 ) / 1048576 ))
echo "gpu_kit: ${#pins[@]} wheels for Python $PYTHON_VERSION in $DEST: $wheels_mib MiB; the working tree: $tree_mib MiB"
if [ $(( wheels_mib + tree_mib )) -ge $LIMIT_MIB ]; then
  echo "gpu_kit: $(( wheels_mib + tree_mib )) MiB is more than the $LIMIT_MIB MiB a device call carries" >&2
  exit 1
fi
# STEPS=key,key,... picks gpu_check's steps (its --steps), for what an earlier check left unmeasured
steps=${STEPS:+ --steps $STEPS}
cat <<EOF
gpu_kit: the device command (run with carry [".gpu"], timeout_s $call_limit; plus a minute or two for a cold start):
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl && export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 || exit 1; timeout $check_limit python3 benchmarks/gpu_check.py --out /tmp/gc --budget $budget$steps; cp /tmp/gc/summary.md /tmp/gc/summary.json \$OUT/; tar czf \$OUT/gpu-check.tgz -C /tmp/gc --exclude='model-*' .
EOF
