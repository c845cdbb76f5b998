"""Train the same rows under several meshes inside one process group, for the sequence- and
tensor-parallel parity tests: each case builds the product's strategy (`build_strategy`) from a
job whose `scaling` names the mesh, and takes a few optimizer steps (`loop.train_step`) on one
fixed global batch, each rank reading its data-parallel slice as `GlobalBatches` cuts it. Runs
in Ray Train workers (tests/test_mesh.py) and under `python tests/mesh_cases.py` for debugging.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu"))
import local_run  # noqa: E402  (tests/gpu: the in-process harness the GPU suite shares)

from raytrain.data.pairs import margin_tag  # noqa: E402

SEQ = 64


def global_rows(
    pairs: bool, packed: bool, rows: int, seed: int = 0, seq: int = SEQ, kto: bool = False, margins: bool = False
) -> np.ndarray:
    """[rows, planes, SEQ] int32 as the token store gives them: ids, labels, positions (a pair row:
    chosen then rejected, and with `margins` (a reward model's rows) its margin tag, a margin drawn
    from [-1, 2); a KTO row: its example, its KL sequence and a one-token label tag, every other row
    desirable). Packed: one to three documents of ragged length per sequence, each its
    own positions, the first often continuing a document from the row before (its positions start
    past 0); else one document and right padding, whose positions continue the document's (the
    store's rule: padding is never a document). A prompt is unlabelled."""
    g = np.random.default_rng(seed)
    SEQ = seq  # noqa: N806
    out = []
    for _ in range(rows):
        planes = []
        for _ in range(2 if pairs else 1):
            ids = g.integers(3, 380, SEQ)
            labels = ids.copy()
            if packed:
                # 1, 2 or 3 documents: one is unpacked, two is the fewest a mask must isolate
                cuts = sorted(g.choice(np.arange(8, SEQ - 8), int(g.integers(0, 3)), replace=False))
                starts = [0, *cuts]
                pos = np.concatenate([np.arange(b - a) for a, b in zip(starts, [*cuts, SEQ])])
                pos[: starts[1] if len(starts) > 1 else SEQ] += int(g.integers(0, 2)) * int(g.integers(1, 40))
                for a in starts:
                    labels[a : a + 3] = -100  # each document's prompt
            else:
                n = int(g.integers(SEQ // 2, SEQ))
                pos = np.arange(SEQ)
                labels[:5] = -100
                labels[n:] = -100
                ids[n:] = 0
            planes += [ids, labels, pos]
        if kto or margins:
            tag = np.zeros(SEQ, np.int64)
            if kto:
                tag[0] = len(out) % 2
            else:
                tag[:3] = margin_tag(float(g.uniform(-1, 2)))
            planes += [tag, np.full(SEQ, -100), np.arange(SEQ)]
        out.append(np.stack(planes))
    return np.stack(out).astype(np.int32)


def run_case(
    spec, rows: np.ndarray, steps: int, on_step=None, export_to: str | None = None, resume: bool = False
) -> dict:
    """Per-step losses and grad norms of `spec` (its scaling names the mesh) on `rows`, every step on
    the same global batch; and this rank's peak resident memory above where the steps started
    (activations, gradients, AdamW's state: the model is loaded before). With `resume`, the job's
    checkpoint is committed after the last step, one more step is taken (`continued`), and a fresh
    strategy and objective restored from that checkpoint take the same step (`resumed`): each its
    (loss, grad norm)."""
    from raytrain import objectives
    from raytrain.data.batches import micro_batches
    from raytrain.data.order import rank_slice
    from raytrain.job.plan import RunPlan
    from raytrain.strategies import build_strategy, vocab_parallel
    from raytrain.train import loop
    from raytrain.train.preemption import StopSignals

    torch.manual_seed(0)
    plan = RunPlan.of(spec)
    local_run.torch_linear()  # cases share processes: each starts with torch's F.linear
    strategy = build_strategy(spec, torch.device("cpu"), plan)
    mesh, rank = strategy.layout, strategy.rank
    start, stop = rank_slice(len(rows), mesh.dp, mesh.dp_rank(rank))
    batch = micro_batches(
        [_Rows(rows)], [(0, r) for r in range(start, stop)], plan.accumulation_steps(strategy.world_size)
    )
    objective = objectives.build(spec)
    losses, norms, rewards = [], [], []
    head = getattr(strategy.hf_model.get_output_embeddings(), "weight", None)  # None: a reward model's
    layout = (
        "rows" if vocab_parallel.is_split(strategy.hf_model) else "sharded" if hasattr(head, "device_mesh") else "whole"
    )
    output_layer = head is not None and (layout, head is strategy.hf_model.get_input_embeddings().weight)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak resident set starts again from here
    before = _status_mb("VmRSS")

    def take(strategy, objective, step: int):
        loop.seed_step(0, step, rank // mesh.tp)
        objective.at(step, [(0, 0, r) for r in range(start, stop)])  # GRPO keys its completions by them
        # A fresh dict a step, as the store gives one: GRPO turns its prompts into completions in place
        return loop.train_step(
            strategy, objective, [dict(mb) for mb in batch], 1e-2, StopSignals(None, check_ray_notice=False)
        )

    for step in range(steps):
        result = take(strategy, objective, step)
        losses.append(result.loss)
        norms.append(result.grad_norm)
        rewards.append(getattr(objective, "host", {}).get("reward"))  # GRPO's: what its completions scored
        if on_step:
            on_step()
    peak = _status_mb("VmHWM") - before
    gathered = None
    if export_to:  # the HF model (or peft adapter) as the job's export writes it (collective)
        strategy.export(export_to, None)
        gathered = _gathered_to_writer_only(strategy)
    out = {
        "losses": losses,
        "grad_norms": norms,
        "rewards": rewards,
        "means": result.means,
        "loaded_by": getattr(strategy, "loaded_by", "whole"),
        "output_layer": output_layer,
        "step_peak_mb": peak,
        "gathered_to_writer_only": gathered,
    }
    if resume:  # the job's own commit and restore (tests/gpu/local_run.py), as a restarted worker group does
        from raytrain.rundir.checkpoints import TrainState

        local_run.commit_here(strategy, TrainState(step=steps, model_commit=spec.model.revision), {})
        continued = take(strategy, objective, steps)
        local_run.release(strategy)
        del strategy
        local_run.torch_linear()
        again = build_strategy(spec, torch.device("cpu"), plan)
        local_run.restore(again, step=steps)
        resumed = take(again, objectives.build(spec), steps)
        local_run.release(again)
        out.update(continued=[continued.loss, continued.grad_norm], resumed=[resumed.loss, resumed.grad_norm])
    return out


def _gathered_to_writer_only(strategy) -> bool | None:
    """The export's gather of a sharded weight to the rank that writes it (rank 1 here): whole
    there, equal to the all-gather, and nothing on every other rank (collective); None without
    DTensor weights (DDP, ZeRO-3)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from raytrain.strategies.base import gather_to

    weight = next((p for p in strategy.hf_model.parameters() if isinstance(p, DTensor)), None)
    if weight is None:
        return None
    weight = weight.detach()
    got, whole = gather_to(weight, 1), weight.full_tensor()
    ok = (got is not None) == (dist.get_rank() == 1) and (got is None or torch.equal(got, whole))
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, ok)
    return all(every)


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith(field + ":")).split()[1]) / 1024


class _Rows:
    """The part of TokenStore that `micro_batches` reads."""

    def __init__(self, rows: np.ndarray):
        self.rows, self.seq_len, self.planes = rows, rows.shape[2], rows.shape[1]
        self.manifest = {"pad_id": 0}

    def read(self, index):
        return self.rows[index]


GRPO = {"num_generations": 4, "max_completion_length": 8, "rewards": [{"function": "raytrain.demo_assets:lipogram"}]}


def grpo_rows(model: str, rows: int, seq: int = SEQ) -> np.ndarray:
    """GRPO's rows as the store gives them: the demo prompts and their columns (data/prompts.py)."""
    from transformers import AutoTokenizer

    from raytrain.data.prompts import encode_prompts
    from raytrain.demo_assets import prompt_rows
    from raytrain.job.spec import DataSpec

    encoded = encode_prompts(
        AutoTokenizer.from_pretrained(model),
        DataSpec(path="x", format="prompt", seq_len=seq),
        prompt_rows(rows, seed=3),
        GRPO["max_completion_length"],
    )
    out = np.zeros((rows, 6, seq), np.int32)
    for i, sequences in enumerate(encoded):
        for q, (ids, labels) in enumerate(sequences):
            out[i, 3 * q, : len(ids)], out[i, 3 * q + 1] = ids, -100
            out[i, 3 * q + 1, : len(ids)] = labels
            out[i, 3 * q + 2] = np.arange(seq)
    return out


def job(
    model: str,
    storage: str,
    sp: int = 1,
    tp: int = 1,
    finetune: str = "full",
    objective: str = "sft",
    workers: int = 4,
    attn: str = "sdpa",
    strategy: str = "fsdp2",
    seq: int = SEQ,
    batch: int = 8,
    grpo: dict | None = None,
):
    from raytrain.job.spec import JobSpec

    rl = {"grpo": {**GRPO, **(grpo or {})}} if objective == "grpo" else {}
    return JobSpec.model_validate(
        {
            "name": "mesh",
            "model": {"path": model, "attn_implementation": attn},
            "data": {"path": "unused.jsonl", "seq_len": seq, **({"format": "prompt"} if rl else {})},
            "training": {
                "strategy": strategy,
                "finetune": finetune,
                "objective": objective,
                "global_batch_size": batch,
                "micro_batch_size": 1,
                "max_steps": 3,
                "seed": 0,
                "precision": "fp32",
                "lora": {"rank": 4, "alpha": 8, "dropout": 0.0},
                **rl,
            },
            "scaling": {"num_workers": workers, "sequence_parallel": sp, "tensor_parallel": tp},
            "checkpoint": {"storage_path": storage},
            "tracking": {"experiment": "tests"},
        }
    )


def _debug_main(rank, world, model, cases, port):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    for case in cases:
        case = json.loads(case)
        pairs, packed = case.pop("objective", "sft") != "sft", case.pop("packed", True)
        rows = global_rows(pairs, packed, 8)
        out = run_case(job(model, "/tmp/mesh-runs", objective="dpo" if pairs else "sft", **case), rows, 3)
        if rank == 0:
            print(json.dumps({"case": case, "pairs": pairs, "packed": packed, **out}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":  # torchrun-free: python tests/mesh_cases.py MODEL_DIR '{"sp": 2}' ...
    import torch.multiprocessing as mp

    mp.spawn(_debug_main, args=(4, sys.argv[1], sys.argv[2:], 29517), nprocs=4)
