"""TRL's arm of `python -m benchmarks.gpu`: `SFTTrainer` on the same model, the same documents and
the same device, in a process of its own, as a TRL user runs it (issue #50's side-by-side).

Its settings are TRL's best for this job that run without a network: packed rows (`packing=True`,
best-fit decreasing) trained padding-free (TRL turns it on with bfd packing: a flat batch with
position ids, which transformers' sdpa masks per document, as raytrain's packed rows are), bf16,
fused AdamW where CUDA has it (transformers' default there), LoRA on every linear layer of the
blocks (raytrain's default targets) at the same rank and alpha, and Liger's fused kernels when
`liger-kernel` imports on CUDA. Its tokens/s counts the tokens it trained (`num_input_tokens_seen`:
bfd's rows are not always full), over the same measured steps after the same warm-up; its MFU uses
raytrain's accounting (telemetry.flops_per_token) of its own model.
"""

from __future__ import annotations

import json
import time
from pathlib import Path


def liger_available() -> bool:
    try:
        import liger_kernel  # noqa: F401
    except Exception:
        return False
    return True


def run(a, case: str, model: Path, data: Path, work: Path) -> dict:
    import datasets
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from raytrain.train import telemetry

    finetune = case.split("-", 1)[1]
    cuda = not a.cpu
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    texts = [json.loads(line)["text"] for line in data.read_text().splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    started = time.perf_counter()
    net = AutoModelForCausalLM.from_pretrained(
        str(model), dtype=torch.bfloat16 if cuda else torch.float32, attn_implementation=a.attention
    )
    liger = cuda and liger_available()
    config = SFTConfig(
        output_dir=str(work / f"trl-{finetune}"),
        max_steps=a.warmup + a.steps,
        seed=0,
        per_device_train_batch_size=a.micro_batch,
        gradient_accumulation_steps=a.global_batch // a.micro_batch,
        learning_rate=1e-4,
        lr_scheduler_type="constant",
        warmup_steps=0,
        bf16=cuda,
        use_cpu=not cuda,
        packing=True,
        padding_free=True,
        max_length=a.seq_len,
        dataset_text_field="text",
        gradient_checkpointing=a.activation_checkpointing,
        use_liger_kernel=liger,
        include_num_input_tokens_seen=True,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    lora = (
        LoraConfig(
            r=a.lora_rank,
            lora_alpha=2 * a.lora_rank,
            lora_dropout=0.0,
            target_modules="all-linear",
            task_type="CAUSAL_LM",
        )
        if finetune == "lora"
        else None
    )
    ends: list[tuple[float, int]] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if cuda:
                torch.cuda.synchronize(device)
            ends.append((time.perf_counter(), state.num_input_tokens_seen))

    trainer = SFTTrainer(
        model=net,
        args=config,
        train_dataset=datasets.Dataset.from_dict({"text": texts}),
        processing_class=tokenizer,
        peft_config=lora,
        callbacks=[Clock()],
    )
    build_s = time.perf_counter() - started
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    trainer.train()
    (t0, seen0), (t1, seen1) = ends[a.warmup - 1], ends[-1]
    tokens_per_s = (seen1 - seen0) / (t1 - t0)
    trained = trainer.model
    sizes = [(p.numel(), p.requires_grad) for p in trained.parameters()]
    n, trainable = sum(s for s, _ in sizes), sum(s for s, grad in sizes if grad)
    base = trained.get_base_model() if hasattr(trained, "get_base_model") else trained
    per_token = telemetry.flops_per_token(base.config, n, trainable, a.seq_len, finetune == "lora")["flops_per_token"]
    peak = telemetry.peak_flops(device)
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    return {
        "case": case,
        "world": 1,
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "build_s": build_s,
        "measured_steps": len(ends) - a.warmup,
        "step_s": (t1 - t0) / (len(ends) - a.warmup),
        "tokens_per_s": tokens_per_s,
        "flops_per_token": per_token,
        "mfu": tokens_per_s * per_token / peak if peak else None,
        "peak_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
        "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30 if cuda else None,
        "estimate_gib": None,
        "estimate": f"TRL SFTTrainer (liger {'on' if liger else 'off'}, {a.attention})",
        "losses": losses,
    }
