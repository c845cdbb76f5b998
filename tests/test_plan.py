"""The run plan: the driver's decisions, one rule each, signed for its run directory."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import make_job

from raytrain.errors import JobError
from raytrain.job.plan import RunPlan
from raytrain.rundir.job_file import sign_plan, verify_plan


def test_the_plan_resolves_each_rule_once(assets, tmp_path):
    gpu = make_job(
        assets,
        tmp_path,
        scaling={"num_workers": 16, "use_gpu": True, "workers_per_node": 8},
        training={"finetune": "full", "global_batch_size": 36, "micro_batch_size": 2},
    )
    plan = RunPlan.of(gpu)
    assert plan.bf16 and plan.hsdp and plan.sync_every_micro_batch  # auto: bf16 and HSDP on GPU; full FSDP2 syncs
    assert plan.mesh_shape(16) == (2, 8) and plan.mesh_shape(8) == (8,)  # one node: a flat mesh
    assert plan.shard_degree(16) == 8 and plan.accumulation_steps(16) == 2 and plan.accumulation_steps(5) == 4
    cpu = RunPlan.of(make_job(assets, tmp_path, scaling={"num_workers": 4, "workers_per_node": 2}))
    assert not cpu.bf16 and not cpu.hsdp and cpu.mesh_shape(4) == (4,) and not cpu.sync_every_micro_batch  # LoRA
    zero3 = RunPlan.of(
        make_job(
            assets,
            tmp_path,
            training={"strategy": "zero3"},
            scaling={"num_workers": 4, "workers_per_node": 2, "use_gpu": True},
        )
    )
    assert not zero3.hsdp and zero3.shard_degree(4) == 4  # auto HSDP is FSDP2's


def test_workers_act_only_on_the_job_and_plan_the_driver_signed(assets, tmp_path):
    # The plan was signed, but the job beside it in the worker config (model.path,
    # trust_remote_code, ...) was not: a changed one was acted on. Now they are one document.
    spec = make_job(assets, tmp_path)
    stores = {"train": ["/data/a"], "weights": [1.0], "eval": None, "key": "k"}
    doc = sign_plan(RunPlan.of(spec, stores), spec)
    assert verify_plan(doc) == (spec, RunPlan.of(spec, stores))
    changed = [
        {**doc, "bf16": True},
        {**doc, "spec": {**doc["spec"], "model": {**doc["spec"]["model"], "path": "/elsewhere/model"}}},
        {**doc, "spec": {**doc["spec"], "model": {**doc["spec"]["model"], "trust_remote_code": True}}},
        {k: v for k, v in doc.items() if k != "spec"},
    ]
    for tampered in changed:
        with pytest.raises(JobError, match="refusing the run plan: its signature is wrong"):
            verify_plan(tampered)


def test_the_mesh_rule_places_sequence_and_tensor_ranks_and_resizes_only_data_parallel_ones(assets, tmp_path):
    spec = make_job(
        assets,
        tmp_path,
        scaling={
            "num_workers": 16,
            "use_gpu": True,
            "workers_per_node": 8,
            "sequence_parallel": 2,
            "tensor_parallel": 2,
        },
        training={"finetune": "full", "global_batch_size": 8, "micro_batch_size": 1},
    )
    plan = RunPlan.of(spec)
    mesh = plan.mesh(16)  # 2 nodes of 8: each node 2 dp ranks of one sp pair of tp pairs
    assert (mesh.replicate, mesh.shard, mesh.sp, mesh.tp, mesh.dp, mesh.gradient_ranks) == (2, 2, 2, 2, 4, 8)
    assert plan.mesh_shape(16) == (2, 4)  # FSDP2: replicate x (shard · sp); tp is the DTensors' own dimension
    assert plan.shard_degree(16) == 8 and plan.accumulation_steps(16) == 2  # 8 rows over dp 4, 1 a micro-batch
    # tp fastest, then sp: ranks 0-3 read dp slice 0 (sp parts 0, 0, 1, 1), ranks 4-7 slice 1
    assert [mesh.dp_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [mesh.sp_rank(r) for r in range(4)] == [0, 0, 1, 1]
    one_node = plan.mesh(8)  # elastic: a node fewer halves dp, sp and tp stay
    assert (one_node.replicate, one_node.shard, one_node.sp, one_node.tp) == (1, 2, 2, 2)
    with pytest.raises(ValueError, match="use a multiple of 4 workers"):
        plan.mesh(6)
    assert RunPlan.of(make_job(assets, tmp_path)).mesh(2) == type(mesh)(1, 2, 1, 1)  # the default: dp only


def test_model_parallel_limits_name_the_heads_and_the_fix():
    from raytrain.job.plan import model_parallel_problems

    llama = {"model_type": "llama", "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336}
    assert model_parallel_problems(llama, 8, 1) == [] and model_parallel_problems(llama, 4, 2) == []
    assert model_parallel_problems(llama, 16, 1) == []  # 8 KV heads over 16 ranks: each repeated twice
    [(field, value, text)] = model_parallel_problems(llama, 3, 1)
    assert field == "scaling.sequence_parallel" and "32 attention heads per tensor-parallel rank" in text
    qwen = {"model_type": "qwen2", "num_attention_heads": 28, "num_key_value_heads": 4, "intermediate_size": 18944}
    assert (
        "num_attention_heads=28 is not divisible by 8: each rank takes an equal part; use tensor_parallel 4"
        in model_parallel_problems(qwen, 1, 8)[0][2]
    )
    [(field, _, text)] = model_parallel_problems({**llama, "model_type": "gpt2"}, 1, 2)
    assert field == "scaling.tensor_parallel" and "not 'gpt2'" in text


def test_raytrain_modules_import_in_one_direction():
    """No import circle among raytrain's modules (module-level imports, the ones that run at import):
    a circle is a rule living in the wrong module (config -> deepspeed_config -> plan -> config was one,
    dodged with a function-level import)."""
    import ast

    root = Path(__file__).resolve().parents[1] / "raytrain"
    graph: dict[str, set[str]] = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        package = parts[:-1] if parts[-1] != "__init__" else parts[:-1]
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        edges = graph.setdefault(name, set())
        for node in ast.walk(ast.parse(path.read_text())):  # in functions too: a deferred import is still a circle
            if isinstance(node, ast.ImportFrom):
                base = package[: len(package) - node.level + 1] if node.level else []
                target = ".".join(base + (node.module.split(".") if node.module else []))
                if target.startswith("raytrain"):
                    edges.add(target)
                    edges.update(f"{target}.{a.name}" for a in node.names)  # `from . import x` names modules
            elif isinstance(node, ast.Import):
                edges.update(a.name for a in node.names if a.name.startswith("raytrain"))
    # A module's own packages are imported before it anyway (their __init__ importing it is no circle).
    graph = {m: {e for e in edges if e in graph and e != m and not m.startswith(e + ".")} for m, edges in graph.items()}

    def cycle_from(start, path, seen):
        for nxt in sorted(graph[path[-1]]):
            if nxt == start:
                return path + [start]
            if nxt not in seen:
                seen.add(nxt)
                found = cycle_from(start, path + [nxt], seen)
                if found:
                    return found
        return None

    cycles = [c for m in sorted(graph) if (c := cycle_from(m, [m], {m}))]
    assert not cycles, " -> ".join(cycles[0])


def test_each_objective_and_strategy_is_one_row_of_its_table(tmp_path):
    # The job's fields take exactly the tables' names, and the job's properties read their rows.
    from typing import get_args

    from raytrain.job import objectives, strategies
    from raytrain.job.training import TrainingSpec

    fields = TrainingSpec.model_fields
    assert set(get_args(fields["objective"].annotation)) == set(objectives.OBJECTIVES)
    assert set(get_args(fields["strategy"].annotation)) == set(strategies.STRATEGIES)
    want = {  # (row kind, sequences a row trains, stored, reference under full, score head)
        "sft": (False, 1, 1, False, False),
        "dpo": (True, 2, 2, True, False),
        "simpo": (True, 2, 2, False, False),
        "reward": ("reward", 2, 3, False, True),
        "kto": ("kto", 1, 3, True, False),
        "grpo": ("prompt", 4, 2, True, False),
    }
    for name, row in want.items():
        settings = {"num_generations": 4, "beta": 0.1, "max_completion_length": 8, "rewards": [{"builtin": "length"}]}
        grpo = {"grpo": settings} if name == "grpo" else {}
        data = {"format": "prompt"} if name == "grpo" else {}
        spec = make_job(
            Path("/nonexistent"), tmp_path, training={"objective": name, "finetune": "full", **grpo}, data=data
        )
        assert (spec.row_kind, spec.sequences_per_row, spec.stored_sequences, spec.reference_copy, spec.scores) == row


@pytest.mark.parametrize("workers,splits", [(2, True), (8, True), (64, False)])
def test_the_vocabulary_is_split_only_where_it_saves_memory(tmp_path, workers, splits):
    """The split table saves a rank the other ranks' rows, V·d·w·(1 − 1/N), and costs it every rank's
    gathered hidden states and their fp32 gradient, N·T·d·(c + 4): Llama-3-8B (V 128256, d 4096) in
    bf16 with 4k tokens a rank saves 0.49 GiB at N = 2 against 0.19 GiB, 0.86 against 0.75 at N = 8,
    and at N = 64 would hold 6 GiB of gathered states to save 0.98 GiB. The estimate counts them."""
    from conftest import KNOWN_CONFIGS

    from raytrain.job.plan import splits_vocabulary, vocabulary_split_bytes
    from raytrain.model.facts import ModelFacts, layout_from_config
    from raytrain.validate.memory import estimate

    config = KNOWN_CONFIGS["meta-llama/Llama-3.1-8B"]
    spec = make_job(
        Path("unused"),
        tmp_path,
        model={"path": "meta-llama/Llama-3.1-8B", "dtype": "bfloat16"},
        data={"seq_len": 4096},
        training={"micro_batch_size": 1, "global_batch_size": workers},
        scaling={"num_workers": workers, "use_gpu": True, "hsdp": False},
    )
    saved, cost = vocabulary_split_bytes(spec, workers, config)
    assert saved == 128256 * 4096 * 2 * (1 - 1 / workers) and cost == workers * 4096 * 4096 * (2 + 4)
    assert splits_vocabulary(spec, workers, config) is splits
    terms = {
        t.label: t
        for t in estimate(spec, ModelFacts(config, layout_from_config(config), "config", False), workers).device
    }
    gathered = next((t for label, t in terms.items() if label.startswith("every rank's hidden states gathered")), None)
    if splits:
        assert gathered is not None and gathered.bytes == cost, terms.keys()
        assert "frozen output layer split by rows over the ranks" in terms
    else:
        assert gathered is None and terms["frozen output layer whole on every rank"].bytes == saved


def test_every_rank_knows_the_most_rows_any_ranks_micro_batch_holds():
    """So the split vocabulary's collectives are sized on the host, without an all-gather read back."""
    import numpy as np

    from raytrain.data.batches import most_rows
    from raytrain.data.order import rank_slice

    for global_batch, dp, count in ((10, 4, 2), (7, 3, 3), (3, 4, 2), (64, 8, 4), (5, 2, 4)):
        slices = [rank_slice(global_batch, dp, r) for r in range(dp)]
        parts = [[len(p) or 1 for p in np.array_split(np.arange(b - a), count)] for a, b in slices]
        first, last = slices[0]
        assert most_rows(last - first, count) == [max(col) for col in zip(*parts)], (global_batch, dp, count)
