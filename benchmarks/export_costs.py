"""E1 (issue #33): `raytrain export` of a full fine-tune's checkpoint with 4x the tensors (the same bytes).

    python -m benchmarks.export_costs

E1  export time, 4x the tensors / 1x (the same bytes)                          goal <= 1.3
E2  bytes read from the checkpoint / the model's bytes in it                     goal 1.0

Two Llama-shaped models of the same bytes (~17M parameters, fp32): 4 layers of hidden 512 and 16
of hidden 256 (4x the tensors; the vocabulary doubled to keep the embedding's bytes). Each is
saved as a full fine-tune's checkpoint is (model and AdamW's two moments, signed), then exported
to a bf16 HF folder in one process. "before" is the export as of e098762^ (one DCP load per
tensor, each unpickling the whole metadata, from files holding the optimizer beside the model),
run here on the same checkpoint; "after" is this checkout's `raytrain export`.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import torch


def _checkpoint(root: Path, hidden: int, layers: int, vocab: int, split: bool) -> tuple:
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM, LlamaConfig

    from raytrain import demo_assets
    from raytrain.job.spec import JobSpec
    from raytrain.rundir import signing, storage
    from raytrain.rundir.checkpoints import RAY_SNAPSHOT, STATE_FILE
    from raytrain.rundir.job_file import write_job_file
    from raytrain.strategies.dcp_files import SplitWriter

    model_dir = root / "model"
    demo_assets.make_tokenizer(model_dir)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        tie_word_embeddings=False,
    )
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(str(model_dir))
    data = demo_assets.write_jsonl(root / "text.jsonl", demo_assets.text_rows(8))
    spec = JobSpec.model_validate(
        {
            "name": "export",
            "model": {"path": str(model_dir), "dtype": "bfloat16"},
            "data": {"path": str(data), "format": "text", "seq_len": 32},
            "training": {"finetune": "full", "max_steps": 1},
            "checkpoint": {"storage_path": str(root / "runs")},
        }
    )
    write_job_file(spec)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    optim = {"state": {k: {"exp_avg": v.clone(), "exp_avg_sq": v.clone()} for k, v in state.items()}}
    step = Path(spec.run_dir) / "step_00000001"
    writer = SplitWriter(str(step)) if split else dcp.FileSystemWriter(str(step))  # before: one file of both
    dcp.save({"model": state, "optim": optim}, storage_writer=writer)
    (step / STATE_FILE).write_text("{}")
    signing.sign_checkpoint(str(step), spec.run_dir, step.name)
    storage.write_text(
        storage.join(spec.run_dir, RAY_SNAPSHOT),
        json.dumps({"latest_checkpoint_result": {"checkpoint_dir_name": step.name}}),
    )
    model_bytes = sum(v.nbytes for v in state.values())
    return spec, step, len(state), model_bytes


def _export_before(spec, checkpoint, directory: str) -> None:
    """e098762^'s write_full_from_checkpoint: a DCP load (and a metadata parse) per tensor."""
    from raytrain.model import hub, modeling
    from raytrain.strategies import hf_files
    from raytrain.strategies.dcp_files import read_checkpoint
    from raytrain.strategies.hf_files import export_entries, write_full_export

    model = modeling.load_model(spec, on_meta=True)
    entries = export_entries(spec, hf_files.export_tensors(model))

    def one_at_a_time():
        for key, shape, dtype in entries:
            value = torch.empty(shape, dtype=dtype)
            read_checkpoint({"model": {key: value}}, checkpoint)  # a new reader each time, as before
            yield key, value

    write_full_export(spec, model, one_at_a_time(), entries, directory, hub.load_tokenizer(spec), rank=0, world_size=1)


def _measure(spec, step: Path, arm: str) -> tuple[float, int]:
    from raytrain.rundir import signing
    from raytrain.train import export

    with tempfile.TemporaryDirectory() as out, signing.SignedCheckpoint(str(step), spec.run_dir, step.name) as ckpt:
        start = time.perf_counter()
        (_export_before if arm == "before" else export.write_full_from_checkpoint)(spec, ckpt, out)
        return time.perf_counter() - start, ckpt.bytes_read


def main() -> None:
    torch.manual_seed(0)
    shapes = {"1x": (512, 4, 8192), "4x": (256, 16, 16384)}
    rows = {}
    with tempfile.TemporaryDirectory(prefix="raytrain-export-bench-") as tmp:
        for arm, split in (("before", False), ("after", True)):
            for name, (hidden, layers, vocab) in shapes.items():
                spec, step, tensors, model_bytes = _checkpoint(Path(tmp, arm, name), hidden, layers, vocab, split)
                times, read = [], 0
                for _ in range(3):
                    seconds, read = _measure(spec, step, arm)
                    times.append(seconds)
                rows[arm, name] = (sorted(times)[1], read, tensors, model_bytes)
                print(
                    f"{arm:6s} {name}: {tensors} tensors, {model_bytes / 2**20:.1f} MiB of model; export "
                    f"{sorted(times)[1]:.2f} s (median of 3), read {read / 2**20:.1f} MiB "
                    f"({read / model_bytes:.2f}x the model)",
                    flush=True,
                )
    for arm in ("before", "after"):
        t1, r1, _, m1 = rows[arm, "1x"]
        t4, r4, _, m4 = rows[arm, "4x"]
        print(
            f"E1 {arm}: export time 4x tensors / 1x = {t4 / t1:.2f} (goal <= 1.3); "
            f"E2 {arm}: bytes read / model bytes = {r1 / m1:.2f} and {r4 / m4:.2f} (goal 1.0)"
        )


if __name__ == "__main__":
    main()
