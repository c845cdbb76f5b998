"""RL1: GRPO's whole step, raytrain / TRL's GRPOTrainer, on the same model, prompts and rollout shape.

    python -m benchmarks.rl [--reps 2] [--steps 6] [--prompts 4] [--generations 8] [--completion 32]
                            [--finetune lora|full] [--model tiny|smollm2] [--arms raytrain trl [raytrain-ddp]
                            [raytrain-vllm]]
                            [--no-decompose] [--log FILE]

RL1  steady whole-step time, raytrain / TRL (median over the steps after the first 2)      goal <= 1.0
     + each arm's rollout tokens per second (a rank's generated tokens / its generation time)
     + the share of raytrain's step in generation, reward and training (the rest).

Arms, alternated (raytrain, trl, trl, raytrain, ...: harness.alternate), each a fresh process tree:
  raytrain  `raytrain run job.yaml` (benchmarks.arm_raytrain: `cli.entry` -> `launcher.run`): a GRPO job with
            the product's defaults (fsdp2, LoRA r16/alpha 32 on the attention and MLP projections, 2 CPU
            workers, fp32); each rank completes its prompts in one micro-batch (micro_batch_size = G / 2),
            so a rank runs one rollout and one forward/backward a step, as TRL's does. Figures from MLflow:
            step_time_s, time/generation_s, time/reward_s, generation_tokens_per_s,
            completions/mean_length (rank 0's rollout, as the product logs them).
  trl       TRL's GRPOTrainer under torchrun, 2 CPU processes (gloo, DDP), use_cpu, the same model with
            peft's LoraConfig of the same rank, alpha and modules; per_device_train_batch_size = G x
            num_generations / 2 completions, gradient_accumulation_steps 1 (so one generation batch of G
            prompts a step), beta 0, loss_type dapo, no vLLM, no gradient checkpointing, fp32. Each
            optimizer step timed by a TrainerCallback (on_step_begin -> on_step_end, perf_counter); the
            generation (`_generate_single_turn`) and the rewards (`_calculate_rewards`) timed by a subclass.
  raytrain-ddp  (only when named in --arms) the raytrain job with training.strategy: ddp, TRL's parallelism.
  raytrain-vllm (only when named) the raytrain job with training.grpo.engine: vllm (its rollouts on a vLLM engine
            beside each worker, .venv-vllm); also prints its weight sync's seconds and MB a step.

Then (unless --no-decompose) `rollout_probe`: one rank's rollout of the same shape, raytrain's strategy built as the
job's workers build it under torchrun, timed as shipped and with the FSDP2 model unsharded once for the whole rollout;
raytrain's sampler against softmax + multinomial; and transformers' generate on an unsharded peft copy (TRL's rollout):
where raytrain's generation time goes; and the step's training half, `loop.train_step` on that strategy without the
rollout, against a plain step on the unsharded copy. `--arms` with no arm runs the probe alone.

Both: the same prompts file (the demo's `prompt` rows, TRL's shape), num_generations, max_completion_length, temperature
1.0 (top_p 1, no top_k), the demo's reward function (`raytrain.demo_assets:lipogram`), seed 0, lr 1e-5 constant, grad
clip 1.0, AdamW. Prompts are 3 tokens; raytrain trains rows of data.seq_len = 3 + max_completion_length, TRL pads to the
batch's longest prompt + completion: the same length here.

Model (--model smollm2, the default): a Llama of SmolLM2-135M's shape (hidden 576, 30 layers, 9 / 3 heads, MLP 1536,
vocabulary 49152, tied embeddings; random weights, fp32; `benchmarks.memory.smollm2_shape`), with the demo's tokenizer
(vocabulary 384: sampled ids past it decode to nothing, so most completions are empty text and score 0; the work per
step does not depend on the scores). A random model rarely samples the end token (id 0: 1 in 49152), so both arms run
every completion to max_completion_length; the mean lengths are printed, and tokens/s is the fair figure if they differ.

Prompts: the demo's 1,000 prompt rows (`demo_assets.prompt_rows`, "the green fox"), the `prompt` column alone
(benchmarks/.cache/rl1/prompts.jsonl): raytrain carries a row's other columns beside the prompt within data.seq_len, and
`solution` (45 bytes of JSON with the prompt) would not fit in 3 + 32.

The output is written to benchmarks/results/rl1-<date>.log as well as printed."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

REWARD = "raytrain.demo_assets:lipogram"
WARMUP = 2  # steps left out of the steady-state medians
LR = 1e-5
LORA = {"r": 16, "alpha": 32.0, "dropout": 0.0}  # raytrain's LoraSpec defaults


# ---------------------------------------------------------------- the TRL arm (runs under torchrun)
def trl_worker(argv: list[str]) -> None:
    """One rank of the TRL arm: GRPOTrainer over the prompts, each step's timings to --out (rank<k>.json)
    and one line a finished step to $BENCH_STEP_LOG/rank0.jsonl (rank 0; the harness's outside clock)."""
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--per-device", type=int, required=True)
    p.add_argument("--generations", type=int, required=True)
    p.add_argument("--completion", type=int, required=True)
    p.add_argument("--finetune", choices=["lora", "full"], required=True)
    args = p.parse_args(argv)

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from raytrain.demo_assets import lipogram

    rank = int(os.environ.get("RANK", "0"))
    threads = int(os.environ.get("OMP_NUM_THREADS", "1"))
    torch.set_num_threads(threads)  # as raytrain's CPU workers: the worker's CPU share (1 of 2 cores)
    rows = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    dataset = Dataset.from_list(rows)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    peft_config = None
    if args.finetune == "lora":
        from peft import LoraConfig

        peft_config = LoraConfig(
            r=LORA["r"],
            lora_alpha=LORA["alpha"],
            lora_dropout=LORA["dropout"],
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
            task_type="CAUSAL_LM",
        )
    out = Path(args.out)
    config = GRPOConfig(
        output_dir=str(out / "trainer"),
        use_cpu=True,
        seed=0,
        data_seed=0,
        per_device_train_batch_size=args.per_device,
        gradient_accumulation_steps=1,
        num_generations=args.generations,
        max_completion_length=args.completion,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        loss_type="dapo",
        beta=0.0,
        num_iterations=1,
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=1.0,
        weight_decay=0.0,
        max_steps=args.steps,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        use_vllm=False,
        ddp_find_unused_parameters=False,
        dataloader_num_workers=0,
    )
    steps: list[dict] = []
    step_log = os.environ.get("BENCH_STEP_LOG")
    current = {"gen_s": 0.0, "reward_s": 0.0, "tokens": 0, "completions": 0}

    class Timed(GRPOTrainer):
        def _generate_single_turn(self, *a, **kw):
            t0 = time.perf_counter()
            completion_ids, logprobs = super()._generate_single_turn(*a, **kw)
            current["gen_s"] += time.perf_counter() - t0
            current["tokens"] += sum(map(len, completion_ids))
            current["completions"] += len(completion_ids)
            return completion_ids, logprobs

        def _calculate_rewards(self, *a, **kw):
            t0 = time.perf_counter()
            try:
                return super()._calculate_rewards(*a, **kw)
            finally:
                current["reward_s"] += time.perf_counter() - t0

    class StepClock(TrainerCallback):
        def on_step_begin(self, args_, state, control, **kw):
            current.update(gen_s=0.0, reward_s=0.0, tokens=0, completions=0, began=time.perf_counter())

        def on_step_end(self, args_, state, control, **kw):
            now = time.perf_counter()
            rec = {
                "step": state.global_step,
                "step_s": now - current["began"],
                "end": now,
                "gen_s": current["gen_s"],
                "reward_s": current["reward_s"],
                "tokens": current["tokens"],
                "completions": current["completions"],
            }
            steps.append(rec)
            if rank == 0 and step_log:
                with open(Path(step_log) / "rank0.jsonl", "a") as f:
                    f.write(json.dumps({"step": state.global_step}) + "\n")

    trainer = Timed(
        model=model,
        reward_funcs=lipogram,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=[StepClock()],
    )
    trainer.train()
    logged = [{k: v for k, v in h.items() if isinstance(v, (int, float))} for h in trainer.state.log_history]
    (out / f"rank{rank}.json").write_text(
        json.dumps({"steps": steps, "log_history": logged, "torch_threads": torch.get_num_threads()})
    )


# ---------------------------------------------------------------- where raytrain's rollout goes (under torchrun)
def rollout_probe(argv: list[str]) -> None:
    """One rank of the decomposition: raytrain's strategy built as a job's workers build it (`build_strategy`,
    fsdp2, the job's LoRA), then one rank's rollout of the same shape as the job's, timed as shipped and with
    parts changed on the benchmark's side only: the FSDP2 model unsharded once for the whole rollout (one
    all-gather, not one a layer a token); the sampler alone (raytrain's keyed sampler
    against transformers' softmax + multinomial); and transformers' `generate` on an unsharded peft copy of the
    model in this process (what TRL's rank runs). Each timed twice, the second kept."""
    p = argparse.ArgumentParser()
    p.add_argument("--job", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--sequences", type=int, required=True)
    p.add_argument("--completion", type=int, required=True)
    args = p.parse_args(argv)

    import torch
    import torch.distributed as dist
    import yaml
    from torch.distributed.fsdp import FSDPModule

    from raytrain.job.spec import JobSpec
    from raytrain.rl import sampling
    from raytrain.strategies import build_strategy

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    spec = JobSpec.model_validate(yaml.safe_load(Path(args.job).read_text()))
    strategy = build_strategy(spec, torch.device("cpu"))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(spec.model.path)
    texts = [json.loads(line)["prompt"] for line in Path(spec.data.path).read_text().splitlines()[: args.sequences]]
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    keys = [sampling.completion_key(0, 0, (0, 0, i), 0) for i in range(args.sequences)]
    n, out = args.completion, {}

    def timed(name: str, fn) -> None:
        for _ in range(2):
            dist.barrier()
            t0 = time.perf_counter()
            result = fn()
            out[name] = time.perf_counter() - t0
        if isinstance(result, list):
            out[name + "_tokens"] = sum(map(len, result))

    def rollout():
        return sampling.rollout(strategy, prompts, keys, n, 1.0, 1.0, {0}, 0)

    timed("rollout", rollout)
    fsdp = [m for m in strategy.model.modules() if isinstance(m, FSDPModule)]

    def unsharded():
        for m in fsdp:
            m.unshard()
        for m in fsdp:
            m.set_reshard_after_forward(False, recurse=False)
        try:
            return rollout()
        finally:
            for m in fsdp:  # nothing trains on this strategy afterwards: its resharding settings are left as set
                m.reshard()

    timed("rollout_unsharded", unsharded)
    vocab = strategy.hf_model.config.vocab_size
    logits = torch.randn(args.sequences, vocab)
    keys_t = torch.tensor(keys, dtype=torch.long)
    timed("gumbel_sampler", lambda: [sampling.sample(logits, keys_t, t, 1.0, 1.0) for t in range(n)] and None)
    timed(
        "multinomial_sampler",
        lambda: [torch.multinomial(torch.softmax(logits / 1.0, -1), 1) for _ in range(n)] and None,
    )

    # The step's training half on the same strategy: raytrain's `loop.train_step` over one micro-batch of rows
    # shaped as the rollout makes them (prompt + a full completion, only the completion labelled), the GRPO
    # loss, FSDP2's backward, clipping and AdamW; the rollout (`begin`) left out.
    import torch.nn.functional as F

    from raytrain.data import IGNORE
    from raytrain.objectives.grpo import GRPO
    from raytrain.train import loop
    from raytrain.train.preemption import StopSignals

    grpo, width = GRPO(spec), spec.data.seq_len
    first = len(prompts[0])
    gen = torch.Generator().manual_seed(rank)
    rows = torch.cat([torch.tensor([q for q in prompts]), torch.randint(vocab, (len(prompts), n), generator=gen)], 1)
    labels = torch.full_like(rows, IGNORE)
    labels[:, first:] = rows[:, first:]
    adv = torch.randn(len(prompts), generator=gen)

    class Rows:  # GRPO's loss on rows already made: what train_step runs after `begin`
        metrics = grpo.metrics

        def units(self, mb):
            return mb["_units"]

        def __call__(self, strategy_, mb):
            return grpo(strategy_, mb)

    def micro_batch() -> dict:
        return {
            "input_ids": rows.clone(),
            "labels": labels.clone(),
            "position_ids": torch.arange(width)[None].repeat(len(prompts), 1),
            "advantages": adv.clone(),
            "_units": int((labels != IGNORE).sum()),
        }

    stops = StopSignals(None, check_ray_notice=False)
    timed("train_step", lambda: loop.train_step(strategy, Rows(), [micro_batch()], LR, stops))

    def update_only():
        loss, _ = grpo(strategy, micro_batch())
        strategy.backward(loss, sync=True)
        t0 = time.perf_counter()
        strategy.end_update(bool(torch.isfinite(strategy.begin_update(LR))))
        return time.perf_counter() - t0

    for _ in range(2):
        out["train_update"] = update_only()  # clipping + AdamW alone
    strategy = None  # released before the plain copy is built
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(spec.model.path, dtype=torch.float32)
    if spec.training.finetune != "full":
        model = get_peft_model(
            model,
            LoraConfig(
                r=LORA["r"],
                lora_alpha=LORA["alpha"],
                lora_dropout=LORA["dropout"],
                target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                task_type="CAUSAL_LM",
            ),
        )
    model.eval()
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(q)) + q for q in prompts])
    mask = torch.tensor([[0] * (width - len(q)) + [1] * len(q) for q in prompts])

    def generate():
        with torch.no_grad():
            made = model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=True,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
                max_new_tokens=n,
                pad_token_id=0,
                eos_token_id=0,
            )
        return [row[width:].tolist() for row in made]

    timed("hf_generate", generate)
    # A plain step on the same copy (no sharding, no gradient all-reduce): TRL's loss with num_iterations 1
    # and beta 0 (-A exp(logp - logp.detach()) a token, the dapo mean), clipping, AdamW.
    params = [q for q in model.parameters() if q.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=0.0)
    model.train()

    def plain_step():
        logits = model(input_ids=rows, attention_mask=torch.ones_like(rows)).logits[:, first - 1 : -1]
        logps = -F.cross_entropy(logits.flatten(0, 1).float(), rows[:, first:].flatten(), reduction="none").view(
            len(prompts), -1
        )
        loss = -(torch.exp(logps - logps.detach()) * adv[:, None]).sum() / logps.numel()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad()

    timed("plain_step", plain_step)
    Path(args.out, f"probe-rank{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


def decompose(a, model: Path, prompts: Path, seq_len: int) -> dict:
    """Runs rollout_probe on a.workers ranks; rank 0's timings."""
    from . import harness as h

    folder = h.scratch("rl1-probe")
    try:
        job_file = h.write_job(raytrain_job(a, model, prompts, seq_len, folder), folder)
        sequences = a.prompts * a.generations // a.workers
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={a.workers}",
            "-m",
            "benchmarks.rl",
            "_rollout_probe",
            "--job",
            str(job_file),
            "--out",
            str(folder),
            "--sequences",
            str(sequences),
            "--completion",
            str(a.completion),
        ]
        import subprocess

        proc = subprocess.run(
            command,
            cwd=h.REPO,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            capture_output=True,
            text=True,
            timeout=a.timeout,
        )
        if proc.returncode:
            raise RuntimeError(f"rollout probe failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
        return json.loads((folder / "probe-rank0.json").read_text())
    finally:
        h.cleanup(folder)


# ---------------------------------------------------------------- the driver
def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def steady(series: dict[int, float]) -> list[float]:
    return [series[k] for k in sorted(series) if k > WARMUP]


class Tee:
    def __init__(self, path: Path):
        self.file = open(path, "w")
        self.stdout = sys.stdout

    def write(self, text: str) -> None:
        self.stdout.write(text)
        self.file.write(text)

    def flush(self) -> None:
        self.stdout.flush()
        self.file.flush()


def assets(which: str) -> tuple[Path, Path, str]:
    """(model folder, prompts.jsonl, what the model is)."""
    from raytrain.demo_assets import make_all

    from . import harness as h

    base = make_all(h.CACHE / "base-8000", rows=8000)  # as harness.assets: the demo's tokenizer and rows
    # The prompt column alone: raytrain carries a row's other columns beside its prompt (a byte a token, all
    # within data.seq_len), and the demo's `solution` column (which lipogram does not read) would not fit in
    # 3 + 32 tokens. Both arms read this file.
    prompts = h.CACHE / "rl1" / "prompts.jsonl"
    if not prompts.exists():
        prompts.parent.mkdir(parents=True, exist_ok=True)
        rows = [json.loads(line) for line in (base / "prompts.jsonl").read_text().splitlines() if line.strip()]
        prompts.write_text("".join(json.dumps({"prompt": r["prompt"]}) + "\n" for r in rows))
    if which == "tiny":
        return base / "model", prompts, "the demo's tiny Llama (hidden 64, 2 layers, vocab 384): a harness check"
    from .memory import smollm2_shape

    return (
        smollm2_shape(h.SETTINGS["quick"]),
        prompts,
        "a Llama of SmolLM2-135M's shape (hidden 576, 30 layers, 9/3 heads, MLP 1536, vocab 49152, tied "
        "embeddings; 134.5M parameters, random init, fp32) with the demo's tokenizer (vocab 384)",
    )


def prompt_tokens(model: Path, prompts: Path) -> int:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    texts = [json.loads(line)["prompt"] for line in prompts.read_text().splitlines() if line.strip()]
    return max(len(ids) for ids in tok(texts, add_special_tokens=False)["input_ids"])


def raytrain_job(
    a, model: Path, prompts: Path, seq_len: int, folder: Path, strategy: str = "fsdp2", engine: str = "hf"
) -> dict:
    """The raytrain arm's GRPO job: the product's defaults, the settings both arms share."""
    return {
        "name": "rl1-raytrain",
        "model": {"path": str(model)},
        "data": {"path": str(prompts), "format": "prompt", "seq_len": seq_len},
        "training": {
            "objective": "grpo",
            "grpo": {
                "num_generations": a.generations,
                "max_completion_length": a.completion,
                "temperature": 1.0,
                "loss_type": "dapo",
                "rewards": [{"function": REWARD}],
                "engine": engine,
            },
            "strategy": strategy,
            "finetune": a.finetune,
            "global_batch_size": a.prompts,
            "micro_batch_size": a.prompts // a.workers,
            "max_steps": a.steps,
            "seed": 0,
        },
        "optimizer": {"lr": LR, "warmup_steps": 0, "schedule": "constant"},
        "scaling": {"num_workers": a.workers},
        # one checkpoint, after the last step: outside every timed step
        "checkpoint": {"storage_path": str(folder / "runs"), "every_n_steps": 10**6, "export_final": False},
        "tracking": {"experiment": "bench"},
    }


def raytrain_arm(a, model: Path, prompts: Path, seq_len: int, strategy: str = "fsdp2", engine: str = "hf") -> dict:
    from . import harness as h

    folder = h.scratch("rl1-raytrain")
    try:
        raw = raytrain_job(a, model, prompts, seq_len, folder, strategy, engine)
        job_file = h.write_job(raw, folder)
        run = h.run_arm("rl1-raytrain", h.raytrain_command(job_file), folder / "steps", timeout_s=a.timeout)
        keys = (
            "step_time_s",
            "time/generation_s",
            "time/reward_s",
            "generation_tokens_per_s",
            "completions/mean_length",
            "data_wait_s",
            "vllm/sync_s",
            "vllm/sync_mb",
        )
        series = {k: h.metric_series(folder / "runs", k) for k in keys}
        return {"run": run, **series}
    finally:
        h.cleanup(folder)


def trl_arm(a, model: Path, prompts: Path) -> dict:
    from . import harness as h

    folder = h.scratch("rl1-trl")
    try:
        per_device = a.prompts * a.generations // a.workers
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={a.workers}",
            "-m",
            "benchmarks.rl",
            "_trl_worker",
            "--model",
            str(model),
            "--prompts",
            str(prompts),
            "--out",
            str(folder),
            "--steps",
            str(a.steps),
            "--per-device",
            str(per_device),
            "--generations",
            str(a.generations),
            "--completion",
            str(a.completion),
            "--finetune",
            a.finetune,
        ]
        run = h.run_arm("rl1-trl", command, folder / "steps", env={"OMP_NUM_THREADS": "1"}, timeout_s=a.timeout)
        ranks = {int(p.stem[4:]): json.loads(p.read_text()) for p in folder.glob("rank*.json")}
        rank0 = ranks[0]["steps"]
        by_step = {r["step"]: r for r in rank0}
        lengths = {
            h_["step"]: h_["completions/mean_length"]
            for h_ in ranks[0]["log_history"]
            if "completions/mean_length" in h_ and "step" in h_
        }
        return {
            "run": run,
            "threads": ranks[0]["torch_threads"],
            "step_time_s": {k: r["step_s"] for k, r in by_step.items()},
            "time/generation_s": {k: r["gen_s"] for k, r in by_step.items()},
            "time/reward_s": {k: r["reward_s"] for k, r in by_step.items()},
            "generation_tokens_per_s": {k: r["tokens"] / r["gen_s"] for k, r in by_step.items() if r["gen_s"]},
            "completions/mean_length": lengths,
            "completions_per_rank": median([r["completions"] for r in rank0]),
        }
    finally:
        h.cleanup(folder)


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=2, help="runs per arm, alternated")
    p.add_argument("--steps", type=int, default=6, help="optimizer steps a run (the first 2 are left out)")
    p.add_argument("--prompts", type=int, default=4, help="prompts a step (global batch; each with --generations)")
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--completion", type=int, default=32, help="max_completion_length")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--finetune", choices=["lora", "full"], default="lora")
    p.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    p.add_argument(
        "--arms",
        nargs="*",
        default=["raytrain", "trl"],
        choices=["raytrain", "trl", "raytrain-ddp", "raytrain-vllm"],
        help="raytrain-ddp (not in the default): raytrain with training.strategy ddp, TRL's parallelism; "
        "raytrain-vllm: raytrain with training.grpo.engine vllm",
    )
    p.add_argument("--timeout", type=float, default=900.0, help="seconds a run may take")
    p.add_argument("--log", help="default benchmarks/results/rl1-<date>.log")
    p.add_argument("--no-decompose", action="store_true", help="skip the rollout's decomposition (rollout_probe)")
    a = p.parse_args(argv)
    if a.prompts % a.workers:
        p.error("--prompts must be a multiple of --workers (each rank completes the same number of prompts)")

    from . import harness as h

    log = Path(a.log) if a.log else h.REPO / "benchmarks" / "results" / f"rl1-{datetime.date.today().isoformat()}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout = Tee(log)
    import torch
    import transformers
    import trl

    model, prompts, what = assets(a.model)
    seq_len = prompt_tokens(model, prompts) + a.completion
    load = os.getloadavg()
    print(
        f"=== RL1 GRPO whole step: raytrain / TRL's GRPOTrainer | "
        f"{datetime.datetime.now().isoformat(timespec='seconds')}"
    )
    print(f"    command: python -m benchmarks.rl {shlex.join(argv)}")
    print(
        f"    machine: {platform.node()} {os.cpu_count()} cores, load average {load[0]:.2f} {load[1]:.2f} "
        f"{load[2]:.2f}; "
        f"python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}, "
        f"trl {trl.__version__}"
    )
    print(f"    model: {what}; {model}")
    print(
        f"    prompts: {prompts} (the demo's prompt rows, 3 tokens each); {a.prompts} prompts a step x "
        f"{a.generations} generations = {a.prompts * a.generations} completions "
        f"({a.prompts * a.generations // a.workers}"
        f" a rank), max_completion_length {a.completion}, temperature 1.0, reward {REWARD}, loss_type dapo, beta 0"
    )
    print(
        f"    {a.workers} CPU ranks (gloo), fp32, {a.finetune}"
        + (f" (r {LORA['r']}, alpha {LORA['alpha']:g}, q/k/v/o/gate/up/down)" if a.finetune == "lora" else "")
        + f"; raytrain fsdp2, global_batch_size {a.prompts}, micro_batch_size {a.prompts // a.workers}, data.seq_len "
        f"{seq_len}; trl DDP via torchrun, per_device_train_batch_size {a.prompts * a.generations // a.workers}, "
        f"gradient_accumulation_steps 1; {a.steps} steps a run, medians over steps {WARMUP + 1}-{a.steps}; "
        f"{a.reps} runs per arm, alternated",
        flush=True,
    )

    results: dict[str, list[dict]] = {arm: [] for arm in a.arms}
    for arm in h.alternate(a.reps, list(a.arms)):
        started = time.time()
        if arm == "trl":
            r = trl_arm(a, model, prompts)
        else:
            r = raytrain_arm(
                a,
                model,
                prompts,
                seq_len,
                "ddp" if arm == "raytrain-ddp" else "fsdp2",
                "vllm" if arm == "raytrain-vllm" else "hf",
            )
        step = steady(r["step_time_s"])
        gen, rew = steady(r["time/generation_s"]), steady(r["time/reward_s"])
        tps, lengths = steady(r["generation_tokens_per_s"]), steady(r["completions/mean_length"])
        period = r["run"].period_s(WARMUP)
        if r.get("vllm/sync_s"):
            print(
                f"    {arm}: weight sync {median(steady(r['vllm/sync_s'])) * 1e3:.0f} ms a step, "
                f"{median(steady(r['vllm/sync_mb'])):.1f} MB",
                flush=True,
            )
        fig = {
            "step": median(step),
            "gen": median(gen),
            "reward": median(rew),
            "tps": median(tps),
            "length": median(lengths),
            "period": period,
            "first": r["step_time_s"].get(1, float("nan")),
            "train": median([s - g - w for s, g, w in zip(step, gen, rew)]),
            "wall": time.time() - started,
            "load": os.getloadavg()[0],
        }
        results[arm].append(fig)
        print(
            f"    {arm}: whole step {fig['step']:.2f} s (steps: {', '.join(f'{x:.2f}' for x in step)}), period from "
            f"outside {fig['period']:.2f} s, step 1 {fig['first']:.2f} s; generation {fig['gen']:.2f} s, reward "
            f"{fig['reward'] * 1e3:.1f} ms, rest {fig['train']:.2f} s; rank-0 rollout {fig['tps']:.1f} tokens/s; "
            f"completion mean length {fig['length']:.1f}; run {fig['wall']:.0f} s; load {fig['load']:.2f}",
            flush=True,
        )

    if not a.no_decompose:
        started = time.time()
        d = decompose(a, model, prompts, seq_len)
        seqs = a.prompts * a.generations // a.workers
        print(
            f"RL1 rollout decomposition (rank 0 of {a.workers}, {seqs} completions x {a.completion} tokens, the "
            f"job's strategy built outside Ray; {time.time() - started:.0f} s): raytrain's rollout as shipped "
            f"{d['rollout']:.2f} s ({d['rollout_tokens'] / d['rollout']:.1f} tokens/s); the FSDP2 model unsharded "
            f"once for the whole rollout {d['rollout_unsharded']:.2f} s "
            f"({d['rollout_unsharded_tokens'] / d['rollout_unsharded']:.1f} tokens/s, "
            f"{d['rollout_unsharded'] / d['rollout']:.2f}x); "
            f"its keyed sampler alone {d['gumbel_sampler']:.2f} s for {a.completion} tokens vs softmax + "
            f"multinomial {d['multinomial_sampler']:.2f} s; transformers' generate on an unsharded peft copy "
            f"{d['hf_generate']:.2f} s ({d['hf_generate_tokens'] / d['hf_generate']:.1f} tokens/s)",
            flush=True,
        )
        print(
            f"RL1 training decomposition (same rank, one micro-batch of {seqs} rows of {seq_len} tokens): raytrain's "
            f"loop.train_step without the rollout (GRPO loss, FSDP2 forward/backward, clip, AdamW) "
            f"{d['train_step']:.2f} s, of which clip + AdamW {d['train_update']:.2f} s; a plain step on the "
            f"unsharded peft copy (TRL's loss, one process) {d['plain_step']:.2f} s = ratio "
            f"{d['train_step'] / d['plain_step']:.2f}",
            flush=True,
        )

    if "raytrain-ddp" in results and "trl" in results:
        ry, tr = results["raytrain-ddp"], results["trl"]
        step = median([x["step"] for x in ry]) / median([x["step"] for x in tr])
        gen = median([x["gen"] for x in ry]) / median([x["gen"] for x in tr])
        rest = median([x["step"] - x["gen"] for x in ry]) / median([x["step"] - x["gen"] for x in tr])
        print(
            f"RL1 with training.strategy ddp (TRL's parallelism): raytrain-ddp / trl whole step {step:.3f}, "
            f"generation {gen:.3f}, the rest {rest:.3f}",
            flush=True,
        )
    for arm in ("raytrain-vllm", "raytrain"):
        if arm in results and "trl" in results and (arm == "raytrain-vllm" or "raytrain-vllm" in results):
            ry, tr = results[arm], results["trl"]
            print(
                f"RL1 {arm} / trl (TRL on generate): whole step "
                f"{median([x['step'] for x in ry]) / median([x['step'] for x in tr]):.3f}, generation "
                f"{median([x['gen'] for x in ry]) / median([x['gen'] for x in tr]):.3f}; {arm}'s step: generation "
                f"{median([x['gen'] / x['step'] for x in ry]):.1%}",
                flush=True,
            )
    if not {"raytrain", "trl"} <= set(results):
        return
    ry, tr = results["raytrain"], results["trl"]

    def m(rs: list[dict], k: str) -> float:
        return median([x[k] for x in rs])

    def spread(rs: list[dict], k: str) -> str:
        v = [x[k] for x in rs]
        return f"(n={len(v)}, {min(v):.3g}..{max(v):.3g})"

    ratio = m(ry, "step") / m(tr, "step")
    print(
        f"RL1 whole step (median): raytrain {m(ry, 'step'):.2f} s {spread(ry, 'step')} / trl {m(tr, 'step'):.2f} s "
        f"{spread(tr, 'step')} = ratio {ratio:.3f}  goal <= 1.0: {'met' if ratio <= 1.0 else 'MISSED'}"
    )
    print(
        f"RL1 step period from outside: raytrain {m(ry, 'period'):.2f} s / trl {m(tr, 'period'):.2f} s = ratio "
        f"{m(ry, 'period') / m(tr, 'period'):.3f}"
    )
    print(
        f"RL1 rollout tokens/s (a rank's generated tokens / its generation time, rank 0): raytrain "
        f"{m(ry, 'tps'):.1f} {spread(ry, 'tps')} / trl {m(tr, 'tps'):.1f} {spread(tr, 'tps')} = ratio "
        f"{m(ry, 'tps') / m(tr, 'tps'):.3f} (both ranks together: x{a.workers})"
    )
    print(
        f"RL1 generation time a step: raytrain {m(ry, 'gen'):.2f} s / trl {m(tr, 'gen'):.2f} s = ratio "
        f"{m(ry, 'gen') / m(tr, 'gen'):.3f}; the rest (reward + training): raytrain "
        f"{m(ry, 'step') - m(ry, 'gen'):.2f} s / trl {m(tr, 'step') - m(tr, 'gen'):.2f} s = ratio "
        f"{(m(ry, 'step') - m(ry, 'gen')) / (m(tr, 'step') - m(tr, 'gen')):.3f}"
    )
    print(
        f"RL1 completion mean length: raytrain {m(ry, 'length'):.2f} / trl {m(tr, 'length'):.2f} tokens "
        f"(max {a.completion})"
    )
    for name, rs in (("raytrain", ry), ("trl", tr)):
        s = m(rs, "step")
        print(
            f"RL1 {name} step split: generation {m(rs, 'gen') / s:.1%}, reward {m(rs, 'reward') / s:.2%}, "
            f"training (step - generation - reward) {m(rs, 'train') / s:.1%}"
        )
    print(
        f"SUMMARY RL1 raytrain/trl whole step {ratio:.3f} ({m(ry, 'step'):.2f} / {m(tr, 'step'):.2f} s); rollout "
        f"tokens/s {m(ry, 'tps'):.1f} / {m(tr, 'tps'):.1f}; raytrain step: generation "
        f"{m(ry, 'gen') / m(ry, 'step'):.1%}, "
        f"reward {m(ry, 'reward') / m(ry, 'step'):.2%}, training {m(ry, 'train') / m(ry, 'step'):.1%}; mean length "
        f"{m(ry, 'length'):.1f} / {m(tr, 'length'):.1f}; log {log}",
        flush=True,
    )


if __name__ == "__main__":
    if sys.argv[1:2] == ["_trl_worker"]:
        trl_worker(sys.argv[2:])
    elif sys.argv[1:2] == ["_rollout_probe"]:
        rollout_probe(sys.argv[2:])
    else:
        main(sys.argv[1:])
