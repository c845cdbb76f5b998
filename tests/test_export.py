"""Export in one process, no Ray: the plain Hugging Face folder a full fine-tune writes,
for a model that ships its own code (trust_remote_code) too."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from conftest import make_job

MODELING = """
from transformers import LlamaConfig, LlamaForCausalLM


class TinyConfig(LlamaConfig):
    model_type = "tiny-custom"


class TinyForCausalLM(LlamaForCausalLM):
    config_class = TinyConfig
"""


def test_full_export_of_a_model_with_its_own_code(assets, tmp_path):
    # It used to rebuild the plain copy without trust_remote_code and fail after training.
    from transformers import AutoModelForCausalLM

    from raytrain.model import hub, modeling
    from raytrain.strategies.hf_files import write_hf_export

    folder = tmp_path / "custom"
    shutil.copytree(assets / "model", folder)
    (folder / "modeling_tiny.py").write_text(MODELING)
    config = json.loads((folder / "config.json").read_text())
    config.update(
        model_type="tiny-custom",
        architectures=["TinyForCausalLM"],
        auto_map={"AutoConfig": "modeling_tiny.TinyConfig", "AutoModelForCausalLM": "modeling_tiny.TinyForCausalLM"},
    )
    (folder / "config.json").write_text(json.dumps(config))
    spec = make_job(
        assets, tmp_path, model={"path": str(folder), "trust_remote_code": True}, training={"finetune": "full"}
    )
    model = modeling.load_model(spec)
    assert type(model).__name__ == "TinyForCausalLM"
    write_hf_export(spec, model, model.state_dict(), str(tmp_path / "out"), hub.load_tokenizer(spec))
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), trust_remote_code=True).eval()
    assert type(exported).__name__ == "TinyForCausalLM"
    probe = torch.tensor([[5, 17, 42, 9, 33]])
    with torch.no_grad():
        torch.testing.assert_close(
            exported(input_ids=probe).logits, model.eval()(input_ids=probe).logits, rtol=0, atol=0
        )


def _committed_checkpoint(spec, state: dict, tmp_path, step_number: int = 4, optim: dict | None = None):
    """A committed single-process DCP checkpoint of `state` (and `optim`) in a run directory, in
    the files training writes."""
    import torch.distributed.checkpoint as dcp

    from raytrain.rundir import signing, storage
    from raytrain.rundir.checkpoints import RAY_SNAPSHOT, STATE_FILE  # Ray Train's controller registers it there
    from raytrain.rundir.job_file import write_job_file
    from raytrain.strategies.dcp_files import SplitWriter

    write_job_file(spec)
    step = tmp_path / "runs" / spec.name / f"step_{step_number:08d}"
    dcp.save({"model": state, **({"optim": optim} if optim else {})}, storage_writer=SplitWriter(str(step)))
    (step / STATE_FILE).write_text("{}")
    signing.sign_checkpoint(str(step), spec.run_dir, step.name)  # as one process signs all it wrote
    storage.write_text(
        storage.join(spec.run_dir, RAY_SNAPSHOT),  # local, or where the run directory is
        json.dumps({"latest_checkpoint_result": {"checkpoint_dir_name": step.name}}),
    )
    return step


def test_export_refuses_a_checkpoint_whose_weights_do_not_match_the_model(assets, tmp_path):
    # Loading used to be strict=False: a renamed key left the initial weights in place and the
    # export looked fine. Now the mismatch is named; the frozen LoRA base stays the one absence.
    import pytest

    from raytrain.errors import JobError
    from raytrain.model import modeling
    from raytrain.train.export import export_checkpoint

    spec = make_job(assets, tmp_path / "runs", name="renamed", training={"finetune": "full"})
    state = modeling.load_model(spec).state_dict()
    key = next(k for k in state if k.endswith("q_proj.weight"))
    state[key.replace("q_proj", "query")] = state.pop(key)
    _committed_checkpoint(spec, state, tmp_path)
    with pytest.raises(JobError, match=rf"has no value for model\.{key.replace('.', '[.]')}"):
        export_checkpoint(spec.run_dir, str(tmp_path / "out"))

    lora = make_job(assets, tmp_path / "runs", name="adapter")
    model = modeling.load_model(lora)
    with torch.no_grad():
        trained = {k: v.clone() + 1 for k, v in model.state_dict().items() if k in modeling.trainable_names(model)}
    _committed_checkpoint(lora, trained, tmp_path)
    export_checkpoint(lora.run_dir, str(tmp_path / "adapter"))  # only the adapter saved: that is complete
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert len(saved) == len(trained) and all(
        torch.equal(v, trained[k].to(v.dtype)) for k, v in zip(sorted(trained), [saved[k] for k in sorted(saved)])
    )


def test_export_reads_a_run_directory_on_s3(assets, tmp_path, s3_server, monkeypatch):
    # The shipped GPU jobs checkpoint to S3; export used to read local run directories only.
    from safetensors.torch import load_file

    from raytrain.model import modeling
    from raytrain.rundir import storage
    from raytrain.train.export import export_checkpoint

    env, client = s3_server
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    client.create_bucket(Bucket="exports")
    spec = make_job(assets, "s3://exports/runs", name="adapter")  # its files signed for the run directory on S3
    model = modeling.load_model(spec)
    with torch.no_grad():
        trained = {k: v.clone() + 1 for k, v in model.state_dict().items() if k in modeling.trainable_names(model)}
    _committed_checkpoint(spec, {k: v - 1 for k, v in trained.items()}, tmp_path)
    storage.upload_dir(str(tmp_path / "runs" / "adapter"), "s3://exports/runs/adapter")  # as the job left it
    local = _committed_checkpoint(spec, trained, tmp_path, step_number=8)
    storage.upload_dir(str(local), "s3://exports/runs/adapter/step_00000008")  # a newer commit on S3 only
    used = export_checkpoint("s3://exports/runs/adapter", str(tmp_path / "out"))
    assert used == "s3://exports/runs/adapter/step_00000008"
    saved = load_file(str(tmp_path / "out" / "adapter_model.safetensors"))
    assert len(saved) == len(trained) and all(
        torch.equal(saved[k], trained[k2].to(saved[k].dtype)) for k, k2 in zip(sorted(saved), sorted(trained))
    )


def test_raytrain_export_of_a_full_checkpoint_loads_with_from_pretrained(assets, tmp_path):
    # Converted one tensor at a time from the DCP checkpoint (the model is built on meta): the
    # folder from_pretrained reads holds the checkpoint's weights, rounded to model.dtype.
    from transformers import AutoModelForCausalLM

    from raytrain.model import modeling
    from raytrain.train.export import export_checkpoint

    spec = make_job(assets, tmp_path / "runs", name="full", training={"finetune": "full"}, model={"dtype": "bfloat16"})
    with torch.no_grad():
        trained = {k: v.float() + 0.01 for k, v in modeling.load_model(spec).state_dict().items()}
    adam = {"state": {k: {"exp_avg": v * 2, "exp_avg_sq": v * v} for k, v in trained.items()}}
    step = _committed_checkpoint(spec, trained, tmp_path, optim=adam)
    export_checkpoint(spec.run_dir, str(tmp_path / "out"))
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    assert exported.dtype == torch.bfloat16
    got = exported.state_dict()
    assert all(torch.equal(got[k], v.to(torch.bfloat16)) for k, v in trained.items())
    assert json.loads((tmp_path / "out" / "raytrain.json").read_text())["finetune"] == "full"

    # What it read: the metadata and the model's files, none of the optimizer's (twice the model
    # again under AdamW; export used to fetch each rank's one file of both), in loads small
    # enough that many share one parse of the metadata.
    from raytrain.rundir import signing
    from raytrain.train import export

    export.BATCH_BYTES = 64 << 10  # several loads of this tiny model through one reader
    with signing.SignedCheckpoint(str(step), spec.run_dir, step.name) as checkpoint:
        export.write_full_from_checkpoint(spec, checkpoint, str(tmp_path / "again"))
        fetched = sorted(p.name for p in Path(checkpoint.fetch()).iterdir())
        read = checkpoint.bytes_read
    assert (
        fetched == [".metadata", "__0_shared0.distcp"] and "__0_sharedoptim0.distcp" in checkpoint.names
    )  # as DDP writes
    assert read == sum((step / name).stat().st_size for name in fetched)
    assert (tmp_path / "again" / "model.safetensors").read_bytes() == (
        tmp_path / "out" / "model.safetensors"
    ).read_bytes()
