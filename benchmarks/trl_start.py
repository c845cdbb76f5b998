"""P0b's TRL arm: `SFTTrainer` on the same model, rows and batch as P2's raytrain job, started as a TRL
user starts it (one process on CPU: `python trl_start.py`), each finished step appended to
$BENCH_STEP_LOG/rank0.jsonl so that the harness times its first step exactly as it times raytrain's.
Its settings are TRL's defaults for this job less the network: the same fine-tune (full, as P2's job;
`--lora-rank` for LoRA on every linear layer), packed rows of seq_len tokens, fp32 on CPU, no
checkpoints, no reports.
It leaves out what raytrain does before its first step that TRL does not: a cluster, sharding over
workers, a token store, MLflow, the lease."""

from __future__ import annotations

import argparse
import json
import os
import time

started = time.time()  # the harness's launch is within milliseconds of this


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--lora-rank", type=int, default=0, help="LoRA on every linear layer; 0: a full fine-tune")
    p.add_argument("--out", required=True)
    a = p.parse_args()

    import datasets
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    step_log = os.environ.get("BENCH_STEP_LOG")
    texts = [json.loads(line)["text"] for line in open(a.data)]
    tokenizer = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model)
    config = SFTConfig(
        output_dir=a.out,
        max_steps=a.steps,
        seed=0,
        per_device_train_batch_size=a.micro_batch,
        gradient_accumulation_steps=a.global_batch // a.micro_batch,
        learning_rate=1e-4,
        use_cpu=True,
        packing=True,
        max_length=a.seq_len,
        dataset_text_field="text",
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    lora = (
        LoraConfig(r=a.lora_rank, lora_alpha=2 * a.lora_rank, target_modules="all-linear", task_type="CAUSAL_LM")
        if a.lora_rank
        else None
    )

    class Steps(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if step_log:
                with open(os.path.join(step_log, "rank0.jsonl"), "a") as f:
                    f.write(json.dumps({"step": state.global_step, "since_start_s": time.time() - started}) + "\n")

    trainer = SFTTrainer(
        model=model,
        args=config,
        train_dataset=datasets.Dataset.from_dict({"text": texts}),
        processing_class=tokenizer,
        peft_config=lora,
        callbacks=[Steps()],
    )
    trainer.train()


if __name__ == "__main__":
    main()
