#!/usr/bin/env bash
# Fill .gpu-wheels/ (git-ignored) with what a bare GPU machine lacks to run tests/gpu and
# benchmarks/gpu.py: that machine has Python 3.12, torch (CUDA), transformers, peft, pyarrow,
# safetensors, accelerate and pytest (and their own dependencies), no network, and no Ray, MLflow,
# pydantic or DeepSpeed. Run it here (a machine with PyPI and .venv), then carry the folder:
# tests/gpu/run.sh installs it there with `pip install --no-deps`.
#
#   pydantic, pydantic-core, annotated-types, typing-inspection, typing-extensions
#                       raytrain.config (the JobSpec); typing-extensions at pydantic's floor
#   deepspeed           zero3 (built here as a pure-Python wheel: its ops compile at first use)
#   torchao             training.finetune: qlora (its NF4Tensor)
#   hjson, py-cpuinfo, msgpack, einops, ninja
#                       DeepSpeed's own dependencies
#   liger-kernel        its fused linear cross-entropy (kernels.fused_loss), at LIGER below: the
#                       GPU image has triton with torch; nothing here installs it (it needs a GPU)
#   trl, datasets, dill, multiprocess
#                       benchmarks/gpu_trl.py: TRL's SFTTrainer, the side-by-side arm (the image has
#                       accelerate, pandas, xxhash, fsspec and the rest of what they need)
#
# Each at the version .venv has (the versions the tests ran). Binary wheels are cp312
# manylinux2014 x86_64 (GPU_PYTHON_VERSION=3.11 for another Python; GPU_WHEELS=DIR for another
# folder). The total must stay under 50 MiB (64 MiB can be carried in all).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
OUT=${GPU_WHEELS:-.gpu-wheels}
PYV=${GPU_PYTHON_VERSION:-3.12}  # the GPU machine's Python
LIMIT_MIB=50
LIGER=0.8.5  # liger-kernel's version (py3-none-any)
BINARY=(pydantic pydantic-core annotated-types typing-inspection typing-extensions hjson py-cpuinfo msgpack einops ninja
        trl datasets dill multiprocess)  # pure-Python ones (py3-none-any, py312-none-any) match these tags too

quiet() { "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }; }  # this image's local index, noise
version() { "$PY" -c 'import importlib.metadata as m, sys; print(m.version(sys.argv[1]))' "$1"; }

rm -rf "$OUT"
mkdir -p "$OUT"
specs=()
for name in "${BINARY[@]}"; do specs+=("$name==$(version "$name")"); done
quiet "$PY" -m pip download --quiet --disable-pip-version-check --dest "$OUT" --no-deps --only-binary=:all: \
  --python-version "$PYV" --implementation cp --abi "cp${PYV/./}" --platform manylinux2014_x86_64 "${specs[@]}"
# torchao (training.finetune: qlora): one abi3 wheel for every CPython >= 3.10, manylinux_2_24/2_28.
quiet "$PY" -m pip download --quiet --disable-pip-version-check --dest "$OUT" --no-deps --only-binary=:all: \
  --python-version "$PYV" --implementation cp --abi abi3 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_24_x86_64 "torchao==$(version torchao)"
quiet "$PY" -m pip download --quiet --disable-pip-version-check --dest "$OUT" --no-deps --only-binary=:all: \
  "liger-kernel==$LIGER"
# DeepSpeed publishes a source distribution only: build it here, with no op compiled ahead
# (DS_BUILD_OPS=0): a py3-none-any wheel that runs on any torch/CUDA and JIT-builds an op if one is used.
DS_BUILD_OPS=0 quiet "$PY" -m pip wheel --quiet --disable-pip-version-check --no-deps --no-build-isolation \
  --wheel-dir "$OUT" "deepspeed==$(version deepspeed)"

ls -1 "$OUT"
count=$(ls "$OUT"/*.whl | wc -l)
if [ "$count" -ne $(( ${#BINARY[@]} + 3 )) ]; then
  echo "wheels.sh: expected $(( ${#BINARY[@]} + 3 )) wheels, got $count" >&2
  exit 1
fi
bytes=$(cat "$OUT"/*.whl | wc -c)
echo "wheels.sh: $count wheels, $(( bytes / 1024 )) KiB in $OUT (limit ${LIMIT_MIB} MiB)"
if [ "$bytes" -ge $(( LIMIT_MIB * 1024 * 1024 )) ]; then
  echo "wheels.sh: over ${LIMIT_MIB} MiB: too much to carry to the GPU machine" >&2
  exit 1
fi
