"""One YAML field switches the parallelism: the same tiny Llama, data, seed and global batch,
fp32 on CPU with 2 gloo ranks, trained 12 steps under `fsdp2`, `zero3` and `ddp` for full
fine-tuning, `fsdp2` and `zero3` for LoRA (DDP LoRA is every LoRA case's reference in
tests/test_combinations.py). The five train through the worker's own path without Ray
(tests/gpu/local_run.py: prepare, strategy, `loop.fit`, the job's commit and worker.export), one
spawned group for all of them, as test_miniature_jobs' group does: Ray Train is not what differs
between strategies, and each strategy's job through `raytrain run` is another module's (zero3: LoRA
GRPO with adapter sync in test_vllm.py; ddp: merged-sync GRPO there; fsdp2: most of them; a tampered
checkpoint refused at restore is test_spine.py's).

- Parity: per-step losses agree within 1e-5 relative (the issue's bound). The three compute
  the same sums in a different order (ZeRO-3 reduce-scatters every micro-batch and adds the
  partitions; DDP/FSDP2 accumulate locally and reduce once; grad norms in fp64 vs fp32), so
  bit equality is not expected; what is seen is ~1e-7 (fp32 rounding, amplified a little by
  Adam over 20 steps). The figures are printed (run with -s).
- Resume: each strategy's own checkpoint restored takes the next step bit for bit in every case of
  tests/test_combinations.py (its resume axis); a killed worker's group comes back bit-identical
  at every kill point under fsdp2 (tests/test_fault_tolerance.py). Here ZeRO-3 resumes a 2-rank
  checkpoint with 1 rank (universal checkpoint conversion) and a tied model's fsdp2 LoRA checkpoint
  resumes at 1 rank and back at 2, within the parity bound.
- Export: each strategy's final model loads with plain transformers/peft; the three give the
  same logits on a fixed input, and each equals its own last checkpoint exported offline.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import Planted, altered, file_hashes, make_job

from raytrain.rundir.checkpoints import RAY_SNAPSHOT
from raytrain.train.export import export_checkpoint, latest_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
import local_run  # noqa: E402

pytestmark = pytest.mark.slow
STRATEGIES = ("fsdp2", "zero3", "ddp")
FINETUNES = ("lora", "full")
STEPS, EVERY = 12, 6
LOSS_REL_TOL = 1e-5
PROBE = torch.tensor([[5, 17, 42, 9, 33, 120, 7, 64, 1, 200, 88, 13]])


def job(assets, storage, strategy, finetune, name, steps=STEPS, **over):
    # A constant LR after warmup: a run stopped at step EVERY and continued is the same
    # optimization as the STEPS-step run (a cosine schedule would depend on max_steps).
    return make_job(
        assets,
        storage,
        name=name,
        training={"strategy": strategy, "finetune": finetune, "max_steps": steps, **over.pop("training", {})},
        optimizer={"lr": 3e-3, "warmup_steps": 2, "schedule": "constant"},
        checkpoint={"every_n_steps": EVERY, "keep_last": 2},
        **over,
    )


@dataclass
class Run:
    spec: object
    run_dir: Path
    losses: dict[int, float]
    grad_norms: dict[int, float]
    step_time_s: float  # median over steps 2..12 (step 1 includes warm-up)
    compute_s: float  # the same for forward/backward + optimizer step only (no data wait)


# DDP LoRA is the combination test's reference, and its export plain peft's there (the DoRA cases):
# its own job here was cut for CI time.
RUNS = [(f, s) for f, s in itertools.product(FINETUNES, STRATEGIES) if (s, f) != ("ddp", "lora")]


def strategies_of(finetune: str) -> tuple[str, ...]:
    return tuple(s for f, s in RUNS if f == finetune)


@pytest.fixture(scope="module")
def trained(assets, tmp_path_factory) -> dict[tuple[str, str], Run]:
    specs = {}
    for finetune, strategy in RUNS:
        name = f"{strategy}-{finetune}"
        specs[strategy, finetune] = job(assets, tmp_path_factory.mktemp(name), strategy, finetune, name)
    steps = local_run.fit_jobs(2, [(spec, 0) for spec in specs.values()])
    runs = {}
    for key, spec in specs.items():
        history = steps[f"{spec.name}/2"]
        runs[key] = Run(
            spec,
            Path(spec.run_dir),
            {k: m["loss"] for k, m in history.items()},
            {k: m["grad_norm"] for k, m in history.items()},
            statistics.median(history[k]["step_time_s"] for k in range(2, STEPS + 1)),
            statistics.median(history[k]["compute_s"] for k in range(2, STEPS + 1)),
        )
    print(
        "\n[parity] per-step time in s, median of steps 2..12, 2 ranks, CPU (step / compute only):",
        {f"{s}/{f}": (round(r.step_time_s, 3), round(r.compute_s, 3)) for (s, f), r in runs.items()},
    )
    return runs


@pytest.fixture(scope="module")
def continued(trained, assets) -> dict[str, dict[int, float]]:
    """The zero3 full run's step-6 checkpoint continued by 1 rank to step 7, and the fsdp2 LoRA run's
    continued by 1 rank to step 9 and that one's (committed at the job's last step) by 2 ranks to the
    end. In the runs' own directories, put back afterwards for the other tests."""
    zero3, lora = trained["zero3", "full"], trained["fsdp2", "lora"]

    def again(run, steps, workers):
        s = run.spec.training
        return job(
            assets, run.run_dir.parent, s.strategy, s.finetune, run.spec.name, steps, scaling={"num_workers": workers}
        )

    with altered(zero3.run_dir), altered(lora.run_dir):
        spec, one, back = again(zero3, EVERY + 1, 1), again(lora, EVERY + 3, 1), again(lora, STEPS, 2)
        first = local_run.fit_jobs(1, [(spec, EVERY), (one, EVERY)])
        second = local_run.fit_jobs(2, [(back, EVERY + 3)])
    return {
        "zero3": {k: m["loss"] for k, m in first[f"{spec.name}/1"].items()},
        "lora": {k: m["loss"] for k, m in (first[f"{one.name}/1"] | second[f"{back.name}/2"]).items()},
        "world_sizes": {k: m["world_size"] for k, m in (first[f"{one.name}/1"] | second[f"{back.name}/2"]).items()},
    }


def max_diffs(a: dict[int, float], b: dict[int, float]) -> tuple[float, float]:
    return (max(abs(a[k] - b[k]) for k in a), max(abs(a[k] - b[k]) / abs(b[k]) for k in a))


@pytest.mark.parametrize("finetune", FINETUNES)
def test_per_step_losses_agree_across_strategies(trained, finetune):
    runs = {s: trained[s, finetune] for s in strategies_of(finetune)}
    for strategy, run in runs.items():
        assert sorted(run.losses) == list(range(1, STEPS + 1)), strategy
        assert run.spec.training.strategy == strategy
    # The runs learn (so agreement is not two flat lines)...
    assert runs["fsdp2"].losses[STEPS] < runs["fsdp2"].losses[1] - 0.3, runs["fsdp2"].losses
    # ...and agree step by step, pair by pair.
    figures = {}
    for a, b in itertools.combinations(runs, 2):
        abs_diff, rel_diff = max_diffs(runs[a].losses, runs[b].losses)
        figures[f"{a}-{b}"] = {
            "max_abs": abs_diff,
            "max_rel": rel_diff,
            "grad_norm_max_rel": max_diffs(runs[a].grad_norms, runs[b].grad_norms)[1],
        }
        assert rel_diff <= LOSS_REL_TOL, (a, b, figures[f"{a}-{b}"])
        # Clipping sees the same global norm (grad_clip 1.0 binds on the first steps here).
        assert figures[f"{a}-{b}"]["grad_norm_max_rel"] <= 1e-4, (a, b, figures[f"{a}-{b}"])
    print(f"\n[parity] {finetune}: {json.dumps(figures, indent=1)}")


def test_checkpoints_are_each_strategys_own_format(trained):
    for (strategy, finetune), run in trained.items():
        names = {
            p.relative_to(latest_checkpoint(str(run.run_dir))).as_posix()
            for p in Path(latest_checkpoint(str(run.run_dir))).rglob("*")
            if p.is_file()
        }
        assert "train_state.json" in names
        if strategy == "zero3":  # DeepSpeed's save_checkpoint folder: one model/optimizer partition per rank
            assert {
                f"ds/zero_pp_rank_{r}_mp_rank_00_{kind}_states.pt" for r in (0, 1) for kind in ("model", "optim")
            } <= names
            assert not any(n.endswith(".distcp") for n in names)
        else:  # torch DCP files from both ranks; FSDP2's own shards apart from what all ranks read
            assert ".metadata" in names and {n[:4] for n in names if n.endswith(".distcp")} == {"__0_", "__1_"}
            if strategy == "fsdp2":  # which rank writes the replicated items is DCP's dedup's choice
                assert {"__0_0.distcp", "__1_0.distcp"} <= names  # the model's shards, apart from the optimizer's
                assert {"__0_optim0.distcp", "__1_optim0.distcp"} <= names
                assert any(n.endswith("_sharedoptim0.distcp") for n in names)


def test_zero3_checkpoint_resumes_at_another_world_size(trained, continued):
    """The 2-rank run's step-6 checkpoint continued by 1 rank: DeepSpeed refuses a checkpoint of
    another world size, so the strategy converts it to a universal checkpoint."""
    losses = continued["zero3"]
    assert sorted(losses) == [EVERY + 1]
    reference = trained["zero3", "full"].losses[EVERY + 1]
    print(f"\n[universal 2->1] step {EVERY + 1} loss {losses[EVERY + 1]!r} vs uninterrupted {reference!r}")
    # Not bit-identical: 1 rank accumulates 4 micro-batches where 2 ranks reduced 2 + 2.
    assert abs(losses[EVERY + 1] - reference) / reference <= LOSS_REL_TOL


def test_a_tied_lora_checkpoint_resumes_at_one_worker_and_back_at_two(trained, continued):
    """The demo model's output layer is its input embedding (as SmolLM2's, Qwen2.5's, Llama 3.2's): a
    LoRA checkpoint holds the adapter and no output layer. The 2-rank fsdp2 run's step-6 checkpoint
    continued by 1 rank to step 9, and that one's by 2 ranks to the end: every step within the
    parity bound of the uninterrupted run (1 rank accumulates 4 micro-batches where 2 reduce 2 + 2)."""
    run, losses = trained["fsdp2", "lora"], continued["lora"]
    assert sorted(losses) == list(range(EVERY + 1, STEPS + 1))
    assert continued["world_sizes"] == {k: 1 if k <= EVERY + 3 else 2 for k in losses}
    worst = max(abs(losses[k] - run.losses[k]) / run.losses[k] for k in losses)
    print(f"\n[tied lora 2->1->2] steps {EVERY + 1}-{STEPS}: max relative loss difference {worst:.1e}")
    assert worst <= LOSS_REL_TOL


def load_export(folder: Path, spec):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    if spec.training.finetune == "full":
        return AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    return PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(spec.model.path), str(folder)).eval()


def logits_of(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=PROBE).logits


@pytest.mark.parametrize("finetune", FINETUNES)
def test_exports_give_the_same_logits(trained, finetune, tmp_path):
    from transformers import AutoModelForCausalLM

    runs = {s: trained[s, finetune] for s in strategies_of(finetune)}
    logits = {s: logits_of(load_export(r.run_dir / "final_model", r.spec)) for s, r in runs.items()}
    base = logits_of(AutoModelForCausalLM.from_pretrained(runs["fsdp2"].spec.model.path))
    figures = {}
    for a, b in itertools.combinations(runs, 2):
        figures[f"{a}-{b}"] = float((logits[a] - logits[b]).abs().max())
        # Weights differ by the training-order rounding above (~1e-7 relative): fp32 tolerance.
        torch.testing.assert_close(logits[a], logits[b], rtol=1e-5, atol=1e-5)
    print(
        f"\n[export] {finetune} max |logit difference|: {figures}; moved from base by "
        f"{float((logits['zero3'] - base).abs().max()):.3f}"
    )
    for strategy, run in runs.items():
        assert not torch.allclose(logits[strategy], base, atol=1e-3), strategy  # training changed the model
        # The export names the model's own class (vLLM loads by it), never FSDP2's FSDP<Class>
        if finetune == "full":
            exported = json.loads((run.run_dir / "final_model" / "config.json").read_text())
            assert exported["architectures"] == ["LlamaForCausalLM"], (strategy, exported)
        # The in-job export equals the last checkpoint exported offline (zero3: DeepSpeed's zero_to_fp32).
        export_checkpoint(str(run.run_dir), str(tmp_path / strategy))
        torch.testing.assert_close(
            logits_of(load_export(tmp_path / strategy, run.spec)), logits[strategy], rtol=0, atol=1e-6
        )
        if finetune == "lora":  # the adapter names the exact base it was trained on
            meta = json.loads((run.run_dir / "final_model" / "raytrain.json").read_text())
            assert meta["base_files"] == file_hashes(Path(run.spec.model.path))


# The file a forged pickle replaces, and a shard to change a byte of, per checkpoint layout.
PICKLED = {"fsdp2": ".metadata", "zero3": "ds/zero_pp_rank_0_mp_rank_00_model_states.pt"}
SHARD = {"fsdp2": "__1_0.distcp", "zero3": "ds/zero_pp_rank_1_mp_rank_00_optim_states.pt"}


def tamper(step: Path, case: str, strategy: str, side_effect: Path) -> None:
    import pickle

    if case == "changed":
        data = bytearray((step / SHARD[strategy]).read_bytes())
        data[len(data) // 2] ^= 1
        (step / SHARD[strategy]).write_bytes(bytes(data))
    elif case in ("pickle", "resigned"):
        (step / PICKLED[strategy]).write_bytes(pickle.dumps(Planted(side_effect)))
        if case == "resigned":  # the attacker also puts the new hash into the manifest (no key: the old HMAC)
            manifest = json.loads((step / "MANIFEST.json").read_text())
            manifest["ranks"][0][PICKLED[strategy]] = hashlib.sha256(
                (step / PICKLED[strategy]).read_bytes()
            ).hexdigest()
            (step / "MANIFEST.json").write_text(json.dumps(manifest))
    elif case == "planted":
        (step / "extra.pt").write_bytes(pickle.dumps(Planted(side_effect)))
    elif case == "no-manifest":
        (step / "MANIFEST.json").unlink()
    elif case == "replayed":  # a valid checkpoint put where a newer one should be, and registered there
        step.rename(step.with_name("step_00000030"))
        snapshot = json.loads((step.parent / RAY_SNAPSHOT).read_text())
        for result in [snapshot["latest_checkpoint_result"], *snapshot.get("checkpoint_results", [])]:
            result["checkpoint_dir_name"] = result["checkpoint_dir_name"].replace(step.name, "step_00000030")
        (step.parent / RAY_SNAPSHOT).write_text(json.dumps(snapshot))


REFUSALS = {
    "changed": "{shard} was changed after it was written",
    "pickle": "{pickled} was changed after it was written",
    "resigned": "MANIFEST.json has a wrong signature",
    "planted": "extra.pt is in no manifest",
    "no-manifest": r"it has no signed manifest \(MANIFEST.json\)",
    "replayed": f"signs checkpoint step_{STEPS:08d} of run",
}


@pytest.mark.parametrize("strategy", ["fsdp2", "zero3"])
def test_export_refuses_a_tampered_checkpoint_before_reading_it(trained, tmp_path, strategy):
    import re
    import shutil

    from raytrain.errors import JobError

    run = trained[strategy, "full"]
    side_effect = tmp_path / "pwned"
    for case, message in REFUSALS.items():
        with altered(run.run_dir) as run_dir:
            tamper(run_dir / f"step_{STEPS:08d}", case, strategy, side_effect)
            expected = message.format(shard=re.escape(SHARD[strategy]), pickled=re.escape(PICKLED[strategy]))
            with pytest.raises(JobError, match=expected):
                export_checkpoint(str(run_dir), str(tmp_path / case / "out"))
        assert not side_effect.exists(), case  # refused before anything was unpickled
        assert not (tmp_path / case / "out").exists()
    # The job file export rebuilds the model from is signed too (trust_remote_code lives there).
    with altered(run.run_dir) as run_dir:
        job_file = json.loads((run_dir / "job.json").read_text())
        job_file["model"]["trust_remote_code"] = True
        (run_dir / "job.json").write_text(json.dumps(job_file))
        with pytest.raises(JobError, match="job.json: its signature is wrong"):
            export_checkpoint(str(run_dir), str(tmp_path / "job" / "out"))
    # Signed files name their place: the same run copied elsewhere (the job's name and the key
    # the same) is refused, its job.json first and a checkpoint's manifests on their own.
    copy = tmp_path / "elsewhere" / run.run_dir.name
    shutil.copytree(run.run_dir, copy)
    with pytest.raises(
        JobError,
        match=f"job.json: it is signed for run_dir '{re.escape(str(run.run_dir))}', not '{re.escape(str(copy))}'",
    ):
        export_checkpoint(str(copy), str(tmp_path / "copy-out"))
    other = trained[
        "zero3" if strategy == "fsdp2" else "fsdp2", "full"
    ]  # another run's valid checkpoint, put in this one
    with altered(run.run_dir) as run_dir:
        shutil.rmtree(run_dir / f"step_{STEPS:08d}")
        shutil.copytree(other.run_dir / f"step_{STEPS:08d}", run_dir / f"step_{STEPS:08d}")
        with pytest.raises(
            JobError,
            match=f"MANIFEST.json signs checkpoint step_{STEPS:08d} of run directory "
            f"{re.escape(str(other.run_dir))}, not step_{STEPS:08d} of {re.escape(str(run_dir))}",
        ):
            export_checkpoint(str(run_dir), str(tmp_path / "copy-out"))


def _master_steps(rank: int, world: int, device, model: str, storage: str) -> dict:
    """On every rank (spawned): 4 fsdp2 full fine-tuning steps of the bf16-stored model loaded as
    model.dtype float32 and as bfloat16, each with its checkpoint committed after the last step."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    import mesh_cases

    from raytrain.job.spec import JobSpec

    out = {}
    for dtype in ("float32", "bfloat16"):
        raw = mesh_cases.job(model, f"{storage}/{dtype}", workers=world).model_dump(mode="json")
        raw["model"]["dtype"] = dtype
        result = mesh_cases.run_case(
            JobSpec.model_validate(raw), mesh_cases.global_rows(False, True, 8), steps=4, resume=True
        )
        out[dtype] = result["losses"]
    return out


def test_full_fine_tuning_keeps_fp32_master_weights_whatever_the_load_dtype(assets, tmp_path):
    """A model stored in bf16, trained with model.dtype bfloat16 or float32: the same fp32 master
    weights (bf16 -> fp32 is exact), so the same losses bit for bit under fsdp2, and fp32 weights and
    AdamW state in its checkpoint; fsdp2 and ddp share the upcast (strategies/base.to_fp32_master),
    and ddp's losses equal fsdp2's in the parity test. Before, fsdp2 and ddp stepped bf16 weights with
    bf16 AdamW state while zero3 kept an fp32 master. (The strategy and its commit, spawned: the
    launcher adds nothing to what is kept.)"""
    import sys

    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(Path(__file__).parent / "gpu"))
    import local_run

    bf16_model = tmp_path / "bf16-model"
    AutoModelForCausalLM.from_pretrained(str(assets / "model"), dtype=torch.bfloat16).save_pretrained(str(bf16_model))
    for f in assets.joinpath("model").glob("tokenizer*"):
        (bf16_model / f.name).write_bytes(f.read_bytes())
    losses = local_run.spawn(_master_steps, 2, torch.device("cpu"), str(bf16_model), str(tmp_path / "runs"))
    assert losses["bfloat16"] == losses["float32"]
    assert losses["bfloat16"][3] != losses["bfloat16"][0]  # it trained
    (step,) = Path(tmp_path / "runs" / "bfloat16").glob("*/step_*")
    reader = dcp_dtypes(step)
    assert reader and set(reader.values()) == {torch.float32}, reader  # weights and AdamW state


def dcp_dtypes(step: Path) -> dict[str, torch.dtype]:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(str(step)).read_metadata()
    return {
        k: v.properties.dtype
        for k, v in metadata.state_dict_metadata.items()
        if isinstance(v, TensorStorageMetadata) and v.size.numel() > 1
    }
