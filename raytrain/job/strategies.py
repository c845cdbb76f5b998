"""What each `training.strategy` is and can do, in one table: the rules (job/rules.py), the run
plan, the memory estimate, pod sizing and the kernel choice read these facts instead of comparing
the strategy's name. The implementations are strategies/fsdp2.py, zero3.py and ddp.py; adding one
is its module, one row here and its tests. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Strategy:
    name: str
    shards: bool  # each rank holds 1/N of the model's parameters, gradients and optimizer state
    offload: str | None  # training.offload: None (no offload), "together" (params, grads and optimizer as one:
    # torch's CPUOffloadPolicy) or "apart" (DeepSpeed offloads the optimizer and the parameters each on its own)
    deepspeed_block: bool  # training.deepspeed is its config's overrides
    compiles: bool  # torch.compile of decoder blocks (ZeRO-3's parameter hooks break compiled graphs)
    head_after_forward: bool  # the output layer applied after the forward (training.chunked_loss, Liger's
    # fused loss); ZeRO-3 has partitioned it again by then
    sequence_parallel: bool  # Ulysses' ranks (DeepSpeed sizes its batch by world size, which they would multiply)
    tensor_parallel: bool  # a 2-D mesh of DTensors under the data-parallel sharding
    hsdp: bool  # replicate x shard meshes (scaling.hsdp)
    quantized_base: bool  # QLoRA's NF4 weights as parameters it shards
    sync_last_micro_batch: bool  # gradients may wait for the last micro-batch (ZeRO-3 reduce-scatters each)
    sixteen_bit_copy: bool  # in bf16, a 16-bit copy of every parameter beside the fp32 master (DeepSpeed's)
    replicated: bool  # every rank holds the whole model (more devices never make it fit)


STRATEGIES = {
    s.name: s
    for s in (
        Strategy("fsdp2", True, "together", False, True, True, True, True, True, True, True, False, False),
        Strategy("zero3", True, "apart", True, False, False, False, False, False, False, False, True, False),
        Strategy("ddp", False, None, False, True, True, True, False, False, False, True, False, True),
    )
}


def of(spec) -> Strategy:
    return STRATEGIES[spec.training.strategy]
