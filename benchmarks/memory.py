"""M1-M4: the model path at scale (issue #12), measured inside Ray Train workers.

    python -m benchmarks.bench m --quick        (a ~400M-parameter Llama, 1.6 GB in fp32, 2 workers)

Each arm is one plain TorchTrainer run on a local Ray cluster whose workers build the
product's strategy (`build_strategy`) and read their own peak resident memory (VmHWM, reset
through /proc/self/clear_refs before each phase), so a figure is one process's peak over
exactly that phase.

M1  peak host memory of the busiest rank while the model loads / (model bytes / N)   goal <= 1.3
    arms: fsdp2 reading safetensors slices; fsdp2 from a pytorch_model.bin (no safetensors:
    rank 0 loads it whole and broadcasts, as every model did before); zero3 filled module by
    module; zero3 through transformers' from_pretrained under zero.Init (as before). For zero3
    the phase is the load alone: deepspeed.initialize then allocates the engine's own buffers.
M2  peak of a full-fine-tuning step with 4 micro-batches / with 1 (same micro-batch), fsdp2,
    gradient_sync auto (reduce-scatter every micro-batch) and last_micro_batch   goal <= 1.1
M3  peak of a training step above the process before loading (its imports) / `raytrain validate`'s
    estimate, fsdp2 and zero3 x LoRA and full                                goal 0.8 to 1.2
M1u M1 as users run it: the product's own settings (no allocator variable), LoRA and full, fsdp2,
    on a SmolLM2-135M-shaped Llama (hidden 576, 30 layers, vocab 49152, tied embeddings, fp32
    files) and the ~400M Llama; the load phase alone, as M1                    goal <= 1.3
M5  host memory the busiest rank adds while it exports a full fine-tune / (model / N), fsdp2
    (every rank writes its file, one gathered tensor at a time); and `raytrain export` of a full
    checkpoint: its peak above the bare process / the model's bytes             goals <= 1.3, <= 0.5
M4  bytes the busiest rank reads from the checkpoint's storage on restore / (checkpoint bytes / N),
    fsdp2 and zero3 full: the product (`SignedCheckpoint`: this rank's files, verified as fetched)
    and as before (every file of the folder hashed on every rank, then the strategy read its part
    in place; from s3:// the whole folder was downloaded to every node first)   goal <= 1.2
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

from . import harness as h

SIZES = {"quick": (2048, 8), "smoke": (64, 2), "gpu": (2048, 16)}  # hidden, layers: ~400M parameters quick


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(next(ln for ln in f if ln.startswith(field + ":")).split()[1]) * 1024


def _reset_peak() -> int:
    with open("/proc/self/clear_refs", "w") as f:  # "5": the peak resident set starts again from now
        f.write("5")
    return _status("VmRSS")


def measure(config: dict) -> None:
    """In each worker: load (M1), then, for M2, one step of 1 and of 4 micro-batches."""
    import json

    import ray.train
    import torch

    from raytrain.job.spec import JobSpec
    from raytrain.model import modeling
    from raytrain.strategies import build_strategy

    torch.set_num_threads(1)
    spec = JobSpec.model_validate(config["job"])
    modeling.load_model(spec, on_meta=True)  # imports the model's code first: the phase measures the load
    if spec.training.strategy == "zero3":
        import deepspeed  # noqa: F401
    base = _status("VmRSS")  # the process with its imports, before any weight exists
    if config.get("zero3_load"):  # M1 of ZeRO-3: the load alone (deepspeed.initialize then allocates its
        out = zero3_load(spec, config["zero3_load"])  # flat fp32 partitions and gradient buffers: engine state)
    else:
        before = _reset_peak()
        strategy = build_strategy(spec, torch.device("cpu"))
        out = {"load_peak": _status("VmHWM") - before, "how": getattr(strategy, "loaded_by", spec.training.strategy)}
    out["base"] = base
    if config["steps"]:
        vocab, micro = strategy.hf_model.config.vocab_size, spec.training.micro_batch_size
        batch = torch.randint(vocab, (micro, spec.data.seq_len))

        def step(micro_batches: int) -> None:
            for i in range(micro_batches):
                with strategy.autocast():
                    loss = strategy.model(input_ids=batch, labels=batch).loss / micro_batches
                strategy.backward(loss, sync=i == micro_batches - 1)
            strategy.begin_update(1e-5)
            strategy.end_update(True)

        step(1)  # AdamW's state exists from here on: both phases below hold it
        for n in (1, 4):
            before = _reset_peak()
            step(n)
            out[f"step_peak_{n}"] = _status("VmHWM")
            out[f"step_rise_{n}"] = out[f"step_peak_{n}"] - before
    Path(config["out"], f"rank{ray.train.get_context().get_world_rank()}.json").write_text(json.dumps(out))


def export_peak(config: dict) -> None:
    """In each worker: build the strategy, then export the (untrained) full model; the export's
    own rise of the resident peak."""
    import json
    import tempfile

    import ray.train
    import torch

    from raytrain.job.spec import JobSpec
    from raytrain.model import hub
    from raytrain.strategies import build_strategy

    torch.set_num_threads(1)
    spec = JobSpec.model_validate(config["job"])
    strategy = build_strategy(spec, torch.device("cpu"))
    tokenizer = hub.load_tokenizer(spec) if strategy.rank == 0 else None  # as worker.export: rank 0's
    with tempfile.TemporaryDirectory() as tmp:
        before = _reset_peak()
        strategy.export(tmp, tokenizer)
        out = {"export_rise": _status("VmHWM") - before, "resident_before": before}
    Path(config["out"], f"rank{ray.train.get_context().get_world_rank()}.json").write_text(json.dumps(out))


# SmolLM2-135M's published shape (a Llama with tied embeddings)
SMOLLM2 = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
    eos_token_id=0,
    pad_token_id=0,
    bos_token_id=None,
)


def smollm2_shape(s: h.Setting, tied: bool = True) -> Path:
    """A Llama of SmolLM2-135M's published shape (tied embeddings), random weights in fp32; `tied`
    False: the same with an output layer of its own (163M parameters), as untied models are."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    out = h.CACHE / ("smollm2-135m-shape" if tied else "smollm2-shape-untied")
    if not (out / "config.json").exists():
        base, _ = h.assets(s)
        config = LlamaConfig(**{**SMOLLM2, "tie_word_embeddings": tied})
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(str(out))
        AutoTokenizer.from_pretrained(str(base)).save_pretrained(str(out))
    return out


def export_cli_peak(run_dir: str, out: str, batch_bytes: int | None = None) -> dict:
    """`raytrain export` in a process of its own: its resident peak above its floor, and its seconds;
    `batch_bytes` sets `raytrain.export.BATCH_BYTES` there (else the product's). The floor is the
    process with the export's code loaded and no weight: the model's module tree built once on meta
    (transformers imports a family's modeling code on first use: ~110 MiB resident here, whatever the
    model's size, which the figure before 2026-11-29 counted as the export's)."""
    import json
    import subprocess

    code = (
        "import json, sys, time\n"
        "from raytrain.model import modeling\n"
        "from raytrain.rundir.job_file import read_job_file\n"
        "from raytrain.train import export\n"
        "import transformers, torch, torch.distributed.checkpoint\n"
        "def status(f):\n"
        "    return int(next(l for l in open('/proc/self/status') if l.startswith(f + ':')).split()[1]) * 1024\n"
        + (f"export.BATCH_BYTES = {batch_bytes}\n" if batch_bytes is not None else "")
        + "bare = status('VmRSS')\n"
        f"modeling.load_model(read_job_file({run_dir!r}), on_meta=True)\n"
        "base, began = status('VmRSS'), time.time()\n"
        f"export.export_checkpoint({run_dir!r}, {out!r})\n"
        "print(json.dumps({'bare': bare, 'base': base, 'peak': status('VmHWM'), 's': time.time() - began}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def full_checkpoint(spec, model: Path, folder: Path) -> str:
    """A committed, signed single-process DCP checkpoint of `model`'s weights in fp32, in a run
    directory with its job file, as a full fine-tune leaves one."""
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    from raytrain.rundir import signing
    from raytrain.rundir.checkpoints import RAY_SNAPSHOT, STATE_FILE
    from raytrain.rundir.job_file import write_job_file

    write_job_file(spec)
    step = Path(spec.run_dir) / "step_00000001"
    state = AutoModelForCausalLM.from_pretrained(str(model)).state_dict()
    dcp.save({"model": state}, checkpoint_id=str(step), no_dist=True)
    del state
    (step / STATE_FILE).write_text("{}")
    # Registered as Ray Train's controller registers a checkpoint (what raytrain export reads).
    Path(spec.run_dir, RAY_SNAPSHOT).write_text(
        '{"latest_checkpoint_result": {"checkpoint_dir_name": "step_00000001"}}'
    )
    signing.sign_checkpoint(str(step), spec.run_dir, step.name)
    return spec.run_dir


def m1u_m5(s: h.Setting) -> dict:
    """M1 as users run it, and M5 (the export), each arm a plain TorchTrainer run with the
    product's settings (no allocator variable)."""
    import ray

    h.header("M1u / M5: load and export memory with the product's own settings", s)
    hidden, layers = SIZES[s.name]
    llama, data = h.assets(s, hidden=hidden, layers=layers)
    models = {"smollm2-shape": smollm2_shape(s) if s.name != "smoke" else llama, f"llama-h{hidden}-l{layers}": llama}
    folder = h.scratch("m5")
    gib, result = 1 << 30, {}
    try:
        ray.init(address="local", num_cpus=s.workers + 1, include_dashboard=False, log_to_driver=False)
        from raytrain.job.spec import JobSpec
        from raytrain.rundir import signing

        signing.ensure_key()
        for name, model in models.items():
            model_bytes = sum(f.stat().st_size for f in model.glob("*.safetensors"))  # fp32 files
            share = model_bytes / s.workers
            for finetune in ("lora", "full"):
                job = h.job(
                    s,
                    f"m1u-{finetune}",
                    folder / "runs",
                    model,
                    data,
                    training={"strategy": "fsdp2", "finetune": finetune, "gradient_sync": "auto"},
                )
                ranks = _run(s, folder, f"m1u-{name}-{finetune}", job)
                busiest = max(r["load_peak"] for r in ranks)
                result[f"ratio_m1u_{name}_{finetune}"] = busiest / share
                peaks = ", ".join(f"{r['load_peak'] / gib:.3f}" for r in ranks)
                print(
                    f"M1u {name} {finetune:4s} ({ranks[0]['how']}): load peak per rank {peaks} GiB; "
                    f"busiest / (model {model_bytes / gib:.2f} GiB / N) = {busiest / share:.2f}"
                )
            job = h.job(s, "m5", folder / "runs", model, data, training={"strategy": "fsdp2", "finetune": "full"})
            ranks = _run(s, folder, f"m5-{name}", job, fn=export_peak)
            busiest = max(r["export_rise"] for r in ranks)
            result[f"ratio_m5_{name}"] = busiest / share
            rises = ", ".join(f"{r['export_rise'] / gib:.3f}" for r in ranks)
            print(f"M5 {name}: the export adds {rises} GiB per rank; busiest / (model / N) = {busiest / share:.2f}")
            spec = JobSpec.model_validate(
                h.job(
                    s, f"m5cli-{name}", folder / "runs", model, data, training={"strategy": "fsdp2", "finetune": "full"}
                )
            )
            run_dir = full_checkpoint(spec, model, folder)
            cli = export_cli_peak(run_dir, str(folder / f"export-{name}"))
            result[f"ratio_m5_cli_{name}"] = (cli["peak"] - cli["base"]) / model_bytes
            print(
                f"M5 raytrain export {name}: peak above its floor {(cli['peak'] - cli['base']) / gib:.3f} GiB "
                f"/ model {model_bytes / gib:.2f} GiB = {result[f'ratio_m5_cli_{name}']:.2f} (above the bare "
                f"process before the model's code: {(cli['peak'] - cli['bare']) / model_bytes:.2f})"
            )
        return result
    finally:
        ray.shutdown()
        h.cleanup(folder)


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return int(next(ln for ln in f if ln.startswith("rchar:")).split()[1])


def restore_reads(config: dict) -> None:
    """In each worker: save a signed checkpoint as the product does (each rank its own folder,
    merged), or restore it both ways and count the bytes read."""
    import json
    import shutil
    import tempfile

    import ray.train
    import torch
    import torch.distributed.checkpoint as dcp

    from raytrain.job.spec import JobSpec
    from raytrain.rundir import signing
    from raytrain.strategies import build_strategy
    from raytrain.train.checkpoint import sign

    torch.set_num_threads(1)
    spec = JobSpec.model_validate(config["job"])
    strategy = build_strategy(spec, torch.device("cpu"))
    folder, name = config["checkpoint"], Path(config["checkpoint"]).name
    if config["save"]:
        mine = tempfile.mkdtemp()
        strategy.save(mine)
        sign(mine, spec.run_dir, name, "")  # collective: rank 0 signs every rank's files
        shutil.copytree(mine, folder, dirs_exist_ok=True)
        return
    with signing.SignedCheckpoint(folder, spec.run_dir, name) as checkpoint:
        before = _rchar()
        strategy.load(checkpoint)
        out = {
            "fetched": checkpoint.bytes_read,
            "rchar": _rchar() - before,
            "checkpoint_bytes": sum(Path(folder, f).stat().st_size for f in checkpoint.names),
        }
    before = _rchar()  # as before: every file hashed, then the strategy's own reader on the folder in place
    signing.verify_checkpoint(folder, spec.run_dir, name)
    if spec.training.strategy == "zero3":
        strategy.engine.load_checkpoint(folder, tag="ds", load_lr_scheduler_states=False)
    else:
        dcp.load(strategy._state(), checkpoint_id=folder)
    out["before"] = _rchar() - before
    Path(config["out"], f"rank{ray.train.get_context().get_world_rank()}.json").write_text(json.dumps(out))


def zero3_load(spec, how: str) -> dict:
    """The ZeRO-3 strategy's model load as `setup` runs it: "sharded" (the product's
    `load_partitioned`) or "from_pretrained" (transformers' own loading under zero.Init, as before)."""
    import torch.distributed as dist
    from transformers import AutoConfig
    from transformers.integrations import HfDeepSpeedConfig

    from raytrain.job import deepspeed_config
    from raytrain.model import modeling
    from raytrain.strategies import zero3

    zero3.init_deepspeed_comm()
    hidden = AutoConfig.from_pretrained(spec.model.path).hidden_size
    live = HfDeepSpeedConfig(deepspeed_config.build(spec, dist.get_world_size(), hidden))  # noqa: F841 (while it lives)
    before = _reset_peak()
    if how == "sharded":
        _, how = zero3.load_partitioned(spec)
    else:
        modeling.load_model(spec)
    return {"load_peak": _status("VmHWM") - before, "how": how}


def _run(
    s: h.Setting,
    folder: Path,
    name: str,
    job: dict,
    steps: bool = False,
    zero3_load: str | None = None,
    fn=measure,
    **config,
) -> list[dict]:
    import json

    import ray.cloudpickle
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    out = folder / name
    out.mkdir(parents=True)
    TorchTrainer(
        fn,
        train_loop_config={"job": job, "out": str(out), "steps": steps, "zero3_load": zero3_load, **config},
        scaling_config=ScalingConfig(num_workers=s.workers, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(name=name, storage_path=str(folder / "ray")),
    ).fit()
    return [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]


def bin_copy(model: Path) -> Path:
    """The same model with only a pytorch_model.bin, as older hub repos ship it."""
    import torch
    from transformers import AutoModelForCausalLM

    out = model.parent / (model.name + "-bin")
    if not (out / "pytorch_model.bin").exists():
        plain = AutoModelForCausalLM.from_pretrained(str(model))
        out.mkdir(exist_ok=True)
        torch.save(plain.state_dict(), out / "pytorch_model.bin")
        plain.config.save_pretrained(str(out))
        for f in model.glob("tokenizer*"):
            (out / f.name).write_bytes(f.read_bytes())
    return out


def m(s: h.Setting) -> dict:
    import ray

    h.header("M host memory of the model path: load (M1), accumulation (M2)", s)
    hidden, layers = SIZES[s.name]
    model, data = h.assets(s, hidden=hidden, layers=layers)
    folder = h.scratch("m")
    gib = 1 << 30
    try:
        # glibc hands every freed block of 256 KiB or more back at once, so a resident peak tracks the
        # live tensors, not what the allocator kept from earlier transients.
        ray.init(
            address="local",
            num_cpus=s.workers + 1,
            include_dashboard=False,
            log_to_driver=False,
            runtime_env={"env_vars": {"MALLOC_MMAP_THRESHOLD_": str(256 << 10)}},
        )
        from safetensors import safe_open

        with safe_open(str(next(model.glob("*.safetensors"))), framework="pt") as f:
            model_bytes = sum(math.prod(f.get_slice(k).get_shape()) * 4 for k in f.keys())  # fp32
        share = model_bytes / s.workers
        result = {"model_gib": model_bytes / gib}
        print(
            f"model: {model.name}, {model_bytes / gib:.2f} GiB in fp32; N = {s.workers}: {share / gib:.2f} GiB a rank"
        )

        arms = {
            "fsdp2": ("fsdp2", model, None),
            "fsdp2_bin": ("fsdp2", bin_copy(model), None),
            "zero3": ("zero3", model, "sharded"),
            "zero3_from_pretrained": ("zero3", model, "from_pretrained"),
        }
        for label, (strategy, path, zero3) in arms.items():
            job = h.job(
                s, f"m1-{label}", folder / "runs", path, data, training={"strategy": strategy, "gradient_sync": "auto"}
            )
            ranks = _run(s, folder, f"m1-{label}", job, steps=False, zero3_load=zero3)
            busiest = max(r["load_peak"] for r in ranks)
            result[f"ratio_m1_{label}"] = busiest / share
            peaks = ", ".join(f"{r['load_peak'] / gib:.2f}" for r in ranks)
            print(
                f"M1 {label:10s} ({ranks[0]['how']}): peak while loading per rank {peaks} GiB; "
                f"busiest / (model / N) = {busiest / share:.2f}"
            )

        for sync in ("auto", "last_micro_batch"):
            job = h.job(
                s,
                f"m2-{sync}",
                folder / "runs",
                model,
                data,
                training={"strategy": "fsdp2", "gradient_sync": sync, "micro_batch_size": 1},
            )
            ranks = _run(s, folder, f"m2-{sync}", job, steps=True)
            worst = max(ranks, key=lambda r: r["step_peak_4"] / r["step_peak_1"])
            ratio = worst["step_peak_4"] / worst["step_peak_1"]
            result[f"ratio_m2_{sync}"] = ratio
            print(
                f"M2 gradient_sync {sync:16s}: step peak with 4 micro-batches {worst['step_peak_4'] / gib:.2f} GiB, "
                f"with 1 {worst['step_peak_1'] / gib:.2f} GiB = ratio {ratio:.3f} (the step's own rise: "
                f"{worst['step_rise_4'] / gib:.2f} vs {worst['step_rise_1'] / gib:.2f} GiB)"
            )

        from raytrain.job.spec import JobSpec
        from raytrain.model.facts import read_facts
        from raytrain.validate.memory import RUNTIME_CPU, estimate

        for strategy, finetune in (("fsdp2", "lora"), ("fsdp2", "full"), ("zero3", "lora"), ("zero3", "full")):
            job = h.job(
                s,
                f"m3-{strategy}-{finetune}",
                folder / "runs",
                model,
                data,
                training={"strategy": strategy, "finetune": finetune, "gradient_sync": "auto", "micro_batch_size": 1},
            )
            ranks = _run(s, folder, f"m3-{strategy}-{finetune}", job, steps=True)
            measured = max(r["step_peak_1"] - r["base"] for r in ranks)
            predicted = estimate(JobSpec.model_validate(job), read_facts(model), s.workers)
            ratio = measured / (predicted.total - RUNTIME_CPU.bytes)  # measured above the bare process
            result[f"ratio_m3_{strategy}_{finetune}"] = ratio
            print(
                f"M3 {strategy} {finetune:4s}: measured peak of a step above the bare process {measured / gib:.2f} GiB "
                f"/ estimate {predicted.total / gib:.2f} GiB = {ratio:.2f}  ({predicted.arithmetic()})"
            )

        from raytrain.rundir import signing

        signing.ensure_key()  # as `raytrain run` does: the workers here sign and verify with the key file
        small, _ = h.assets(s, hidden=hidden // 2, layers=layers)  # a full checkpoint is 12 B a parameter
        for strategy in ("fsdp2", "zero3"):
            job = h.job(
                s,
                f"m4-{strategy}",
                folder / "runs",
                small,
                data,
                training={"strategy": strategy, "finetune": "full", "gradient_sync": "auto"},
            )
            checkpoint = str(folder / f"m4-{strategy}" / "step_00000001")
            _run(s, folder, f"m4-{strategy}-save", job, fn=restore_reads, checkpoint=checkpoint, save=True)
            ranks = _run(s, folder, f"m4-{strategy}-restore", job, fn=restore_reads, checkpoint=checkpoint, save=False)
            share = ranks[0]["checkpoint_bytes"] / s.workers
            fetched, before = max(r["fetched"] for r in ranks), max(r["before"] for r in ranks)
            result[f"ratio_m4_{strategy}"], result[f"ratio_m4_{strategy}_before"] = fetched / share, before / share
            print(
                f"M4 {strategy}: checkpoint {ranks[0]['checkpoint_bytes'] / gib:.2f} GiB; the busiest rank reads "
                f"{fetched / gib:.2f} GiB from storage = {fetched / share:.2f} x (checkpoint / N) "
                f"(all its reads, the local copy included: {max(r['rchar'] for r in ranks) / gib:.2f} GiB); "
                f"before: {before / gib:.2f} GiB = {before / share:.2f} x"
            )
        return result
    finally:
        ray.shutdown()
        h.cleanup(folder)
