"""Sharded loading: under fsdp2 every rank builds the model on meta, shards it and reads only its
slices from the model's safetensors files; under zero3 it is built partitioned and filled one
module at a time from rank 0's reads. The weights it ends with must be those of a plain
`from_pretrained` in `model.dtype`, bit for bit (trained ones upcast to their fp32 masters),
with LoRA's adapters initialized as on a loaded model, at 1, 2 and 3 workers (3 shards the
64-wide tiny Llama unevenly), from a model split over several safetensors files.

The workers are a plain Ray Train TorchTrainer on the session's cluster, running the product's
strategy; rank 0 gathers the full state dict it loaded and writes it for the test to compare.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from conftest import make_job

from raytrain.model import modeling
from raytrain.strategies.base import to_fp32_master

pytestmark = pytest.mark.slow
# (strategy, finetune, model.dtype); the files hold bf16, so float32 casts on the way in.
CASES = [
    ("fsdp2", "lora", "bfloat16"),
    ("fsdp2", "full", "bfloat16"),
    ("fsdp2", "full", "float32"),
    ("zero3", "lora", "float32"),
    ("zero3", "full", "float32"),
]


def load_and_gather(config: dict) -> None:
    """In each worker: build each case's strategy (loading its weights); rank 0 saves what it holds."""
    import ray.train
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from raytrain.job.spec import JobSpec
    from raytrain.strategies import build_strategy
    from raytrain.strategies.zero3 import gathered_state_dict

    out = {}
    for key, spec_json in config["specs"].items():
        spec = JobSpec.model_validate_json(spec_json)
        strategy = build_strategy(spec, torch.device("cpu"))
        if spec.training.strategy == "zero3":  # the partitioned module's weights, gathered one module at a time
            state = gathered_state_dict(
                strategy.hf_model, dist.get_rank(), fp32_master=False, dtype=modeling.DTYPES[spec.model.dtype]
            )
        else:
            state = get_model_state_dict(
                strategy.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
            )
        buffers = {n: b.detach().clone() for n, b in strategy.hf_model.named_buffers()}
        out[key] = {"state": state, "buffers": buffers, "how": getattr(strategy, "loaded_by", None)}
        if spec.training.finetune == "full":  # every rank writes its file of the export
            strategy.export(f"{config['exports']}/{key}", tokenizer=None)
        dist.barrier()
    if ray.train.get_context().get_world_rank() == 0:
        torch.save(out, config["out"])


def expected(spec) -> tuple[dict, dict]:
    """What a plain load gives: from_pretrained in model.dtype (+ peft), trained weights in fp32
    under fsdp2 (zero3 keeps its fp32 masters in the optimizer, not the module)."""
    model = modeling.load_model(spec)
    if spec.training.strategy == "fsdp2":
        to_fp32_master(model)
    return model.state_dict(), dict(model.named_buffers())


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_sharded_loading_equals_from_pretrained(ray_address, assets, split_model, tmp_path, workers):
    import ray.cloudpickle
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    specs = {
        f"{strategy}-{finetune}-{dtype}": make_job(
            assets,
            tmp_path,
            name=f"load-{finetune}",
            model={"path": str(split_model), "dtype": dtype},
            training={"strategy": strategy, "finetune": finetune},
            scaling={"num_workers": workers},
        )
        for strategy, finetune, dtype in CASES
    }
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    out = tmp_path / "loaded.pt"
    TorchTrainer(
        load_and_gather,
        train_loop_config={
            "specs": {k: s.model_dump_json() for k, s in specs.items()},
            "out": str(out),
            "exports": str(tmp_path / "exports"),
        },
        scaling_config=ScalingConfig(num_workers=workers, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(name=f"load-{workers}", storage_path=str(tmp_path / "ray")),
    ).fit()
    loaded = torch.load(out)
    for key, spec in specs.items():
        state, buffers = expected(spec)
        got = loaded[key]
        assert got["how"] == "sharded", key  # read shard by shard, not through rank 0
        assert got["state"].keys() == state.keys(), key
        differ = [k for k in state if not torch.equal(got["state"][k], state[k])]
        assert not differ, f"{key}: {len(differ)} weights differ from from_pretrained, e.g. {differ[:3]}"
        dtypes = {k: (got["state"][k].dtype, state[k].dtype) for k in state if got["state"][k].dtype != state[k].dtype}
        assert not dtypes, f"{key}: {dtypes}"
        assert all(torch.equal(got["buffers"][n], b) for n, b in buffers.items()), key  # rotary frequencies
        if spec.training.finetune == "full":
            check_export(tmp_path / "exports" / key, got["state"], spec, workers)


def check_export(folder: Path, state: dict, spec, workers: int) -> None:
    """The export of a full model, written by every rank (one weights file each), loads with plain
    `from_pretrained` equal to the weights the workers held, bit for bit in model.dtype."""
    from transformers import AutoModelForCausalLM

    dtype = modeling.DTYPES[spec.model.dtype]
    files = sorted(p.name for p in folder.glob("*.safetensors"))
    assert files == (
        [f"model-{i:05d}-of-{workers:05d}.safetensors" for i in range(1, workers + 1)]
        if workers > 1
        else ["model.safetensors"]
    ), files
    exported = AutoModelForCausalLM.from_pretrained(str(folder))
    assert exported.dtype == dtype
    got = exported.state_dict()
    differ = [k for k, v in state.items() if not torch.equal(got[k], v.to(dtype))]
    assert not differ, f"{folder.name}: {differ[:3]}"


def test_a_checkpoint_is_complete_when_it_holds_what_its_kind_of_job_trains(assets):
    """What `modeling.require_complete` asks of a checkpoint: what the job trains (a LoRA job: the
    adapter; a full one: every weight), each tensor under any of its names. The demo model's output
    layer is its input embedding: its LoRA checkpoint holds neither (both frozen, from model.path), its
    full checkpoint the embedding alone (named once). A missing trained weight, or one the model does
    not have, is refused by name."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from raytrain.errors import JobError

    full = AutoModelForCausalLM.from_pretrained(str(assets / "model"))
    assert full.get_input_embeddings().weight is full.get_output_embeddings().weight  # tied
    lora = get_peft_model(
        AutoModelForCausalLM.from_pretrained(str(assets / "model")),
        LoraConfig(r=4, target_modules=["q_proj", "v_proj"]),
    )
    for model, finetune in ((full, "full"), (lora, "lora")):
        names = dict(model.named_parameters(remove_duplicate=False))
        saved = {n for n, p in model.named_parameters() if finetune == "full" or p.requires_grad}
        missing = sorted(set(names) - saved)
        modeling.require_complete(model, missing, [], finetune, "step_2")  # tied: the output layer needs no entry
        trained = sorted(saved)[1]
        with pytest.raises(
            JobError, match=rf"step_2 does not match model.path \(no saved value for 1 weight.*{trained}"
        ):
            modeling.require_complete(model, missing + [trained], [], finetune, "step_2")
        with pytest.raises(JobError, match=r"1 saved weight\(s\) the model does not have, e.g. \['renamed.weight'\]"):
            modeling.require_complete(model, missing, ["renamed.weight"], finetune, "step_2")
