"""The device paths on tensors that are not CPU tensors (tests/stand_in_device.py's stand-in device,
`accel:0`, real values underneath): what fails on a GPU fails here, and every host sync is
counted. One process, a world-1 gloo group; the multi-rank versions of these paths run on CPU
tensors in test_loading / test_strategies, and on a real GPU in tests/gpu."""

from __future__ import annotations

import ast
import math
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import REPO, free_port, make_job
from stand_in_device import DEVICE, FakeAccelerator

from raytrain.model import hub, modeling


@pytest.fixture(scope="module")
def group():
    """A world-1 gloo process group in this process (the strategies' collectives run for real)."""
    if not dist.is_initialized():
        # gloo for the stand-in device too (it reduces the host copies): NCCL's place on a GPU
        dist.init_process_group(
            f"cpu:gloo,{DEVICE.type}:gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
        )
    yield
    dist.destroy_process_group()


def files_state(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_weights_are_read_into_device_shards_through_a_bounded_host_buffer(split_model, monkeypatch, dtype):
    # The first GPU job crashed here: the file's dtype equalled the target's, so the read went
    # straight into the device shard through `.numpy()`. Now: a reused host buffer, a chunk of
    # rows at a time (32 bytes here: every weight takes several chunks).
    from raytrain.strategies import weights

    monkeypatch.setattr(weights, "READ_BUFFER_BYTES", 32)
    expected = files_state(split_model)
    files = weights.WeightFiles(split_model)
    with FakeAccelerator() as accel:
        for key, value in expected.items():
            target = torch.empty(value.shape, dtype=dtype, device=DEVICE)
            files.read_rows(key, 0, value.shape[0], target)
            assert target.device == DEVICE and torch.equal(target.cpu(), value.to(dtype)), key
            half = value.shape[0] // 2
            if half:  # rows [half, end) into a narrowed view, as a shard's slice is filled
                part = torch.zeros(value.shape, dtype=dtype, device=DEVICE)
                files.read_rows(key, half, value.shape[0] - half, part.narrow(0, half, value.shape[0] - half))
                assert torch.equal(part.cpu()[half:], value[half:].to(dtype)) and not part.cpu()[:half].any(), key
    assert files.buffer.numel() <= 32 or files.buffer.numel() == max(
        v[0].numel() * v.dtype.itemsize for v in expected.values() if v.dim()
    )
    assert all(s.kind == "copy" for s in accel.syncs)  # only the test's own .cpu() reads


def test_fsdp2_sharded_read_fills_device_targets_as_from_pretrained(assets, split_model, tmp_path):
    # DCP's planning over the safetensors files, the slice reader and the bf16 -> fp32 master
    # staging, all into device tensors (world 1: each target is the whole weight).
    from raytrain.strategies import weights

    spec = make_job(
        assets, tmp_path, model={"path": str(split_model), "dtype": "bfloat16"}, training={"finetune": "full"}
    )
    reference = modeling.load_model(spec).state_dict()
    with FakeAccelerator():
        targets = {k: torch.empty(v.shape, dtype=torch.float32, device=DEVICE) for k, v in reference.items()}
        weights.read_slices(split_model, {k: targets[k] for k in files_state(split_model)}, torch.bfloat16)
        got = {k: t.cpu() for k, t in targets.items()}
    differ = [k for k in files_state(split_model) if not torch.equal(got[k], reference[k].float())]
    assert not differ, differ[:3]


def test_rank0_fallback_and_restore_fill_device_models(group, assets, split_model, tmp_path):
    # A model whose files do not fit the sharded read is broadcast from rank 0's load; a restore
    # reads a signed checkpoint into the device state. Both into device tensors.
    import torch.distributed.checkpoint as dcp

    from raytrain.rundir import signing
    from raytrain.strategies import weights
    from raytrain.strategies.dcp_files import read_checkpoint

    spec = make_job(
        assets, tmp_path, model={"path": str(split_model), "dtype": "bfloat16"}, training={"finetune": "full"}
    )
    reference = modeling.load_model(spec).state_dict()
    step = tmp_path / "step_00000004"
    trained = {k: v + 1 for k, v in reference.items()}
    dcp.save({"model": trained}, checkpoint_id=str(step), no_dist=True)
    signing.sign_checkpoint(str(step), spec.run_dir, step.name)
    with FakeAccelerator():
        model = modeling.load_model(spec, on_meta=True).to_empty(device=DEVICE)
        modeling.init_buffers(model)
        weights.broadcast_from_rank0(spec, model)
        loaded = {k: v.cpu() for k, v in model.state_dict().items()}
        state = {"model": {k: torch.empty_like(v, device=DEVICE) for k, v in reference.items()}}
        with signing.SignedCheckpoint(str(step), spec.run_dir, step.name) as checkpoint:
            read_checkpoint(state, checkpoint)
        restored = {k: v.cpu() for k, v in state["model"].items()}
    assert all(torch.equal(loaded[k], reference[k]) for k in reference)
    assert all(torch.equal(restored[k], trained[k]) for k in reference)


class DeviceStrategy:
    """The product's TorchStrategy with the model on the device and no wrapper (world 1 needs no
    gradient reduction): the loop, the objectives, AdamW and clipping run as in every strategy."""

    @staticmethod
    def build(spec, device):
        from raytrain.job.plan import RunPlan
        from raytrain.strategies.base import TorchStrategy, to_fp32_master

        class Plain(TorchStrategy):
            def wrap(self, model):
                to_fp32_master(model)
                return model.to(self.device)

            def backward(self, loss, sync):
                loss.backward()

        strategy = Plain(spec, device, RunPlan.of(spec))
        strategy.setup()
        return strategy


@pytest.mark.parametrize("objective", ["sft", "dpo"])
def test_a_step_syncs_the_host_once_and_matches_the_cpu_step(group, assets, tmp_path, objective):
    # Each micro-batch used to read its loss and metrics with float(): a host sync per micro-batch
    # (and one for the batch's units, one for the grad norm). Now one per optimizer step, and the
    # values are the CPU run's.
    from raytrain.train.loop import train_step

    data = {"path": str(assets / "pairs.jsonl")} if objective == "dpo" else {}
    spec = make_job(
        assets,
        tmp_path,
        data=data,
        training={"finetune": "full", "objective": objective, "precision": "fp32", "micro_batch_size": 2},
    )
    batch = micro_batches(spec, 4)
    results, syncs = on_cpu_and_device(
        spec, lambda strategy, objective, stops: [train_step(strategy, objective, batch, 1e-3, stops) for _ in range(3)]
    )
    # One a step, raytrain's, host-to-device copies counted: every micro-batch (ids, positions,
    # targets, DPO's counts) is uploaded from pinned memory without waiting (before: 4 pageable
    # uploads per micro-batch, and transformers read the device once per forward to learn whether
    # the position ids pack documents, masking_utils.find_packed_sequence_indices; attention.py
    # now tells it from the host rows).
    assert [s.where for s in syncs["device"]] == ["train/loop.py:host_values"] * 3, syncs["device"]
    # The same kernels on the host copies; clipping's norm groups tensors by device (a foreach
    # kernel on CPU, per tensor elsewhere), so fp32 rounding may differ in the last bits.
    for cpu, device in zip(results["cpu"], results["device"]):
        assert cpu.loss == device.loss or math.isclose(cpu.loss, device.loss, rel_tol=1e-5)
        assert math.isclose(cpu.grad_norm, device.grad_norm, rel_tol=1e-5)
        assert all(math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-6) for a, b in zip(cpu.means, device.means))
    assert results["cpu"][0].loss == results["device"][0].loss  # before any update: bit for bit
    assert results["cpu"][2].loss < results["cpu"][0].loss


def test_a_grpo_step_rolls_out_scores_and_trains_on_the_device_as_on_the_cpu(group, assets, tmp_path):
    # GRPO's step on the device: the rollout's prompts, keys and sampler, the advantages, the training
    # rows. Its host reads are the ones it names: the ranks' "all ended?" every CHECK tokens, the
    # completions for the rewards, and the step's one read. The same completions (rewards) as on
    # the CPU, and the same loss.
    import collections

    import mesh_cases

    from raytrain.data.batches import micro_batches as product_micro_batches
    from raytrain.train.loop import train_step

    spec = make_job(
        assets,
        tmp_path,
        data={"path": str(assets / "prompts.jsonl"), "format": "prompt", "seq_len": 64},
        training={
            "objective": "grpo",
            "finetune": "full",
            "precision": "fp32",
            "micro_batch_size": 2,
            "global_batch_size": 4,
            "grpo": mesh_cases.GRPO,
        },
    )
    rows = mesh_cases.grpo_rows(str(assets / "model"), 4, seq=64)
    batch = product_micro_batches([mesh_cases._Rows(rows)], [(0, r) for r in range(4)], 2)

    def steps(strategy, objective, stops):
        out = []
        for step in range(2):
            objective.at(step, [(0, 0, r) for r in range(4)])
            out.append(
                (train_step(strategy, objective, [dict(mb) for mb in batch], 1e-2, stops), objective.host["reward"])
            )
        return out

    both, syncs = on_cpu_and_device(spec, steps)
    results = {where: [r for r, _ in out] for where, out in both.items()}
    rewards = {where: [w for _, w in out] for where, out in both.items()}
    # raytrain's own: per rollout (2 a step) its 4 small uploads (prompts, mask, keys, end tokens) and the
    # completions' read, per step the one read; none per decoded token (CHECK = 8 tokens: no "all ended?"
    # before the 8th). transformers' sdpa mask reads the padding mask once per forward (fast_all in
    # masking_utils._ignore_causal_mask_sdpa), as in its own generate: 1 prefill + 7 decode forwards a rollout.
    ours = collections.Counter((s.kind, s.where) for s in syncs["device"] if s.origin == "raytrain")
    assert ours == {
        ("upload", "rl/sampling.py:rollout"): 16,
        ("copy", "rl/sampling.py:rollout"): 4,
        ("copy", "train/loop.py:host_values"): 2,
    }, ours
    theirs = collections.Counter((s.kind, s.origin) for s in syncs["device"] if s.origin != "raytrain")
    assert theirs[("scalar", "transformers")] == 2 * 2 * 8, theirs
    assert rewards["device"] == rewards["cpu"] and len(set(rewards["cpu"])) == 2, rewards
    for cpu, device in zip(results["cpu"], results["device"]):
        assert math.isclose(cpu.loss, device.loss, rel_tol=1e-5, abs_tol=1e-7)
        assert math.isclose(cpu.grad_norm, device.grad_norm, rel_tol=1e-5) and cpu.grad_norm > 0


def test_a_step_with_non_finite_gradients_changes_nothing(group, assets, tmp_path):
    # The first GPU benchmark applied NaN gradients (a packed row's lone zero-embedding token: its
    # gradient grows ~100x a layer through RMSNorm's 1/sqrt(eps) and overflows by layer 8 of 16)
    # and trained NaN from then on. Now such a step is skipped: afterwards the model and AdamW are
    # exactly a run that never saw it, and the step still syncs the host once.
    from raytrain import objectives
    from raytrain.train.loop import train_step
    from raytrain.train.preemption import StopSignals

    spec = make_job(assets, tmp_path, training={"finetune": "full", "precision": "fp32", "micro_batch_size": 2})
    bad, good = micro_batches(spec, 2), micro_batches(spec, 4)[2:]
    runs = {}
    for name, batches in (("skipped first", [bad, good]), ("clean", [good])):
        torch.manual_seed(0)
        with FakeAccelerator() as accel:
            strategy = DeviceStrategy.build(spec, DEVICE)
            objective, stops = objectives.build(spec), StopSignals(None, check_ray_notice=False)
            weight = strategy.params[0]
            before = len(accel.syncs)
            results = []
            for i, batch in enumerate(batches):
                hook = weight.register_hook(lambda g: g * float("nan")) if batch is bad else None
                results.append(train_step(strategy, objective, batch, 1e-3, stops))
                if hook:
                    hook.remove()
                    assert not any(p.grad is not None for p in strategy.params)  # zeroed for the next step
            assert [s.where for s in accel.syncs[before:]] == ["train/loop.py:host_values"] * len(batches)
            runs[name] = (
                results,
                {k: v.cpu() for k, v in strategy.model.state_dict().items()},
                [int(s["step"]) for s in strategy.optimizer.state.values()],
            )
    (skipped, applied), clean = runs["skipped first"][0], runs["clean"][0][0]
    assert not skipped.applied and math.isnan(skipped.grad_norm) and math.isfinite(skipped.loss)
    assert applied.applied and clean.applied and applied.loss == clean.loss and applied.grad_norm == clean.grad_norm
    assert runs["skipped first"][2] == runs["clean"][2] == [1] * len(runs["clean"][2])  # AdamW's step counts
    assert all(torch.equal(v, runs["clean"][1][k]) for k, v in runs["skipped first"][1].items())


def test_skipped_updates_stop_the_job_at_the_limit():
    from raytrain.errors import JobError
    from raytrain.train.loop import SkippedUpdates

    policy = SkippedUpdates()
    for step in range(1, 20):  # a skipped step now and then never stops it
        assert policy.record(step, applied=step % SkippedUpdates.LIMIT != 0) == (step % SkippedUpdates.LIMIT == 0)
        policy.check()
    for step in range(20, 20 + SkippedUpdates.LIMIT - 1):
        policy.record(step, applied=False)
        policy.check()
    policy.record(99, applied=False)
    with pytest.raises(JobError, match=r"diverged: the gradients were not finite at steps 20-99, 5 in a row"):
        policy.check()


def test_evaluation_syncs_once(group, assets, tmp_path):
    from raytrain import objectives

    spec = make_job(assets, tmp_path, training={"finetune": "full", "precision": "fp32"})
    batch = micro_batches(spec, 3)
    with FakeAccelerator() as accel:
        strategy = DeviceStrategy.build(spec, DEVICE)
        before = len(accel.syncs)
        metrics = objectives.evaluate(strategy, objectives.build(spec), batch)
        assert [s.where for s in accel.syncs[before:] if s.origin == "raytrain"] == ["objectives/__init__.py:evaluate"]
    assert 0 < metrics["eval_loss"] < 20


def test_telemetry_reads_the_accelerator_without_a_sync(group, assets, tmp_path):
    from raytrain.train import telemetry

    spec = make_job(assets, tmp_path, training={"finetune": "full"})
    with FakeAccelerator() as accel:
        strategy = DeviceStrategy.build(spec, DEVICE)
        before = len(accel.syncs)
        peak = telemetry.peak_memory_gb(DEVICE)
        flops = telemetry.StepFlops(strategy.model, spec, DEVICE).metrics(1000.0, 1)
        assert len(accel.syncs) == before
        weights_bytes = sum(p.numel() * p.element_size() for p in strategy.model.parameters())
    assert peak * 2**30 >= weights_bytes  # the model's weights are on the device
    assert 0 < flops["mfu"] < 1e-6  # an H100's peak, 1000 tokens/s


def test_full_export_from_device_weights_loads_with_from_pretrained(group, assets, tmp_path):
    from transformers import AutoModelForCausalLM

    spec = make_job(assets, tmp_path, training={"finetune": "full"}, model={"dtype": "bfloat16"})
    with FakeAccelerator():
        strategy = DeviceStrategy.build(spec, DEVICE)
        with torch.no_grad():
            for p in strategy.model.parameters():
                p.add_(0.01)  # "trained": fp32 masters that bf16 must round
        expected = {k: v.cpu() for k, v in strategy.hf_model.state_dict().items()}
        strategy.export(str(tmp_path / "out"), hub.load_tokenizer(spec))
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    assert (
        exported.dtype == torch.bfloat16
        and exported.config.tie_word_embeddings == strategy.hf_model.config.tie_word_embeddings
    )
    got = exported.state_dict()
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], v.to(torch.bfloat16)) for k, v in expected.items())


# --- the rule: no host read of a device tensor outside the places named for it ---
HOST_READS = re.compile(r"(?<![.\w])float\((?![\"'])|\.(numpy|tolist|item)\(\)")


def test_every_host_read_in_the_product_is_named():
    """`.numpy()`, `.tolist()`, `.item()` and `float(...)` of a tensor sync the host with the device
    (or, `.numpy()`, fail on one). Each in raytrain/ says in its line's comment why it may:
    `host: ...` (a CPU tensor, a config value, once per evaluation, the step's one sync). A new
    one without a reason fails here; test_a_step_syncs_the_host_once checks the count."""
    unnamed = []
    for path in sorted((REPO / "raytrain").rglob("*.py")):
        text = path.read_text()
        lines = text.splitlines()
        statements = [(n.lineno, n.end_lineno) for n in ast.walk(ast.parse(text)) if isinstance(n, ast.stmt)]
        for number, line in enumerate(lines, 1):
            code, _, _ = line.partition("#")
            if not HOST_READS.search(code):
                continue
            # The reason may sit on any line of the statement the read is in (the formatter wraps long ones).
            first, last = min((s for s in statements if s[0] <= number <= s[1]), key=lambda s: s[1] - s[0])
            if not any("host:" in ln.partition("#")[2] for ln in lines[first - 1 : last]):
                unnamed.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert not unnamed, "host reads without a `# host:` reason:\n" + "\n".join(unnamed)


def micro_batches(spec, count: int) -> list[dict]:
    """`count` micro-batches shaped as data/batches.py makes them (a preference micro-batch: its
    chosen sequences, then its rejected ones), of random tokens with an unlabelled prompt."""
    from raytrain.data import IGNORE

    g = torch.Generator().manual_seed(1)
    rows = spec.training.micro_batch_size * spec.sequences_per_row
    n, vocab = spec.data.seq_len, hub.load_tokenizer(spec).vocab_size
    out = []
    for _ in range(count):
        ids = torch.randint(0, vocab, (rows, n), generator=g)
        labels = ids.clone()
        labels[:, : n // 4] = IGNORE
        out.append({"input_ids": ids, "labels": labels, "position_ids": torch.arange(n)[None].repeat(rows, 1)})
    return out


def on_cpu_and_device(spec, run) -> tuple[dict, dict]:
    """`run(strategy, objective, stops)` on the CPU and on the stand-in device, each from seed 0 with
    the product's strategy and objective: ({where: its result}, {where: the host syncs it made})."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from raytrain import objectives
    from raytrain.train.preemption import StopSignals

    results, syncs = {}, {}
    for where in ("cpu", "device"):
        torch.manual_seed(0)
        # sdpa on the stand-in device is torch's math path (a PrivateUse1 device has no fused
        # kernel), on CPU tensors its CPU flash kernel: the CPU arm runs the math path too, so the
        # two compute with the same kernels (what a GPU fuses is tests/gpu's to check).
        with FakeAccelerator() if where == "device" else sdpa_kernel(SDPBackend.MATH) as entered:
            accel = entered if where == "device" else None
            strategy = DeviceStrategy.build(spec, DEVICE if where == "device" else torch.device("cpu"))
            before = len(accel.syncs) if accel else 0
            results[where] = run(strategy, objectives.build(spec), StopSignals(None, check_ray_notice=False))
            syncs[where] = accel.syncs[before:] if accel else []
    return results, syncs
