"""The package's rooms and what each may import (Ray Train's import-layering test, for raytrain).

raytrain/ is laid out by role: a folder is a layer, and a layer imports only what lies below it.
The torch-free layers (what `raytrain validate`, the run directory and the driver run) import no
torch at module level, directly or through another raytrain module; worker code never imports the
driver or validate. Read from the code's own imports (no module is run), then checked once for real
in a fresh interpreter, where a third-party import that pulls torch in would show too."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "raytrain"
LEAVES = {
    "errors",
    "private_apis",
    "demo_assets",
    "demo_agents",
    "allocator",
}  # import nothing of raytrain at module level
ENTRY_POINTS = {"__init__", "__main__", "cli"}
# Each room and the rooms below it that it may import (at module level or inside a function).
BELOW = {
    "job": set(),
    "rundir": {"job"},
    "model": {"job"},
    "tracking": {"job", "rundir"},
    "data": {"job", "rundir", "model"},
    "validate": {"job", "rundir", "model", "data", "tracking"},
    "deploy": {"job", "rundir", "model", "validate"},
    "strategies": {"job", "rundir", "model", "data"},
    "rl": {"job", "rundir", "model", "data"},
    "objectives": {"job", "rundir", "model", "data", "rl", "strategies"},
    "train": {"job", "rundir", "model", "data", "tracking", "strategies", "objectives", "rl"},
    "driver": {"job", "rundir", "model", "data", "tracking", "train"},
}
# The doors from the driver into the workers' code, torch-free: the train function (it imports the
# worker inside), the process group's setup and the workers' launcher (their py_executable).
DRIVER_INTO_TRAIN = {"raytrain.train.entry", "raytrain.train.process_group", "raytrain.train.worker_launch"}
# What runs without torch: validate, the run directory, the driver (and all they import).
TORCH_FREE = (
    "raytrain.job",
    "raytrain.rundir",
    "raytrain.tracking",
    "raytrain.validate",
    "raytrain.deploy",
    "raytrain.driver",
    "raytrain.cli",
    "raytrain.model.hub",
    "raytrain.model.facts",
    "raytrain.model.targets",
    "raytrain.model.chat_templates",
    "raytrain.train.entry",
    "raytrain.train.forkserver",
    "raytrain.train.worker_launch",
    "raytrain.train.preemption",
    "raytrain.train.process_group",
)
HEAVY = ("torch", "transformers", "peft", "deepspeed", "torchao", "vllm", "liger_kernel")


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(imported module, at module level) for every import in the file; `from a import b` names a.b
    where that is a module."""
    found = []

    def visit(nodes, top: bool) -> None:
        for node in nodes:
            if isinstance(node, ast.Import):
                found.extend((a.name, top) for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for a in node.names:
                    full = f"{node.module}.{a.name}"
                    found.append((full if full in MODULES else node.module, top))
            if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
                continue  # annotations only
            for field in ("body", "orelse", "finalbody", "handlers"):
                sub = getattr(node, field, None)
                if isinstance(sub, list):
                    deeper = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                    visit(sub, top and not deeper)

    visit(ast.parse(path.read_text()).body, True)
    return found


def room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_each_room_imports_only_what_lies_below_it():
    wrong = []
    for module, path in MODULES.items():
        here = room(module)
        for target, _ in _imports(path):
            if not target.startswith("raytrain.") or room(target) in (here, *LEAVES):
                continue
            there = room(target)
            if here in ENTRY_POINTS:
                continue  # the command line reaches every room
            if here in LEAVES:
                wrong.append(f"{module} -> {target}: a leaf imports nothing of raytrain")
            elif here == "driver" and there == "train" and target not in DRIVER_INTO_TRAIN:
                wrong.append(f"{module} -> {target}: the driver enters the workers' code by train/entry.py only")
            elif there not in BELOW.get(here, set()):
                wrong.append(
                    f"{module} -> {target}: {here}/ may import {sorted(BELOW.get(here, set()))} and the leaves"
                )
    assert not wrong, "imports against the layering:\n" + "\n".join(sorted(wrong))


def test_worker_code_never_imports_the_driver_or_validate():
    worker_rooms = {"train", "strategies", "objectives", "model", "rl", "data"}
    wrong = [
        f"{m} -> {t}"
        for m, p in MODULES.items()
        if room(m) in worker_rooms
        for t, _ in _imports(p)
        if t.startswith("raytrain.") and room(t) in ("driver", "validate", "deploy", "cli")
    ]
    assert not wrong, wrong


def _module_level_closure(start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        module = todo.pop()
        if module in seen or module not in MODULES:
            continue
        seen.add(module)
        for target, top in _imports(MODULES[module]):
            if top and target.startswith("raytrain"):
                parts = target.split(".")
                todo += [".".join(parts[:i]) for i in range(2, len(parts) + 1)]  # a package's __init__ runs too
    return seen


def test_the_torch_free_rooms_import_no_torch_at_module_level():
    torch_free = [m for m in MODULES if m.startswith(TORCH_FREE)]
    assert len(torch_free) > 30, torch_free  # the rooms are there
    wrong = []
    for module in torch_free:
        for dep in sorted(_module_level_closure(module)):
            heavy = [t for t, top in _imports(MODULES[dep]) if top and t.split(".")[0] in HEAVY]
            if heavy:
                wrong.append(f"{module} imports {dep}, which imports {heavy} at module level")
    assert not wrong, "\n".join(wrong)
    # And for real, third-party imports included (`ray.train.torch` imports torch, for one).
    code = (
        "import importlib, sys\n"
        f"for m in {sorted(torch_free)!r}: importlib.import_module(m)\n"
        f"print(sorted(p for p in {HEAVY!r} if p in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_the_package_keeps_few_flat_modules_beside_its_rooms():
    flat = sorted(p.stem for p in PACKAGE.glob("*.py"))
    assert set(flat) <= ENTRY_POINTS | LEAVES and len(flat) <= 8, flat
    rooms = sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists())
    assert set(rooms) == set(BELOW), rooms  # every room is in the table above, and every row is a room
    for leaf in LEAVES:
        assert not [t for t, top in _imports(MODULES[f"raytrain.{leaf}"]) if top and t.startswith("raytrain")], leaf


def test_the_code_is_formatted_and_linted():
    # pyproject.toml's [tool.ruff]: 120 columns, pyflakes, import order; `ruff format` is the layout.
    root = PACKAGE.parent
    ruff = [sys.executable, "-m", "ruff"]
    lint = subprocess.run(
        [*ruff, "check", "--no-cache", "raytrain", "tests", "benchmarks"], capture_output=True, text=True, cwd=root
    )
    assert lint.returncode == 0, lint.stdout + lint.stderr
    layout = subprocess.run(
        [*ruff, "format", "--check", "--no-cache", "raytrain", "tests", "benchmarks"],
        capture_output=True,
        text=True,
        cwd=root,
    )
    assert layout.returncode == 0, "run `.venv/bin/ruff format`:\n" + layout.stdout + layout.stderr


def test_a_worker_imports_only_what_its_job_runs():
    # An fsdp2 LoRA worker's code path, as far as imports go: no DeepSpeed (zero3's), no vLLM (the
    # engine runs in its own environment), no MLflow server side, no Ray Data (the token store is read
    # directly), no TRL (a test reference only).
    code = (
        "import sys\n"
        "import raytrain.train.worker, raytrain.strategies.fsdp2, raytrain.objectives, raytrain.model.modeling\n"
        "import raytrain.tracking.step_metrics, mlflow.tracking, transformers.modeling_utils, peft\n"
        "print(sorted(m for m in ('deepspeed', 'vllm', 'mlflow.server', 'flask', 'sqlalchemy', 'alembic', 'ray.data',"
        " 'trl') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout + out.stderr
