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
pip_install "torch==${TORCH_VERSION}"
# Through the constraints the image and cloud nodes install with: the versions the tests ran
# are the versions users get (a new release on the registry changes nothing until the file does).
pip_install -e ".[dev]" -c k8s/constraints.txt
.venv/bin/python - <<'PY'
import torch, ray, deepspeed, transformers, peft, mlflow  # noqa: F401  (fails loudly if the install is broken)
print(f"setup: ok (torch {torch.__version__}, cuda {torch.cuda.is_available()}, ray {ray.__version__}, "
      f"deepspeed {deepspeed.__version__}, transformers {transformers.__version__})")
PY
