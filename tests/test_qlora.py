"""QLoRA (raytrain/model/qlora.py): the NF4 base each rank quantizes from its own rows against torchao's
quantizer of the whole weight (the same bytes for any number of ranks); then the product's runs on
Ray: 30 steps against LoRA's on the same rows, a resume at another worker count, the exported
adapter on the original base, and the share of the 4-bit base a rank holds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from raytrain.job import nf4_layout
from raytrain.model import qlora

nf4 = pytest.importorskip("torchao.quantization.quantize_.workflows.nf4.nf4_tensor")


def per_rank(weight: torch.Tensor, ranks: int) -> list[dict]:
    """What `qlora.fill` gives each of `ranks` ranks: its rows quantized on their own, with the
    whole weight's scale mean from every rank's sums (the all-reduce, summed here)."""
    parts = [qlora.codes_and_scales(rows) for rows in weight.chunk(ranks)]
    total = sum(scales.double().sum() for _, scales in parts) / sum(scales.numel() for _, scales in parts)
    mean = total.to(weight.dtype)
    group = nf4_layout.group_size(weight.shape[1])
    out = []
    for codes, scales in parts:
        quantized, factor = qlora.quantize_scales(scales, mean, group)
        out.append(
            {
                "quantized_data": codes,
                "quantized_scalers": quantized,
                "quantization_factor": factor,
                "scaler_mean": mean,
            }
        )
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(512, 4096), (96, 192), (64, 64)])  # a real row, the demo model's MLP and attention
def test_each_ranks_rows_quantize_to_the_bytes_of_the_whole_weight(shape, dtype):
    torch.manual_seed(0)
    weight = (torch.randn(shape) * 0.02).to(dtype)
    whole = nf4.to_nf4(weight, nf4_layout.BLOCK, nf4_layout.group_size(shape[1]))
    for ranks in (1, 2, 4):
        parts = per_rank(weight, ranks)
        for name in ("quantized_data", "quantized_scalers", "quantization_factor"):
            got = torch.cat([p[name] for p in parts])
            assert torch.equal(got, getattr(whole, name)), f"{shape} {dtype} {ranks} ranks: {name} differs"
        assert torch.equal(parts[0]["scaler_mean"], whole.scaler_mean)
    # and the 4 bits are NF4's: the dequantized weight is within a block's absmax / 8 of the original
    back = whole.get_original_weight().float()
    assert (back - weight.float()).abs().max() <= weight.float().abs().max() / 8


def test_a_4096_wide_weight_holds_about_a_quarter_of_bf16():
    # codes 0.5 B, an int8 scale a block (1/64 B), a 2-byte factor a group of 64 blocks (QLoRA's 256
    # where a row holds 256 blocks): 0.5161 B a weight, 0.258 of bf16's 2
    assert nf4_layout.quantized_bytes(4096, 4096) / (2 * 4096 * 4096) == pytest.approx(0.2581, abs=1e-4)
    assert nf4_layout.group_size(4096) == 64 and nf4_layout.group_size(16384) == 256 and nf4_layout.group_size(192) == 1


def test_shapes_that_cannot_be_sharded_are_named():
    shapes = {"model.layers.0.self_attn.k_proj": (32, 64), "model.layers.0.mlp.down_proj": (64, 192), "odd": (64, 100)}
    assert nf4_layout.shard_problems(shapes, 2) == ["odd (64x100): its rows are not whole blocks of 64 weights"]
    assert nf4_layout.shard_problems({"model.layers.0.mlp.down_proj": (64, 192)}, 3) == [
        "model.layers.0.mlp.down_proj (64x192): 64 rows do not split evenly over 3 workers"
    ]


# ------------------------------------------------------------------ the product's runs (Ray)
STEPS, EVERY = 30, 10


def qjob(assets, storage, finetune, name, **over):
    from conftest import make_job

    return make_job(
        assets,
        storage,
        name=name,
        training={"strategy": "fsdp2", "finetune": finetune, "max_steps": STEPS, **over.pop("training", {})},
        optimizer={"lr": 3e-3, "warmup_steps": 2, "schedule": "constant"},
        checkpoint={"every_n_steps": EVERY, "keep_last": 3},
        **over,
    )


@pytest.fixture(scope="module")
def runs(ray_address, assets, tmp_path_factory):
    """The demo model trained 30 steps on the same rows with LoRA and with QLoRA (fsdp2, 2 workers)."""
    from conftest import metric_history

    from raytrain.driver import launcher

    out = {}
    for finetune in ("lora", "qlora"):
        spec = qjob(assets, tmp_path_factory.mktemp(finetune), finetune, f"q-{finetune}")
        out[finetune] = spec, metric_history(spec, launcher.run(spec).run_id)
    return out


@pytest.mark.slow
def test_qlora_trains_within_two_percent_of_lora_and_exports_a_plain_adapter(runs, assets):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    (_, lora), (spec, qlora_losses) = runs["lora"], runs["qlora"]
    assert sorted(qlora_losses) == list(range(1, STEPS + 1))
    assert qlora_losses[STEPS] < qlora_losses[1] - 0.3, qlora_losses  # it learns
    # ...on the 4-bit base: at step 1 (the adapter still zero) the loss is the NF4 base's, not the
    # original's that LoRA sees (fp32 reduction order alone moves it by ~1e-7 relative)
    assert abs(qlora_losses[1] - lora[1]) > 1e-5 * lora[1], (qlora_losses[1], lora[1])
    print(
        f"\n[qlora] step {STEPS} loss: qlora {qlora_losses[STEPS]:.6f}, lora {lora[STEPS]:.6f}, "
        f"{qlora_losses[STEPS] / lora[STEPS] - 1:+.3%}"
    )
    assert abs(qlora_losses[STEPS] - lora[STEPS]) <= 0.02 * lora[STEPS], (qlora_losses[STEPS], lora[STEPS])
    # the export is the adapter alone, which plain peft loads on the original (unquantized) base
    export = Path(spec.run_dir) / "final_model"
    assert (export / "adapter_model.safetensors").is_file() and not list(export.glob("model*.safetensors"))
    base = AutoModelForCausalLM.from_pretrained(str(assets / "model"))
    model = PeftModel.from_pretrained(base, str(export))
    trained = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert trained and all(p.abs().sum() > 0 for p in trained)


@pytest.mark.slow
def test_qlora_resumes_at_another_worker_count_on_the_same_base(runs, assets):
    """The step-20 checkpoint (the adapter and its AdamW state; never the base) continued by one
    worker, which quantizes the whole base itself: the same NF4 bytes as the two workers' halves
    (test_each_ranks_rows_quantize_to_the_bytes_of_the_whole_weight), so steps 21-30 are the
    uninterrupted run's, to the reduction order's rounding (as a LoRA resize)."""
    from conftest import metric_history, without_checkpoint

    from raytrain.driver import launcher

    spec, reference = runs["qlora"]
    with without_checkpoint(spec.run_dir, STEPS) as storage:
        resized = qjob(assets, storage, "qlora", spec.name, scaling={"num_workers": 1})
        losses = metric_history(resized, launcher.run(resized).run_id)
    print(
        "\n[qlora] resumed at 1 worker, steps 21-30, worst relative difference:",
        max(abs(losses[k] / reference[k] - 1) for k in range(2 * EVERY + 1, STEPS + 1)),
    )
    for step in range(2 * EVERY + 1, STEPS + 1):
        assert abs(losses[step] - reference[step]) <= 1e-5 * abs(reference[step]), (step, losses[step], reference[step])


def _held(rank, world, device, assets, storage):
    from conftest import make_job

    from raytrain.model import qlora
    from raytrain.strategies import build_strategy

    spec = make_job(Path(assets), Path(storage), training={"finetune": "qlora"})
    return qlora.held_bytes(build_strategy(spec, device).hf_model)


@pytest.mark.slow
def test_each_rank_holds_its_share_of_the_4bit_base(assets, tmp_path):
    import sys

    sys.path.insert(0, str(Path(__file__).parent / "gpu"))
    import local_run

    held, elements = local_run.spawn(_held, 2, torch.device("cpu"), str(assets), str(tmp_path))
    # the bytes one rank holds of the adapted layers' weights over their bf16 bytes / 2 ranks: the
    # demo model's rows are 1-3 blocks long, so a group is 1 block (2 bytes more a block than QLoRA's)
    print(f"\n[qlora] a rank's NF4 bytes / its bf16 share: {held / (2 * elements / 2):.3f}")
    assert held / (2 * elements / 2) <= 0.3, held / elements
