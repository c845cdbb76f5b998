"""The rules that tie a job's sections together: each a function of the whole JobSpec that raises
ValueError naming the fields and the fix, run in this order by JobSpec's one validator (a job is
refused at the first rule it breaks, as `raytrain validate` shows). Duck-typed: config imports this
module, not the other way round."""

from __future__ import annotations

from raytrain.job import strategies
from raytrain.job.deepspeed_overrides import override_problems
from raytrain.job.grpo import grpo_problems


def every_rank_gets_rows(job) -> None:
    # Any worker count splits a global batch (ranks get ceil or floor of G/N rows), as long
    # as no rank is left without a row.
    lo, hi = job.scaling.worker_range
    gbs, group = job.training.global_batch_size, job.scaling.model_parallel
    if gbs < hi // group:
        what = f"{hi // group} data-parallel ranks ({hi} workers / {group})" if group > 1 else f"{hi} workers"
        raise ValueError(
            f"training.global_batch_size={gbs} is smaller than the {what} the job may run with: "
            f"some ranks would get no rows; use global_batch_size >= {hi // group} or fewer workers"
        )


def deepspeed_block_needs_zero3(job) -> None:
    if job.training.deepspeed is not None and not strategies.of(job).deepspeed_block:
        raise ValueError(
            f"training.deepspeed is only used by strategy zero3, not {job.training.strategy!r}: remove it or set "
            f"training.strategy: zero3"
        )
    problems = override_problems(job)
    if problems:
        raise ValueError("; ".join(problems))


def offload_needs_a_sharded_strategy(job) -> None:
    off = job.training.offload
    if (off.optimizer or off.params) and strategies.of(job).offload is None:
        raise ValueError(
            "training.offload is used by fsdp2 and zero3 only: ddp keeps everything on the device; "
            "set training.strategy: fsdp2 (or zero3), or remove training.offload"
        )
    if off.optimizer != off.params and strategies.of(job).offload == "together":
        one, other = ("optimizer", "params") if off.optimizer else ("params", "optimizer")
        raise ValueError(
            f"training.offload.{one}: fsdp2 offloads parameters, gradients and optimizer state together "
            f"(torch's CPUOffloadPolicy), so {one} alone would also move the {other}; set both "
            f"offload.params and offload.optimizer, or use training.strategy: zero3, which offloads "
            "each on its own"
        )


def preference_settings_fit_the_objective(job) -> None:
    t, p = job.training, job.training.preference
    if t.objective in ("sft", "grpo"):  # GRPO's rules: grpo_fits
        return
    if job.data.train_on_inputs:
        raise ValueError(
            f"data.train_on_inputs: true with training.objective: {t.objective}: a preference pair's "
            "prompt is never trained (only the responses are compared); remove data.train_on_inputs"
        )
    if p.loss == "apo_zero_unpaired" and t.objective != "kto":
        raise ValueError(
            f"training.preference.loss='apo_zero_unpaired' is KTO's unpaired loss, and "
            f"training.objective is {t.objective}: remove it or set training.objective: kto"
        )
    if t.objective in ("simpo", "kto") and p.loss not in ("sigmoid", "apo_zero_unpaired"):
        raise ValueError(
            f"training.preference.loss={p.loss!r} is a DPO loss; {t.objective} has its own: remove "
            "preference.loss or set training.objective: dpo"
        )
    if (p.desirable_weight, p.undesirable_weight) != (1.0, 1.0) and t.objective != "kto":
        raise ValueError(
            "training.preference.desirable_weight / undesirable_weight weigh KTO's labelled rows, and "
            f"training.objective is {t.objective}: remove them or set training.objective: kto"
        )
    if p.center_rewards_coefficient is not None and t.objective != "reward":
        raise ValueError(
            f"training.preference.center_rewards_coefficient centres a reward model's scores, and "
            f"training.objective is {t.objective}: remove it or set training.objective: reward"
        )
    if t.objective == "reward" and job.scaling.tensor_parallel > 1:
        raise ValueError(
            f"training.objective: reward with scaling.tensor_parallel={job.scaling.tensor_parallel}: "
            "the tensor-parallel plan shards the vocabulary output layer, and a reward model's head "
            "is one score: remove scaling.tensor_parallel (sequence parallelism and data "
            "parallelism train reward models)"
        )
    if t.objective == "reward" and t.chunked_loss not in ("auto", False):
        raise ValueError(
            f"training.chunked_loss={str(t.chunked_loss).lower()} with training.objective: reward: "
            "a reward model has no vocabulary logits to chunk (one score a sequence); remove "
            "training.chunked_loss"
        )
    if p.label_smoothing and p.loss != "sigmoid":
        raise ValueError(
            f"training.preference.label_smoothing applies to the sigmoid loss, not {p.loss!r}: "
            "remove it or set preference.loss: sigmoid"
        )


def compile_and_chunked_loss_fit(job) -> None:
    if job.training.compile is True and not strategies.of(job).compiles:
        raise ValueError(
            "training.compile=true compiles decoder blocks under fsdp2 and ddp; ZeRO-3's parameter "
            "hooks break compiled graphs: remove training.compile or set training.strategy: fsdp2"
        )
    if job.training.chunked_loss not in ("auto", False) and not strategies.of(job).head_after_forward:
        raise ValueError(
            f"training.chunked_loss={str(job.training.chunked_loss).lower()} applies the output "
            "layer chunk by chunk after the forward, and ZeRO-3 has partitioned it again by then: remove "
            "training.chunked_loss (auto is off "
            "under zero3) or set training.strategy: fsdp2"
        )
    if type(job.training.chunked_loss) is int and job.training.chunked_loss < 1:
        raise ValueError(
            f"training.chunked_loss={job.training.chunked_loss} tokens a chunk: use a number >= 1, true or auto"
        )


def hsdp_fits(job) -> None:
    if job.scaling.hsdp is True and not strategies.of(job).hsdp:
        raise ValueError(
            f"scaling.hsdp=true applies to training.strategy fsdp2, not {job.training.strategy}: "
            "ZeRO-3's equivalent is training.deepspeed: {zero_optimization: {zero_hpz_partition_size: "
            "<GPUs per node>}}; remove scaling.hsdp"
        )
    if job.scaling.hsdp is True and job.scaling.workers_per_node == 1:
        raise ValueError(
            "scaling.hsdp=true shards within a node: set scaling.workers_per_node to the training "
            "workers of one node (e.g. 8)"
        )


def model_parallel_fits(job) -> None:
    s, t = job.scaling, job.training
    if s.tensor_parallel > 1 and not strategies.of(job).tensor_parallel:
        raise ValueError(
            f"scaling.tensor_parallel={s.tensor_parallel} composes with fsdp2 (a 2-D mesh of DTensors), "
            f"not {t.strategy}: set training.strategy: fsdp2, or remove scaling.tensor_parallel"
        )
    if s.sequence_parallel > 1 and not strategies.of(job).sequence_parallel:
        raise ValueError(
            f"scaling.sequence_parallel={s.sequence_parallel} runs under fsdp2 and ddp; DeepSpeed "
            "sizes its batch by world size, which sequence-parallel ranks would multiply: set "
            "training.strategy: fsdp2, or remove scaling.sequence_parallel"
        )
    if job.data.seq_len % s.sequence_parallel:
        fit = job.data.seq_len // s.sequence_parallel * s.sequence_parallel
        raise ValueError(
            f"data.seq_len={job.data.seq_len} is not divisible by scaling.sequence_parallel="
            f"{s.sequence_parallel}: each rank takes an equal part of a sequence; use seq_len {fit} "
            f"or {fit + s.sequence_parallel}"
        )
    if t.lora.use_dora and s.tensor_parallel > 1:
        raise ValueError(
            f"training.lora.use_dora with scaling.tensor_parallel={s.tensor_parallel}: DoRA's magnitude is "
            "the norm of each output row over the whole input dimension, which the row-parallel "
            "layers (o_proj, down_proj) split over ranks: remove scaling.tensor_parallel or use_dora"
        )
    if t.compile is True and s.model_parallel > 1:
        which = " and ".join(
            f"scaling.{k}={v}"
            for k, v in (("sequence_parallel", s.sequence_parallel), ("tensor_parallel", s.tensor_parallel))
            if v > 1
        )
        raise ValueError(
            f"training.compile with {which} is not supported (the all-to-all and DTensor layers are "
            "not traced): remove training.compile"
        )


def gradient_sync_fits_the_strategy(job) -> None:
    if not strategies.of(job).sync_last_micro_batch and job.training.gradient_sync == "last_micro_batch":
        raise ValueError(
            "training.gradient_sync='last_micro_batch': ZeRO-3 reduce-scatters every micro-batch "
            "(its gradients are partitioned); remove gradient_sync or set training.strategy: fsdp2"
        )


def grpo_fits(job) -> None:
    problems = grpo_problems(job)
    if problems:
        raise ValueError("; ".join(problems))


def dora_is_lora(job) -> None:
    if job.training.lora.use_dora and job.training.finetune != "lora":
        raise ValueError(
            "training.lora.use_dora=true decomposes LoRA adapters over a dense base weight, and "
            f"training.finetune is {job.training.finetune}: set training.finetune: lora, or remove use_dora"
        )


def qlora_fits(job) -> None:
    t, s = job.training, job.scaling
    if t.finetune != "qlora":
        return
    if not strategies.of(job).quantized_base:
        why = (
            ("ZeRO-3 flattens parameters into its own partitions, which a 4-bit NF4 weight (codes and scales) is not")
            if strategies.of(job).shards
            else (
                "DDP holds the whole model on every rank, so a "
                "quantized base saves a quarter of what fsdp2 saves by sharding it"
            )
        )
        raise ValueError(
            f"training.finetune: qlora with training.strategy: {t.strategy}: {why}; set "
            "training.strategy: fsdp2 (one worker works too), or training.finetune: lora"
        )
    if s.tensor_parallel > 1:
        raise ValueError(
            f"training.finetune: qlora with scaling.tensor_parallel={s.tensor_parallel}: an NF4 weight "
            "is sharded by whole rows of blocks, and the row-parallel layers split its columns: "
            "remove scaling.tensor_parallel (sequence and data parallelism work)"
        )
    if t.offload.params or t.offload.optimizer:
        raise ValueError(
            "training.offload with training.finetune: qlora is not supported: FSDP2's CPU offload "
            "moves each shard as one plain tensor, and an NF4 shard is four (codes, scales, "
            "factors, mean); remove training.offload (a 4-bit base is the smaller step)"
        )


def no_fp16_master_weights(job) -> None:
    # raytrain has no loss scaler, and AdamW state in fp16 underflows (eps=1e-8 is 0 in fp16).
    if job.model.dtype == "float16" and job.training.finetune == "full":
        raise ValueError(
            "model.dtype=float16 with training.finetune: full trains fp16 master weights without "
            "loss scaling (gradients and AdamW state underflow); use model.dtype: bfloat16 or float32"
        )


RULES = (
    every_rank_gets_rows,
    deepspeed_block_needs_zero3,
    offload_needs_a_sharded_strategy,
    preference_settings_fit_the_objective,
    compile_and_chunked_loss_fit,
    hsdp_fits,
    model_parallel_fits,
    gradient_sync_fits_the_strategy,
    grpo_fits,
    dora_is_lora,
    qlora_fits,
    no_fp16_master_weights,
)
