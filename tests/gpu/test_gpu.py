"""The product's strategies on a GPU, without Ray: `pytest -m gpu tests/gpu` (tests/gpu/run.sh).

Each test builds a real JobSpec (conftest's make_job on the offline demo assets, the model stored in
bf16 over several safetensors files), calls `build_strategy(spec, cuda:0)` and `loop.fit` on the
rows `open_data` reads from a prepared token store, in this process on a one-rank NCCL group
(tests/gpu/local_run.py says what stands in for Ray, and why nothing else changes). bf16 compute
(training.precision bf16, model.dtype bfloat16) under fsdp2, zero3 and ddp, LoRA and full:

- sharded loading from the bf16 files equals `from_pretrained` bit for bit;
- a committed checkpoint restored into a fresh strategy gives the next step's loss bit for bit;
- the in-job export and the offline export of the last checkpoint are the same tensors, and
  load with plain transformers / peft;
- training.compile and training.chunked_loss give the eager losses, so does Liger's fused loss where
  it is installed, and Liger's RMSNorm, SwiGLU and RoPE in eager blocks; sdpa's varlen kernel gives
  the masked kernel's values; a DPO step starts at ln 2;
- QLoRA trains within 2% of LoRA over an NF4 base a quarter of bf16's bytes, resumes and exports;
- masked attention's gradients are finite where cuDNN's are NaN (pytorch#196678);
- with 2+ GPUs, a 2-rank fsdp2 run resumes bit for bit.

Without CUDA every test is skipped, so CPU CI sees skips only. RAYTRAIN_GPU_SUITE_DEVICE=cpu runs
the same tests on CPU for development (gloo, fp32 compute, the same bf16 model files); there the
suite also proves it never imports Ray or MLflow (they are made unimportable while it runs).
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import local_run as lr  # noqa: E402
from conftest import file_hashes, make_job  # noqa: E402

DEVICE = lr.suite_device()
CUDA = DEVICE is not None and DEVICE.type == "cuda"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEVICE is None, reason=f"no CUDA device ({lr.DEVICE_ENV}=cpu runs it on CPU)"),
]
STRATEGIES, FINETUNES = ("fsdp2", "zero3", "ddp"), ("lora", "full")
PROBE = torch.tensor([[5, 17, 42, 9, 33, 120, 7, 64, 1, 200, 88, 13]])
# bf16 compute on GPU: two computations of the same loss that differ only in kernels (compiled,
# chunked) agree to bf16's precision, not bit for bit; fp32 on CPU is held to the product's 1e-5.
LOSS_RTOL = 2e-2 if CUDA else 1e-5


def deepspeed_missing() -> str | None:
    """Why zero3 cannot run here, or None. Only looked up at collection (importing DeepSpeed takes
    seconds, and CPU CI collects this file to skip it); a zero3 test imports it before building."""
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        return "deepspeed is not installed here (tests/gpu/wheels.sh builds the wheel run.sh installs)"
    return None


def require_deepspeed(strategy_name: str) -> None:
    if strategy_name == "zero3":
        try:
            import deepspeed  # noqa: F401
        except Exception as exc:  # installed but broken: say so rather than fail inside the strategy
            pytest.skip(f"deepspeed does not import here: {type(exc).__name__}: {exc}")


def cases(strategies=STRATEGIES, finetunes=FINETUNES):
    """(strategy, finetune) params; zero3 ones skip with the reason when DeepSpeed is missing."""
    reason = deepspeed_missing()
    return [
        pytest.param(
            s,
            f,
            id=f"{s}-{f}",
            marks=[pytest.mark.skipif(reason is not None, reason=str(reason))] if s == "zero3" else [],
        )
        for s in strategies
        for f in finetunes
    ]


# ------------------------------------------------------------------ fixtures
@pytest.fixture(scope="session")
def device():
    """One rank of an NCCL (gloo on CPU) process group in this process, for the whole session;
    Ray and MLflow unimportable while it lasts (where they were not imported already)."""
    with lr.blocked_imports(), lr.process_group(DEVICE) as d:
        yield d


@pytest.fixture(scope="session")
def bf16_model(assets, tmp_path_factory) -> Path:
    return lr.save_bf16_copy(assets / "model", tmp_path_factory.mktemp("bf16") / "model")


@pytest.fixture(scope="session")
def storage(tmp_path_factory) -> Path:
    """Every run's storage_path: one token store per dataset for the whole session."""
    return tmp_path_factory.mktemp("storage")


def job(assets, storage, model, name, strategy, finetune, steps=4, **over):
    # A constant LR after warmup: a run continued from its step-2 checkpoint is the same optimization.
    # Blocks compile where a test asks (training.compile auto compiles on GPUs: the train-resume-export
    # test runs the product's default); elsewhere eager, so the suite fits its few minutes.
    training = {
        "strategy": strategy,
        "finetune": finetune,
        "max_steps": steps,
        "compile": False,
        "precision": "bf16" if CUDA else "fp32",
        **over.pop("training", {}),
    }
    scaling = {"num_workers": 1, "use_gpu": CUDA, **over.pop("scaling", {})}
    return make_job(
        assets,
        storage,
        name=name,
        model={"path": str(model), "dtype": "bfloat16"},
        training=training,
        optimizer={"lr": 3e-3, "warmup_steps": 2, "schedule": "constant"},
        scaling=scaling,
        checkpoint={"every_n_steps": 2, "keep_last": 5},
        **over,
    )


def build(spec, device):
    from raytrain.strategies import build_strategy

    require_deepspeed(spec.training.strategy)
    lr.torch_linear()  # the suite's strategies share this process
    return build_strategy(spec, device)


def finite(losses: dict[int, float]) -> bool:
    return all(math.isfinite(v) for v in losses.values())


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def test_the_suite_runs_without_ray_or_mlflow(device):
    """What the GPU machine lacks is not imported by anything the suite runs (there it is not
    installed; here the session's `blocked_imports` makes it so, unless a mixed session imported it)."""
    import importlib.util

    loaded = sorted({n.split(".")[0] for n, m in sys.modules.items() if m is not None} & set(lr.NOT_ON_GPU_MACHINE))
    if loaded:
        pytest.skip(f"a test outside tests/gpu imported {loaded} in this session")
    assert all(importlib.util.find_spec(name) is None for name in lr.NOT_ON_GPU_MACHINE)
    with pytest.raises(ImportError):
        import ray  # noqa: F401


# ------------------------------------------------------------------ sharded loading
@pytest.mark.parametrize("strategy_name,finetune", cases(("fsdp2", "zero3")))
def test_sharded_loading_from_bf16_safetensors_equals_from_pretrained(
    assets, storage, bf16_model, device, strategy_name, finetune
):
    """Each rank reads its slices of the bf16 files straight into its (device) shards: the weights
    equal a plain from_pretrained in bf16 bit for bit (fsdp2's trained weights: their fp32 masters,
    bf16 -> fp32 exact), adapters initialized as on a loaded model, rotary buffers computed."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from raytrain.model import modeling
    from raytrain.strategies.base import to_fp32_master

    spec = job(assets, storage, bf16_model, f"load-{strategy_name}-{finetune}", strategy_name, finetune)
    assert len(list(bf16_model.glob("*.safetensors"))) >= 3  # several files, with an index
    strategy = build(spec, device)
    assert strategy.loaded_by == "sharded"  # not the rank-0 broadcast fallback
    if strategy_name == "zero3":
        from raytrain.strategies.zero3 import gathered_state_dict

        got = gathered_state_dict(strategy.hf_model, 0, fp32_master=False, dtype=torch.bfloat16)
    else:
        got = get_model_state_dict(strategy.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    buffers = {n: b.detach().cpu().clone() for n, b in strategy.hf_model.named_buffers()}
    lr.release(strategy)
    del strategy

    expected_model = modeling.load_model(spec)  # from_pretrained in bf16 (+ peft), on the CPU
    if strategy_name == "fsdp2":
        to_fp32_master(expected_model)
    expected = expected_model.state_dict()
    if strategy_name == "zero3":  # gathered in model.dtype (its fp32 masters live in the optimizer)
        expected = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in expected.items()}
    assert got.keys() == expected.keys()
    dtypes = {k: (got[k].dtype, v.dtype) for k, v in expected.items() if got[k].dtype != v.dtype}
    assert not dtypes, dtypes
    differ = [k for k, v in expected.items() if not torch.equal(got[k].cpu(), v)]
    assert not differ, f"{len(differ)} weights differ from from_pretrained, e.g. {differ[:3]}"
    for name, value in expected_model.named_buffers():  # rotary inv_freq: computed on the device
        torch.testing.assert_close(buffers[name], value, rtol=1e-6 if CUDA else 0, atol=0)


# ------------------------------------------------------------------ train, checkpoint, resume, export
def load_export(folder: Path, spec, device):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    if spec.training.finetune == "full":
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16)
    else:
        base = AutoModelForCausalLM.from_pretrained(spec.model.path, dtype=torch.bfloat16)
        model = PeftModel.from_pretrained(base, str(folder))
    return model.to(device).eval()


def logits_of(model, device, autocast=None) -> torch.Tensor:
    import contextlib

    with torch.no_grad(), autocast() if autocast else contextlib.nullcontext():
        return model(input_ids=PROBE.to(device)).logits.float().cpu()


def export_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.mark.parametrize("strategy_name,finetune", cases())
def test_train_checkpoint_resume_and_export(assets, storage, bf16_model, device, tmp_path, strategy_name, finetune):
    """4 bf16 steps with checkpoints at 2 and 4. A fresh strategy restored from step 2's signed
    checkpoint gives step 3's loss bit for bit (and step 4's: exactly on CPU, to bf16 precision on
    GPU, where backward kernels may accumulate in another order). The in-job export equals the
    offline export of the step-4 checkpoint tensor for tensor, loads with plain transformers/peft,
    gives the trained model's logits and not the base's."""
    from raytrain.rundir.job_file import write_job_file
    from raytrain.train.export import export_checkpoint

    spec = job(
        assets,
        storage,
        bf16_model,
        f"run-{strategy_name}-{finetune}",
        strategy_name,
        finetune,
        training={"compile": "auto"},
    )  # the product's default: compiled blocks on a GPU (not zero3)
    prepared = lr.prepare_data(spec)
    write_job_file(spec)  # the signed job.json the offline export rebuilds the model from
    strategy = build(spec, device)
    first = lr.train(spec, strategy, prepared)
    assert sorted(first.losses) == [1, 2, 3, 4] and finite(first.losses), first.losses
    assert first.state.step == 4 and first.state.data.consumed == 4 * spec.training.global_batch_size
    from raytrain.rundir.checkpoints import latest_checkpoint

    assert latest_checkpoint(spec.run_dir).endswith("step_00000004") and (Path(spec.run_dir) / "step_00000002").is_dir()
    live = logits_of(strategy.model, device, strategy.autocast)
    in_job = tmp_path / "final_model"
    lr.export(spec, strategy, str(in_job))
    lr.release(strategy)
    del strategy

    offline = tmp_path / "offline"
    export_checkpoint(spec.run_dir, str(offline))  # raytrain export RUN_DIR: the step-4 checkpoint, one process
    a, b = export_tensors(in_job), export_tensors(offline)
    assert a.keys() == b.keys() and a
    # Both from the same fp32 masters; zero3 gathers a LoRA adapter in model.dtype, the offline path keeps fp32.
    differ = [k for k in a if not torch.equal(a[k], b[k].to(a[k].dtype))]
    assert not differ, f"in-job and offline exports differ in {differ[:3]}"
    dtypes = sorted({str(t.dtype) for t in a.values()}), sorted({str(t.dtype) for t in b.values()})
    print(f"\n[export {strategy_name}/{finetune}] {len(a)} tensors; dtypes in-job {dtypes[0]}, offline {dtypes[1]}")
    meta = json.loads((in_job / "raytrain.json").read_text())
    assert meta["finetune"] == finetune
    if finetune == "lora":  # the adapter names its base by the sha256 of each of its weight files
        assert meta["base_files"] == file_hashes(bf16_model)

    exported = load_export(in_job, spec, device)
    got = logits_of(exported, device)
    from transformers import AutoModelForCausalLM

    base = logits_of(
        AutoModelForCausalLM.from_pretrained(spec.model.path, dtype=torch.bfloat16).to(device).eval(), device
    )
    del exported
    lr.release()
    moved, off = float((live - base).norm()), float((got - live).norm())
    print(f"\n[export {strategy_name}/{finetune}] |live - base| {moved:.4f}, |export - live| {off:.4f}")
    assert torch.isfinite(got).all() and moved > 0
    assert off < 0.5 * moved, "the exported model's logits are not the trained model's"

    again = build(spec, device)
    state = lr.restore(again, step=2)
    assert state.step == 2 and state.data.consumed == 2 * spec.training.global_batch_size
    resumed = lr.train(spec, again, prepared, state=state)
    lr.release(again)
    print(f"[resume {strategy_name}/{finetune}] uninterrupted {first.losses}, resumed {resumed.losses}")
    assert sorted(resumed.losses) == [3, 4]
    assert resumed.losses[3] == first.losses[3]  # the restored weights, bit for bit
    if CUDA:
        assert rel(resumed.losses[4], first.losses[4]) <= 1e-3  # + one step of backward and AdamW state
    else:
        assert resumed.losses[4] == first.losses[4]


# ------------------------------------------------------------------ compile, chunked loss
@pytest.mark.parametrize("strategy_name,finetune", cases(("fsdp2", "ddp"), ("full",)))
def test_compiled_blocks_train_with_the_eager_losses(assets, storage, bf16_model, device, strategy_name, finetune):
    from raytrain.model import modeling

    losses = {}
    for compiled in (False, True):
        spec = job(
            assets,
            storage,
            bf16_model,
            f"compile{int(compiled)}-{strategy_name}-{finetune}",
            strategy_name,
            finetune,
            steps=3,
            training={"compile": compiled},
        )
        prepared = lr.prepare_data(spec)
        strategy = build(spec, device)
        blocks = modeling.decoder_blocks(strategy.hf_model)
        assert all((getattr(b, "_compiled_call_impl", None) is not None) == compiled for b in blocks)
        losses[compiled] = lr.train(spec, strategy, prepared, checkpoints=False).losses
        lr.release(strategy)
        del strategy
    torch._dynamo.reset()
    print(f"\n[compile {strategy_name}/{finetune}] eager {losses[False]}, compiled {losses[True]}")
    assert sorted(losses[True]) == [1, 2, 3] and finite(losses[True])
    assert all(rel(losses[True][k], losses[False][k]) <= LOSS_RTOL for k in losses[False]), losses


@pytest.mark.parametrize("strategy_name,finetune", cases(("fsdp2", "ddp")))
def test_chunked_loss_trains_with_the_whole_logits_losses(assets, storage, bf16_model, device, strategy_name, finetune):
    """training.chunked_loss: 5 tokens a chunk (7 chunks of a micro-batch's 62 targets), each chunk's
    logits recomputed in backward; the same per-token losses summed in another order."""
    losses = {}
    for chunk in (False, 5):
        spec = job(
            assets,
            storage,
            bf16_model,
            f"chunk{int(chunk)}-{strategy_name}-{finetune}",
            strategy_name,
            finetune,
            steps=3,
            training={"chunked_loss": chunk},
        )
        prepared = lr.prepare_data(spec)
        strategy = build(spec, device)
        assert strategy.loss_chunk == (chunk or 0)
        losses[chunk] = lr.train(spec, strategy, prepared, checkpoints=False).losses
        lr.release(strategy)
        del strategy
    print(f"\n[chunked_loss {strategy_name}/{finetune}] whole {losses[False]}, chunked {losses[5]}")
    assert sorted(losses[5]) == [1, 2, 3] and finite(losses[5])
    assert rel(losses[5][1], losses[False][1]) <= (1e-3 if CUDA else 1e-6)  # the same weights at step 1
    assert all(rel(losses[5][k], losses[False][k]) <= LOSS_RTOL for k in losses[False]), losses


# ------------------------------------------------------------------ DPO
@pytest.mark.parametrize("strategy_name,finetune", cases(("fsdp2", "ddp")))
def test_liger_fused_loss_trains_with_the_unfused_losses(assets, storage, bf16_model, device, strategy_name, finetune):
    """With liger-kernel installed (tests/gpu/wheels.sh carries it), training.chunked_loss auto on CUDA
    takes Liger's fused linear cross-entropy (kernels.fused_loss), named in the kernel line: the whole
    logits' losses to bf16 precision, step for step."""
    pytest.importorskip("liger_kernel", reason="liger-kernel is not installed here (tests/gpu/wheels.sh carries it)")
    if not CUDA:
        pytest.skip("Liger's kernels are Triton's: CUDA only")
    losses = {}
    for chunked in ("auto", False):
        spec = job(
            assets,
            storage,
            bf16_model,
            f"liger-{chunked}-{strategy_name}-{finetune}",
            strategy_name,
            finetune,
            steps=3,
            training={"chunked_loss": chunked},
        )
        prepared = lr.prepare_data(spec)
        strategy = build(spec, device)
        assert ("Liger's fused linear cross-entropy" in strategy.kernel_line()) == (chunked == "auto"), (
            strategy.kernel_line()
        )
        losses[chunked] = lr.train(spec, strategy, prepared, checkpoints=False).losses
        lr.release(strategy)
        del strategy
    print(f"\n[liger {strategy_name}/{finetune}] unfused {losses[False]}, Liger {losses['auto']}")
    assert sorted(losses["auto"]) == [1, 2, 3] and finite(losses["auto"])
    assert all(rel(losses["auto"][k], losses[False][k]) <= LOSS_RTOL for k in losses[False]), losses


def step_one_gradients(spec, device) -> tuple[dict[str, torch.Tensor], str]:
    """Every trained parameter's gradient after step 1's micro-batches (before any update), whole,
    and the strategy's kernel line."""
    from raytrain import objectives
    from raytrain.data.batches import open_data
    from raytrain.job.plan import RunPlan
    from raytrain.rundir.checkpoints import TrainState

    prepared = lr.prepare_data(spec)
    strategy = build(spec, device)
    batches, _, _ = open_data(spec, RunPlan.of(spec, prepared), strategy.rank, strategy.world_size, TrainState().data)
    objective, micro = objectives.build(spec), next(batches).micro_batches
    for i, mb in enumerate(micro):
        loss, _ = objective(strategy, mb)
        strategy.backward(loss, sync=i == len(micro) - 1)
    grads = {
        n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).float().cpu()
        for n, p in strategy.hf_model.named_parameters()
        if p.grad is not None
    }
    line = strategy.kernel_line()
    batches.close()
    lr.release(strategy)
    del strategy
    return grads, line


@pytest.mark.parametrize("strategy_name,finetune", cases(("fsdp2", "ddp"), ("lora",)))
def test_liger_fused_loss_gives_dpo_the_unfused_gradients_at_step_1(
    assets, storage, bf16_model, device, strategy_name, finetune
):
    """DPO's upstream gradient differs by row (chosen and rejected tokens: opposite signs), which is what
    liger-kernel before 0.8.2 got wrong under reduction="none" (kernels.LIGER_FLOOR): every trained
    parameter's gradient at step 1 with Liger's fused loss against the unfused loss's. (The losses
    test above is SFT's, whose uniform upstream gradient survived the bug.)"""
    pytest.importorskip("liger_kernel", reason="liger-kernel is not installed here (tests/gpu/wheels.sh carries it)")
    if not CUDA:
        pytest.skip("Liger's kernels are Triton's: CUDA only")
    from raytrain.model import kernels

    grads, lines = {}, {}
    for chunked in ("auto", False):
        spec = job(
            assets,
            storage,
            bf16_model,
            f"liger-dpo-{chunked}-{strategy_name}-{finetune}",
            strategy_name,
            finetune,
            steps=1,
            data={"path": str(assets / "pairs.jsonl"), "seq_len": 32},
            training={"objective": "dpo", "preference": {"beta": 0.1}, "chunked_loss": chunked},
        )
        grads[chunked], lines[chunked] = step_one_gradients(spec, device)
    version = kernels._liger_version()
    if not kernels.liger_fused_allowed(version):
        assert f"liger-kernel {version} predates" in lines["auto"], lines["auto"]
        pytest.skip(f"liger-kernel {version} predates {kernels.LIGER_FLOOR}: not used (the kernel line says so)")
    assert "Liger's fused linear cross-entropy" in lines["auto"], lines["auto"]
    assert grads["auto"].keys() == grads[False].keys() and grads[False]
    worst = {
        n: ((grads["auto"][n] - g).norm() / g.norm().clamp(min=1e-12)).item()
        for n, g in grads[False].items()
        if g.norm() > 0
    }
    print(f"\n[liger dpo {strategy_name}/{finetune}] worst relative gradient difference {max(worst.values()):.2e}")
    assert worst and max(worst.values()) <= 5e-2, sorted(worst.items(), key=lambda kv: -kv[1])[:5]


@pytest.mark.parametrize("strategy_name,finetune", cases(("fsdp2", "zero3"), ("lora",)))
def test_liger_block_kernels_train_with_the_models_own(
    assets, storage, bf16_model, device, strategy_name, finetune, monkeypatch
):
    """Blocks left eager on CUDA (`compile: false` here; zero3, sp, GRPO, QLoRA by the plan) take
    Liger's RMSNorm, SwiGLU and RoPE where liger-kernel is installed (kernels.block_kernels), named
    in the kernel line: the model's own ops' losses to bf16 precision, step for step."""
    pytest.importorskip("liger_kernel", reason="liger-kernel is not installed here (tests/gpu/wheels.sh carries it)")
    if not CUDA:
        pytest.skip("Liger's kernels are Triton's: CUDA only")
    from transformers.models.llama import modeling_llama

    from raytrain.model import kernels

    # Liger's RoPE patch replaces the family's function for the whole process: put it back after.
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", modeling_llama.apply_rotary_pos_emb)
    losses = {}
    for liger in (False, True):  # the model's own ops first: nothing of Liger's is in place yet
        with monkeypatch.context() as m:
            if not liger:
                m.setattr(kernels, "liger_blocks_apply", lambda *a: False)
            spec = job(
                assets,
                storage,
                bf16_model,
                f"liger-blocks-{liger}-{strategy_name}-{finetune}",
                strategy_name,
                finetune,
                steps=3,
                training={"compile": False},
            )
            prepared = lr.prepare_data(spec)
            strategy = build(spec, device)
            assert (kernels.LIGER_BLOCKS in strategy.kernel_line()) == liger, strategy.kernel_line()
            losses[liger] = lr.train(spec, strategy, prepared, checkpoints=False).losses
            lr.release(strategy)
            del strategy
    print(f"\n[liger blocks {strategy_name}/{finetune}] own {losses[False]}, Liger {losses[True]}")
    assert sorted(losses[True]) == [1, 2, 3] and finite(losses[True])
    assert all(rel(losses[True][k], losses[False][k]) <= LOSS_RTOL for k in losses[False]), losses


@pytest.mark.parametrize("strategy_name,finetune", cases(("fsdp2", "ddp", "zero3"), ("lora", "full")))
def test_dpo_steps(assets, storage, bf16_model, device, strategy_name, finetune):
    """Two DPO steps on preference pairs. At step 1 the policy is its reference (LoRA: the adapter's
    B is zero, and the reference is the same model with the adapter off; full: a frozen copy loaded
    from the same files), so the loss is ln 2 and the margins 0; then it trains."""
    spec = job(
        assets,
        storage,
        bf16_model,
        f"dpo-{strategy_name}-{finetune}",
        strategy_name,
        finetune,
        steps=2,
        data={"path": str(assets / "pairs.jsonl"), "seq_len": 32},
        training={"objective": "dpo", "preference": {"beta": 0.1}},
    )
    prepared = lr.prepare_data(spec)
    strategy = build(spec, device)
    if finetune == "full":
        assert strategy.reference_model is not None
    trained = lr.train(spec, strategy, prepared, checkpoints=False)
    lr.release(strategy)
    steps = trained.steps
    print(
        f"\n[dpo {strategy_name}/{finetune}] "
        + ", ".join(
            f"step {k}: loss {m['loss']:.6f} margin {m['rewards/margins']:.2e} acc {m['rewards/accuracies']:.2f}"
            for k, m in sorted(steps.items())
        )
    )
    assert sorted(steps) == [1, 2] and finite(trained.losses)
    # Exactly ln 2 where policy and reference compute alike: LoRA in fp32 (CPU). A full fine-tune's
    # reference is a frozen copy in model.dtype (bf16), the policy fp32 masters: on CPU (fp32 compute)
    # the reference computes in bf16, under DDP's autocast the norms differ; bf16 kernels on GPU.
    exact = not CUDA and finetune == "lora"
    assert abs(steps[1]["loss"] - math.log(2)) <= (1e-6 if exact else 2e-3), steps[1]
    assert abs(steps[1]["rewards/margins"]) <= (1e-6 if exact else 2e-2)
    assert steps[2]["loss"] != steps[1]["loss"]


# ------------------------------------------------------------------ reward model, KTO
@pytest.mark.parametrize("objective", ["reward", "kto"])
@pytest.mark.parametrize("strategy_name,finetune", cases(("fsdp2", "ddp", "zero3"), ("lora", "full")))
def test_reward_model_and_kto_steps(assets, storage, bf16_model, device, strategy_name, finetune, objective):
    """Three steps of a reward model (the score head new, drawn from the seed) on preference pairs, or
    of KTO on labelled completions, from a bf16 model: finite, and they train. KTO's step 1 has the
    policy at its reference (as DPO's): the log-ratios and the KL estimate are 0 and each row's loss
    is 1 - sigmoid(0) = 0.5. (Both against TRL's losses and across strategies in fp32:
    tests/test_preference.py, tests/test_combinations.py.)"""
    rows = {"reward": "pairs.jsonl", "kto": "kto.jsonl"}[objective]
    spec = job(
        assets,
        storage,
        bf16_model,
        f"{objective}-{strategy_name}-{finetune}",
        strategy_name,
        finetune,
        steps=3,
        data={"path": str(assets / rows), "seq_len": 32},
        training={"objective": objective},
    )
    prepared = lr.prepare_data(spec)
    strategy = build(spec, device)
    trained = lr.train(spec, strategy, prepared, checkpoints=False)
    lr.release(strategy)
    steps = trained.steps
    shown = ("margin", "accuracy") if objective == "reward" else ("kl", "rewards/margins")
    print(
        f"\n[{objective} {strategy_name}/{finetune}] "
        + ", ".join(
            f"step {k}: loss {m['loss']:.6f} " + " ".join(f"{n} {m.get(n, float('nan')):.3e}" for n in shown)
            for k, m in sorted(steps.items())
        )
    )
    assert sorted(steps) == [1, 2, 3] and finite(trained.losses)
    if objective == "kto":
        exact = not CUDA and finetune == "lora"  # as in test_dpo_steps
        assert abs(steps[1]["loss"] - 0.5) <= (1e-6 if exact else 2e-3), steps[1]
    assert steps[3]["loss"] != steps[1]["loss"]


# ------------------------------------------------------------------ more than one rank
@pytest.mark.skipif(
    DEVICE is None or lr.device_count(DEVICE) < 2, reason="needs 2 GPUs (or the CPU mode's 2 gloo ranks)"
)
def test_two_ranks_fsdp2_resume(assets, storage, bf16_model, device):
    """fsdp2 full fine-tuning sharded over 2 ranks (one process per GPU, NCCL): each rank loads its
    slices; a fresh pair of ranks restored from step 2 gives step 3's loss bit for bit."""
    spec = job(assets, storage, bf16_model, "two-ranks", "fsdp2", "full", scaling={"num_workers": 2})
    prepared = lr.prepare_data(spec)
    result = lr.spawn(lr.resume_case, 2, DEVICE, spec.model_dump_json(), prepared)
    first, resumed = ({int(k): v for k, v in r.items()} for r in (result["first"], result["resumed"]))
    print(f"\n[2 ranks] loaded {result['loaded_by']}; uninterrupted {first}, resumed {resumed}")
    assert result["loaded_by"] == "sharded"
    assert sorted(first) == [1, 2, 3, 4] and finite(first)
    assert resumed[3] == first[3]


@pytest.mark.skipif(
    DEVICE is None or lr.device_count(DEVICE) < 2, reason="needs 2 GPUs (or the CPU mode's 2 gloo ranks)"
)
@pytest.mark.parametrize("finetune", ["lora", "full"])
def test_two_ranks_sequence_and_tensor_parallel_train_as_data_parallel(assets, storage, bf16_model, device, finetune):
    """sp=2 (Ulysses' all-to-all over NCCL) and tp=2 (DTensor layers) on 2 ranks give dp=2's
    losses, within the rounding of another reduction order: fp32's on CPU, bf16's on a GPU."""
    specs = [
        job(
            assets,
            storage,
            bf16_model,
            f"mesh-{finetune}",
            "fsdp2",
            finetune,
            steps=3,
            scaling={"num_workers": 2, **mesh},
        )
        for mesh in ({}, {"sequence_parallel": 2}, {"tensor_parallel": 2})
    ]
    prepared = lr.prepare_data(specs[0])
    result = {
        k: {int(s): v for s, v in losses.items()}
        for k, losses in lr.spawn(lr.mesh_case, 2, DEVICE, [s.model_dump_json() for s in specs], prepared).items()
    }
    print(f"\n[mesh {finetune}] {result}")
    base = result["sp1-tp1"]
    assert sorted(base) == [1, 2, 3] and finite(base)
    # LoRA keeps the bf16 base frozen in bf16, so tp's row-wise partial sums round in bf16 even on CPU.
    tol = 2e-2 if CUDA else (1e-4 if finetune == "lora" else 1e-5)
    for key in ("sp2-tp1", "sp1-tp2"):
        assert max(abs(result[key][s] - base[s]) / base[s] for s in base) <= tol, (key, result[key], base)


def test_packed_rows_attention_gradients_are_finite_where_cudnn_returns_nan(device):
    """pytorch#196678's input (704 positions, every logit ~ -120, so each row's logsumexp is below
    ln(FLT_MAX)'s negative) through raytrain's attention with a packed rows' mask, in bf16: the
    gradients are finite and equal the fp32 MATH kernel's to bf16 precision. On an H100 with
    torch 2.11, SDPA's default (cuDNN) returns NaN grad_q for it; raytrain keeps masks off cuDNN."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention

    from raytrain.model import attention

    length, dim = 704, 64
    config = LlamaConfig(hidden_size=2 * dim, num_attention_heads=2, num_key_value_heads=2)
    config._attn_implementation = "sdpa"
    module = LlamaAttention(config, layer_idx=0).to(device)
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, length, dim, generator=generator) for _ in range(3))
    q, k = q * 0.1, k * 0.1
    q[..., 0], k[..., 0] = 1.0, -120 * math.sqrt(dim)
    positions = torch.cat([torch.arange(300), torch.arange(length - 300)])[None]  # two documents in one row
    boundaries = attention.Boundaries.of(positions)
    dtype = torch.bfloat16 if CUDA else torch.float32
    masks = attention.model_kwargs(boundaries, "sdpa", (None,), device, dtype)["raytrain_masks"]
    upstream = torch.randn(1, length, 2, dim, generator=generator).to(device)

    def grads(dtype, reference=False):
        leaves = [t.to(device, dtype).requires_grad_() for t in (q, k, v)]
        if reference:  # the plain math kernel, fp32: what the gradients are
            with sdpa_kernel([SDPBackend.MATH]):
                out, _ = attention.attend(module, *leaves, inner="sdpa", split=None, raytrain_masks=masks)
        else:  # the product's own choice of kernel
            out, _ = attention.attend(module, *leaves, inner="sdpa", split=None, raytrain_masks=masks)
        assert out.isfinite().all()
        out.float().backward(upstream)
        return [t.grad.float() for t in leaves]

    got, want = grads(dtype), grads(torch.float32, reference=True)
    for name, g, w in zip("qkv", got, want):
        assert g.isfinite().all(), f"grad_{name} has {(~g.isfinite()).sum()} non-finite values"
        assert (g - w).norm() <= 3e-2 * w.norm() + 1e-6, f"grad_{name} off by {(g - w).norm() / w.norm():.3g}"


@pytest.mark.parametrize("window", [None, 100])
def test_packed_rows_run_torchs_varlen_kernel_with_the_masked_kernels_values(device, window):
    """On a GPU in bf16, sdpa over packed rows (and a sliding window) runs torch's varlen flash kernel
    with no mask (kernels.py): outputs and gradients equal the fp32 MATH kernel's under raytrain's
    masks to bf16 precision, with grouped key/value heads. In the suite's CPU mode the kernel is
    tests/varlen.py's reference of torch's calling convention."""
    import varlen
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention

    from raytrain.model import attention, kernels

    if not CUDA:
        varlen.install_torch_varlen()
    rows, length, dim = 2, 512, 64
    config = LlamaConfig(hidden_size=4 * dim, num_attention_heads=4, num_key_value_heads=2)
    config._attn_implementation = "sdpa"
    module = LlamaAttention(config, layer_idx=0).to(device)
    dtype = torch.bfloat16 if CUDA else torch.float32
    windows = (window,)
    kernel = kernels.attention_kernel("sdpa", device, dtype, config.to_dict(), windows)
    assert kernel == kernels.VARLEN_NAME, kernel
    positions = torch.stack(
        [
            torch.cat([torch.arange(60, 260), torch.arange(length - 200)]),  # mid-document start
            torch.cat([torch.arange(300), torch.arange(length - 300)]),
        ]
    )
    boundaries = attention.Boundaries.of(positions)
    fast = attention.model_kwargs(boundaries, kernel, windows, device, dtype)
    masked = attention.model_kwargs(boundaries, "sdpa", windows, device, torch.float32)
    assert "raytrain_masks" not in fast and "raytrain_masks" in masked
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(rows, 4, length, dim, generator=generator)
    k, v = (torch.randn(rows, 2, length, dim, generator=generator) for _ in range(2))
    upstream = torch.randn(rows, length, 4, dim, generator=generator).to(device)

    def run(kwargs, dtype, reference=False):
        leaves = [t.to(device, dtype).requires_grad_() for t in (q, k, v)]
        with sdpa_kernel([SDPBackend.MATH]) if reference else contextlib.nullcontext():
            out, _ = attention.attend(
                module, *leaves, inner="sdpa", split=None, sliding_window=window, scaling=module.scaling, **kwargs
            )
        out.float().backward(upstream)
        return [out.float()] + [t.grad.float() for t in leaves]

    try:
        got, want = run(fast, dtype), run(masked, torch.float32, reference=True)
    finally:
        varlen.install_torch_varlen(False)
    for name, g, w in zip(("out", "grad_q", "grad_k", "grad_v"), got, want):
        assert g.isfinite().all(), f"{name} has {(~g.isfinite()).sum()} non-finite values"
        assert (g - w).norm() <= 3e-2 * w.norm() + 1e-6, f"{name} off by {(g - w).norm() / w.norm():.3g}"


# ------------------------------------------------------------------ QLoRA
def test_qlora_trains_resumes_and_exports_its_adapter(assets, storage, bf16_model, device, tmp_path):
    """fsdp2 over an NF4 base quantized from the bf16 files: 4 steps whose losses stay within 2% of
    LoRA's on the same rows, a rank's 4-bit base at most 0.3 of its bf16 share, step 3 again bit
    for bit from step 2's checkpoint (the base rebuilt from the files), and the in-job export (the
    adapter alone) equal to the offline export of the last checkpoint."""
    from raytrain.model import qlora
    from raytrain.rundir.job_file import write_job_file
    from raytrain.train.export import export_checkpoint

    losses = {}
    for finetune in ("lora", "qlora"):
        spec = job(assets, storage, bf16_model, f"run-fsdp2-{finetune}-nf4", "fsdp2", finetune)
        prepared = lr.prepare_data(spec)
        write_job_file(spec)
        strategy = build(spec, device)
        if finetune == "qlora":
            held, elements = qlora.held_bytes(strategy.hf_model)
            assert held / (2 * elements) <= 0.3, held / elements
        losses[finetune] = lr.train(spec, strategy, prepared).losses
        if finetune == "qlora":
            lr.export(spec, strategy, str(tmp_path / "final_model"))
        lr.release(strategy)
        del strategy
    assert finite(losses["qlora"]) and all(rel(losses["qlora"][s], losses["lora"][s]) <= 0.02 for s in losses["lora"])
    export_checkpoint(spec.run_dir, str(tmp_path / "offline"))
    a, b = export_tensors(tmp_path / "final_model"), export_tensors(tmp_path / "offline")
    assert a.keys() == b.keys() and a and all(torch.equal(a[k], b[k].to(a[k].dtype)) for k in a)
    again = build(spec, device)
    resumed = lr.train(spec, again, prepared, state=lr.restore(again, step=2))
    lr.release(again)
    assert resumed.losses[3] == losses["qlora"][3]
