"""What the image installs is what the tests ran: k8s/constraints.txt pins every distribution
the package needs at run time (its dependencies and theirs, exactly), pip resolves it to
exactly itself, the Dockerfile, the cloud configs and the README's setup (so CI's fresh venv
too) install through it, and every module the
package imports comes from a declared dependency (the package imports with nothing else there).

Regenerate the constraints after changing a dependency or the venv:
    .venv/bin/python tests/test_supply_chain.py > k8s/constraints.txt
"""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
CONSTRAINTS = REPO / "k8s" / "constraints.txt"


def runtime_closure() -> dict[str, str]:
    """{distribution: installed version} of raytrain's run-time requirements, transitively,
    with markers evaluated here and extras followed where a requirement asks for them."""
    found: dict[str, str] = {}
    queue = [(Requirement(r), "") for r in metadata.requires("raytrain") or []]
    while queue:
        req, parent_extra = queue.pop()
        if req.marker and not req.marker.evaluate({"extra": parent_extra}):
            continue
        name = canonicalize_name(req.name)
        dist = metadata.distribution(name)  # not installed: PackageNotFoundError names it
        version = dist.version.split("+")[0]  # 2.13.0+cpu here is torch==2.13.0 (PyPI's CUDA build) in the image
        extras = tuple(sorted(req.extras))
        if (name, extras) in found.get("__seen__", set()):
            continue
        found.setdefault("__seen__", set()).add((name, extras))
        found[name] = version
        for extra in ("", *extras):
            queue += [(Requirement(r), extra) for r in dist.requires or []]
    found.pop("__seen__")
    return found


def pinned() -> dict[str, str]:
    lines = [line.split("#")[0].strip() for line in CONSTRAINTS.read_text().splitlines()]
    return {canonicalize_name(n): v for n, v in (line.split("==") for line in lines if line)}


def test_constraints_pin_the_whole_runtime_closure_at_the_tested_versions():
    closure = runtime_closure()
    assert {"boto3", "torch", "ray", "deepspeed", "mlflow"} <= closure.keys()  # boto3: declared, not a test extra's
    constraints = pinned()
    assert constraints.keys() - closure.keys() == set(), "pinned but no longer needed"
    assert closure.keys() - constraints.keys() == set(), "needed but not pinned: regenerate k8s/constraints.txt"
    assert {n: v for n, v in closure.items() if constraints[n] != v} == {}, "the venv and the image would differ"


def test_the_image_the_cloud_nodes_and_the_dev_venv_install_through_the_constraints():
    dockerfile = (REPO / "k8s" / "Dockerfile").read_text()
    installs = [line for line in dockerfile.splitlines() if "pip install" in line]
    # vLLM's own environment (engine: vllm) is the one install outside them, on purpose: its pins are vLLM's
    ours = [line for line in installs if "vllm-env/bin/pip" not in line]
    assert len(ours) == len(installs) - 1 and all("-c " in line and "constraints.txt" in line for line in ours), (
        installs
    )
    for cloud in ("aws", "gcp"):
        setup = [
            line for line in (REPO / "cluster" / f"{cloud}.yaml").read_text().splitlines() if "pip install" in line
        ]
        assert setup and all(
            line.count("pip install") == line.count("-c ~/raytrain/k8s/constraints.txt") for line in setup
        )
    # RAYTRAIN_VLLM_PYTHON only where vLLM was built: Docker's ${VAR:+word} is empty when VLLM_VERSION is (a
    # worker of an engine: vllm job then says the variable names no Python, rl/engine_process.require_python).
    built = next(line for line in dockerfile.splitlines() if "vllm-env/bin/pip install" in line)
    env = [line for line in dockerfile.splitlines() if line.startswith("ENV RAYTRAIN_VLLM_PYTHON")]
    assert env == ["ENV RAYTRAIN_VLLM_PYTHON=${VLLM_VERSION:+/home/ray/vllm-env/bin/python}"], env
    assert "/home/ray/vllm-env/bin/pip" in built and 'if [ -n "$VLLM_VERSION" ]' in dockerfile
    # The README's command 1 (and so CI's fresh venv): the package with its dev extra, through the file,
    # so the versions the tests run are the pinned ones, whatever the registry released since.
    local = (REPO / "cluster" / "setup-local.sh").read_text()
    assert 'pip_install -e ".[dev]" -c k8s/constraints.txt' in local.splitlines()


# A fresh interpreter without site-packages (-S), whose path holds the standard library,
# this checkout and links to the declared closure's own files only: an undeclared package is
# absent there as it would be from an image built without it.
IMPORT_ALL = r"""
import importlib, json, os, pkgutil
import raytrain
failed = {}
for module in pkgutil.walk_packages(raytrain.__path__, "raytrain."):
    if module.name.endswith("__main__"):
        continue  # runs the CLI
    try:
        importlib.import_module(module.name)
    except Exception as exc:
        failed[module.name] = f"{type(exc).__name__}: {exc}"
print(json.dumps(failed), flush=True)
os._exit(0)  # no interpreter teardown: some extension modules crash in it
"""


def test_the_package_imports_with_only_its_declared_dependencies(tmp_path):
    import json
    import os

    for name in runtime_closure():
        dist = metadata.distribution(name)
        for top in {f.parts[0] for f in dist.files or [] if f.parts and f.parts[0] not in ("..", "__pycache__")}:
            source = Path(dist.locate_file(top))
            if source.exists() and not (tmp_path / top).exists():
                (tmp_path / top).symlink_to(source)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=f"{REPO}{os.pathsep}{tmp_path}", PYTHONNOUSERSITE="1")
    out = subprocess.run(
        [sys.executable, "-S", "-c", IMPORT_ALL], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600
    )
    assert out.returncode == 0 and out.stdout.strip(), out.stderr[-3000:]
    failed = json.loads(out.stdout.strip().splitlines()[-1])
    assert failed == {}, failed  # a module that needs an undeclared package names it here


def test_the_constraints_resolve_to_exactly_themselves(tmp_path):
    """pip's resolver, from the package registry, as the image build runs it (a real install
    of the CUDA image cannot happen on this machine): every pin is satisfiable together, and
    nothing beyond them is installed."""
    import json

    report = tmp_path / "report.json"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--ignore-installed",
            "--quiet",
            "--disable-pip-version-check",
            "-c",
            str(CONSTRAINTS),
            "--report",
            str(report),
            str(REPO),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    resolved = {
        canonicalize_name(i["metadata"]["name"]): i["metadata"]["version"].split("+")[0]
        for i in json.loads(report.read_text())["install"]
    }
    assert resolved.pop("raytrain") and resolved == pinned()


if __name__ == "__main__":
    print("# Exact versions of everything raytrain needs at run time (its dependencies, transitively), as the")
    print("# test suite ran them: the image and the cloud nodes install through this file (pip -c).")
    print("# Regenerate: .venv/bin/python tests/test_supply_chain.py > k8s/constraints.txt")
    print("# torch is PyPI's build (CUDA on Linux); its nvidia-* wheels are pinned exactly by torch itself.")
    for name, version in sorted(runtime_closure().items()):
        print(f"{name}=={version}")
