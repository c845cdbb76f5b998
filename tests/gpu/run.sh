#!/usr/bin/env bash
# The GPU suite and the GPU benchmark on a bare GPU machine, in one command:
#
#   bash tests/gpu/run.sh            # install, then pytest -m gpu tests/gpu, then python -m benchmarks.gpu
#   bash tests/gpu/run.sh tests [pytest args]    # only the suite
#   bash tests/gpu/run.sh bench [benchmark args] # only the benchmark
#
# The machine needs Python 3.12 with torch (CUDA), transformers, peft, pyarrow, safetensors,
# accelerate and pytest, and the wheels tests/gpu/wheels.sh put in .gpu-wheels/ (pydantic and
# DeepSpeed, carried from a machine with PyPI). No network is used: wheels install with --no-index
# --no-deps, the project with --no-build-isolation, Hugging Face runs offline.
#
# Everything goes into .gpu-venv/, a venv over the machine's own packages (torch & co. as they
# are; nothing of the system's is changed), or into .gpu-site/ on PYTHONPATH where python3 is itself
# a venv's (the GPU image's is). PYTHON picks the interpreter (default python3).
set -euo pipefail
cd "$(dirname "$0")/../.."
what=${1:-all}
if [ $# -gt 0 ]; then shift; fi
case $what in tests | bench) ;; all) [ $# -eq 0 ] || { echo "run.sh: arguments go with 'tests' or 'bench'" >&2; exit 2; } ;;
  *) echo "usage: bash tests/gpu/run.sh [tests|bench|all] [pytest or benchmark args]" >&2; exit 2 ;; esac
PYTHON=${PYTHON:-python3}
WHEELS=${GPU_WHEELS:-.gpu-wheels}
VENV=.gpu-venv
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 PYTHONUNBUFFERED=1

target=()  # pip's --target when there is no venv module
# A venv over an interpreter that is itself a venv's (the GPU image's python3 is /opt/torch/.venv's)
# would not see that venv's packages (--system-site-packages means the base interpreter's): use
# .gpu-site/ on PYTHONPATH there instead.
in_venv=$("$PYTHON" -c 'import sys; print(int(sys.prefix != sys.base_prefix))')
if [ "$in_venv" = 0 ] && { [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv --system-site-packages --without-pip "$VENV"; }; then
  PY=$VENV/bin/python
else
  echo "run.sh: $PYTHON is a venv's or could not make one; installing into .gpu-site/ on PYTHONPATH instead" >&2
  PY=$PYTHON
  target=(--target .gpu-site --upgrade)
  export PYTHONPATH=$PWD/.gpu-site${PYTHONPATH:+:$PYTHONPATH}
fi

wheels=("$WHEELS"/*.whl)
if [ ! -e "${wheels[0]}" ]; then
  echo "run.sh: no wheels in $WHEELS/ (run tests/gpu/wheels.sh where PyPI is reachable, and carry the folder);" \
       "going on with what this machine has" >&2
  wheels=()
fi
if "$PY" -m pip --version >/dev/null 2>&1; then
  pip_install() { "$PY" -m pip install --quiet --disable-pip-version-check --no-index --no-deps "$@"; }
  if [ ${#wheels[@]} -gt 0 ]; then pip_install ${target[@]+"${target[@]}"} "${wheels[@]}"; fi
  if [ ${#target[@]} -gt 0 ] || ! pip_install --no-build-isolation -e .; then
    echo "run.sh: using the checkout through PYTHONPATH (no editable install)" >&2
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
  fi
else  # no pip at all: a wheel is a zip; unpack each into .gpu-site/
  echo "run.sh: no pip here; unpacking the wheels into .gpu-site/, the checkout through PYTHONPATH" >&2
  "$PY" - ${wheels[@]+"${wheels[@]}"} <<'PY'
import sys, zipfile
for wheel in sys.argv[1:]:
    zipfile.ZipFile(wheel).extractall(".gpu-site")
PY
  export PYTHONPATH=$PWD/.gpu-site:$PWD${PYTHONPATH:+:$PYTHONPATH}
fi

"$PY" - <<'PY'
import importlib, torch
found = {}
for name in ("transformers", "peft", "pydantic", "deepspeed", "ray"):
    try:
        found[name] = importlib.import_module(name).__version__
    except Exception as exc:
        found[name] = f"not importable ({type(exc).__name__})"
gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
print(f"run.sh: torch {torch.__version__} (CUDA {torch.version.cuda}), GPUs {gpus or 'none'}, "
      + ", ".join(f"{k} {v}" for k, v in found.items()), flush=True)
PY

status=0
if [ "$what" != bench ]; then
  "$PY" -m pytest -m gpu tests/gpu "$@" || status=$?
fi
if [ "$what" != tests ]; then
  "$PY" -m benchmarks.gpu "$@" || status=$?
fi
exit $status
