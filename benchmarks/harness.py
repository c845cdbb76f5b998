"""The shared harness: sizes, assets, job files, child processes timed from outside, stats.

Both arms of every benchmark are timed the same way, from the bench process: each arm
appends one line per finished step to `<step_log>/rank0.jsonl` (raytrain through its
`data.sample_log`, the bare script by itself), and a watcher thread here polls
that file every 2 ms. So "first finished step" and "steady step period" mean the same
wall-clock thing for both arms, whatever each framework reports about itself.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
# Built models and data, reused between runs (git-ignored); BENCH_CACHE puts them elsewhere (the
# smoke test: its own, since a store signed under another session's key is refused, as it must be).
CACHE = Path(os.environ.get("BENCH_CACHE") or REPO / "benchmarks" / ".cache")
STEP_LOG_ENV = "BENCH_STEP_LOG"  # each arm's step-log folder (raytrain: passed on as data.sample_log)


@dataclass(frozen=True)
class Setting:
    """One size of the benchmarks. `quick` fits a 2-core CPU box; `gpu` is for real hardware."""

    name: str
    hidden: int = 256
    layers: int = 4
    seq_len: int = 128
    global_batch: int = 16
    micro_batch: int = 4
    steps: int = 25  # optimizer steps per run of a throughput arm
    warmup: int = 5  # steps left out of the steady-state window
    reps: int = 3  # alternating repetitions per arm
    workers: int = 2
    gpu: bool = False
    model_path: str | None = None  # GPU mode: a real HF model folder instead of a generated Llama
    data_path: str | None = None  # GPU mode: a real jsonl; else the generated toy text
    data_rows: int = 8000  # rows of generated toy text (about 60 tokens each)
    timeout_s: float = 900.0


SETTINGS = {
    # ~3.3M-parameter Llama, 2 gloo ranks, 1 thread each: steps of a few hundred ms here.
    "quick": Setting("quick"),
    # The smallest setting: what the CI smoke test runs (seconds per run, not minutes).
    "smoke": Setting(
        "smoke", hidden=64, layers=2, seq_len=32, global_batch=8, micro_batch=2, steps=6, warmup=2, reps=1
    ),
    # Real hardware: 8 GPUs, NCCL, bf16 compute; pass --model/--data for a real model and data.
    "gpu": Setting(
        "gpu",
        hidden=2048,
        layers=16,
        seq_len=2048,
        global_batch=64,
        micro_batch=2,
        steps=50,
        warmup=10,
        reps=3,
        workers=8,
        gpu=True,
        data_rows=400_000,
        timeout_s=3600.0,
    ),
}


# ---------------------------------------------------------------- assets
def assets(s: Setting, hidden: int | None = None, layers: int | None = None) -> tuple[Path, Path]:
    """(model folder, data file) for a setting; generated once into benchmarks/.cache."""
    from raytrain.demo_assets import make_all, make_model

    base = make_all(CACHE / f"base-{s.data_rows}", rows=s.data_rows)
    data = Path(s.data_path) if s.data_path else base / "text.jsonl"
    if s.model_path:
        return Path(s.model_path), data
    hidden, layers = hidden or s.hidden, layers or s.layers
    out = CACHE / f"llama-h{hidden}-l{layers}"
    if not (out / "config.json").exists():
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(base / "model"))
        make_model(out, vocab_size=len(tok), hidden=hidden, layers=layers)
        tok.save_pretrained(str(out))
    return out, data


def job(s: Setting, name: str, storage: Path, model: Path, data_file: Path, **over) -> dict:
    """A raytrain job dict for this setting; keyword sections are merged over it."""
    raw = {
        "name": name,
        "model": {"path": str(model)},
        "data": {"path": str(data_file), "seq_len": s.seq_len, "shuffle_window": 256},
        # gradient_sync: the bare FSDP2 script's rule (reduce on the last micro-batch), so P1/P2 compare one algorithm.
        "training": {
            "strategy": "fsdp2",
            "finetune": "full",
            "global_batch_size": s.global_batch,
            "micro_batch_size": s.micro_batch,
            "max_steps": s.steps,
            "seed": 0,
            "gradient_sync": "last_micro_batch",
        },
        "optimizer": {"lr": 1e-3, "warmup_steps": 2},
        "scaling": {"num_workers": s.workers, "use_gpu": s.gpu},
        # P1/P2: one checkpoint, after the last step, outside every timing window.
        "checkpoint": {"storage_path": str(storage), "every_n_steps": 10**6, "export_final": False},
        "tracking": {"experiment": "bench"},
    }
    for section, values in over.items():
        raw[section] = {**raw.get(section, {}), **values}
    return raw


def write_job(raw: dict, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


# ---------------------------------------------------------------- child processes timed from outside
def startup_phases(lines: list[str], attempt: int = 1) -> dict[str, float]:
    """The phases of raytrain's own start-up line (`timeline.py`) among `lines`, for that attempt, in seconds
    (attempt 1: since `raytrain run` started; later ones: since their workers came up)."""
    marker = "] start-up: " if attempt == 1 else f"] attempt {attempt} start-up"
    line = next((text for text in lines if marker in text), "")
    return {name: float(value) for name, value in re.findall(r"(\w+) \+?([\d.]+)s", line.split(marker, 1)[-1])}


@dataclass
class ArmRun:
    label: str
    command: list[str]
    launched: float  # time.time() just before Popen
    step_times: list[float] = field(default_factory=list)  # wall time each step line appeared
    lines: list[dict] = field(default_factory=list)  # the step lines themselves
    returncode: int | None = None
    log: Path | None = None
    wall_s: float = 0.0
    output: list[tuple[float, str]] = field(default_factory=list)  # (wall time read, line) of the child's output

    def seen(self, text: str) -> float | None:
        """Seconds from launch to the first output line containing `text`."""
        return next((t - self.launched for t, line in self.output if text in line), None)

    def startup(self, attempt: int = 1) -> dict[str, float]:
        """The phases of raytrain's own start-up line (`timeline.py`) for that attempt, in seconds
        (attempt 1: since `raytrain run` started; later ones: since their workers came up)."""
        return startup_phases([text for _, text in self.output], attempt)

    @property
    def exit_s(self) -> float:
        """Last finished step -> process exit, seconds."""
        return self.launched + self.wall_s - self.step_times[-1]

    @property
    def first_step_s(self) -> float:
        """Launch -> first finished step, seconds."""
        return self.step_times[0] - self.launched

    def period_s(self, warmup: int, steps: list[float] | None = None) -> float:
        """Steady step period: wall time per step after `warmup` steps, to the last step."""
        t = steps if steps is not None else self.step_times
        if len(t) - warmup < 2:
            raise RuntimeError(f"{self.label}: only {len(t)} steps seen; need more than warmup={warmup} + 1")
        return (t[-1] - t[warmup]) / (len(t) - 1 - warmup)


def run_arm(
    label: str, command: list[str], step_log: Path, env: dict | None = None, timeout_s: float = 900.0, cwd: Path = REPO
) -> ArmRun:
    """Run one arm to completion, recording when each step line appears in step_log/rank0.jsonl."""
    step_log.mkdir(parents=True, exist_ok=True)
    target = step_log / "rank0.jsonl"
    log = step_log / "output.log"
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", STEP_LOG_ENV: str(step_log), **(env or {})}
    run = ArmRun(label, command, time.time(), log=log)
    stop = threading.Event()

    def watch() -> None:  # 2 ms polls: a size change means new step lines
        seen = 0
        while True:
            done = stop.is_set()  # read first: one last look after the child exits
            try:
                size = target.stat().st_size
            except FileNotFoundError:
                size = 0
            if size != seen:
                now = time.time()
                text = target.read_bytes().decode(errors="replace")
                complete = text[: text.rfind("\n") + 1]
                seen = len(complete.encode())
                new = [json.loads(line) for line in complete.splitlines()[len(run.lines) :]]
                run.lines.extend(new)
                run.step_times.extend([now] * len(new))
            if done:
                return
            time.sleep(0.002)

    def read(pipe, out) -> None:  # the child's output, each line stamped when it arrives
        for line in iter(pipe.readline, ""):
            run.output.append((time.time(), line.rstrip("\n")))
            out.write(line)

    watcher = threading.Thread(target=watch, daemon=True)
    with open(log, "w") as out:
        run.launched = time.time()
        proc = subprocess.Popen(
            command,
            cwd=cwd,
            env=full_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
        )
        watcher.start()
        reader = threading.Thread(target=read, args=(proc.stdout, out), daemon=True)
        reader.start()
        try:
            run.returncode = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()  # only the child we started
            run.returncode = proc.wait()
        reader.join(timeout=30)
    run.wall_s = time.time() - run.launched
    stop.set()
    watcher.join()
    if run.returncode != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{label} exited with {run.returncode}; last output:\n{tail}")
    return run


def fault_env(folder: Path, faults: list[dict]) -> dict:
    """Environment for an arm whose private Ray cluster loads the tests' fault injector
    (tests/inject/sitecustomize.py) armed with `faults`: raytrain itself has no fault code."""
    (folder / "fault-markers").mkdir(parents=True, exist_ok=True)
    (folder / "faults.json").write_text(json.dumps({"dir": str(folder / "fault-markers"), "faults": faults}))
    path = os.pathsep.join(filter(None, [str(REPO / "tests" / "inject"), os.environ.get("PYTHONPATH")]))
    return {"PYTHONPATH": path, "RAYTRAIN_TEST_FAULTS": str(folder / "faults.json")}


def raytrain_command(job_file: Path, *extra: str) -> list[str]:
    """The product's own submit path (`raytrain run job.yaml`), through a thin wrapper that
    can install a benchmark-side patch first (see arm_raytrain.py)."""
    return [sys.executable, "-m", "benchmarks.arm_raytrain", str(job_file), *extra]


def prepared_store(s: Setting, model: Path, data: Path) -> str:
    """The token store of this setting's job (what the bare arm reads), prepared once by
    the product's own `raytrain prepare` into the cache."""
    folder = CACHE / "stores"
    job_file = write_job(job(s, "store", folder, model, data), folder / f"{s.name}-{s.seq_len}")
    proc = subprocess.run(
        [sys.executable, "-m", "raytrain", "prepare", str(job_file)],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("[raytrain] token store ready: ")), None)
    if proc.returncode or line is None:
        raise RuntimeError(f"raytrain prepare failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return line.removeprefix("[raytrain] token store ready: ").split(" (")[0]


def batch_args(s: Setting) -> list[str]:
    """The job's shape as the bare arms' scripts take it (bare_fsdp2.py, trl_start.py)."""
    return [
        "--seq-len",
        str(s.seq_len),
        "--global-batch",
        str(s.global_batch),
        "--micro-batch",
        str(s.micro_batch),
        "--steps",
        str(s.steps),
    ]


def torchrun_command(s: Setting, model: Path, data: Path, out_json: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={s.workers}",
        str(REPO / "benchmarks" / "bare_fsdp2.py"),
        "--model",
        str(model),
        "--store",
        prepared_store(s, model, data),
        *batch_args(s),
        "--out",
        str(out_json),
        *(["--gpu"] if s.gpu else []),
        *extra,
    ]


def ray_train_command(s: Setting, model: Path, data: Path, out_json: Path) -> list[str]:
    """The same bare loop in a plain TorchTrainer on its own local Ray cluster: what Ray Train
    itself costs (bare_in_ray_train.py)."""
    torchrun = torchrun_command(s, model, data, out_json)
    script = torchrun.index(str(REPO / "benchmarks" / "bare_fsdp2.py"))
    return [
        sys.executable,
        "-m",
        "benchmarks.bare_in_ray_train",
        "--workers",
        str(s.workers),
        "--",
        *torchrun[script + 1 :],
    ]


def bare_env(s: Setting) -> dict:
    # Ray Train gives each CPU worker OMP_NUM_THREADS=1; the bare arm gets the same threads per rank.
    return {} if s.gpu else {"OMP_NUM_THREADS": "1"}


# ---------------------------------------------------------------- MLflow read-back (raytrain arms)
def mlflow_run(storage: Path):
    """(client, run) of the one raytrain run under a storage folder."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{storage.resolve()}/mlflow.db")
    exp = client.get_experiment_by_name("bench")
    runs = client.search_runs([exp.experiment_id], order_by=["attributes.start_time DESC"], max_results=1)
    return client, runs[0]


def metric_series(storage: Path, key: str) -> dict[int, float]:
    client, run = mlflow_run(storage)
    return {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}


# ---------------------------------------------------------------- stats and printing
def median(values) -> float:
    return statistics.median(values)


def alternate(reps: int, arms: list) -> list:
    """A B, B A, A B, ...: each arm goes first as often as the other, so drift cancels."""
    order = []
    for i in range(reps):
        order.extend(arms if i % 2 == 0 else list(reversed(arms)))
    return order


def ratio_line(
    name: str,
    num_label: str,
    num: list[float],
    den_label: str,
    den: list[float],
    unit: str = "s",
    goal: str | None = None,
    fmt: str = ".4f",
) -> float:
    r = median(num) / median(den)
    met = ""
    if goal:
        op, target = goal.split()
        met = f"  goal {goal}: {'met' if (r <= float(target) if op == '<=' else r >= float(target)) else 'MISSED'}"
    print(
        f"{name}: {num_label} median {median(num):{fmt}} {unit} {_spread(num)} / {den_label} median "
        f"{median(den):{fmt}} {unit} {_spread(den)} = ratio {r:.3f}{met}",
        flush=True,
    )
    return r


def _spread(values: list[float]) -> str:
    return f"(n={len(values)}, {min(values):.4g}..{max(values):.4g})"


def header(title: str, s: Setting) -> None:
    import torch

    load = os.getloadavg()
    print(
        f"=== {title} | setting {s.name}: hidden {s.hidden}, layers {s.layers}, seq {s.seq_len}, global batch "
        f"{s.global_batch}, micro {s.micro_batch}, workers {s.workers}, "
        f"{'GPU/NCCL/bf16' if s.gpu else 'CPU/gloo/fp32'}",
        flush=True,
    )
    print(
        f"    machine: {platform.node()} {os.cpu_count()} cores, load average {load[0]:.2f} {load[1]:.2f} "
        f"{load[2]:.2f}; python {platform.python_version()}, torch {torch.__version__}",
        flush=True,
    )
    print(f"    command: python -m benchmarks.bench {' '.join(sys.argv[1:])}", flush=True)


def scratch(name: str) -> Path:
    """A fresh folder for one arm's run (checkpoints, MLflow db, step log)."""
    path = CACHE / "runs" / f"{name}-{time.time_ns()}"
    path.mkdir(parents=True)
    return path


def cleanup(path: Path) -> None:
    if os.environ.get("BENCH_KEEP") != "1":
        shutil.rmtree(path, ignore_errors=True)


def with_overrides(s: Setting, **kw) -> Setting:
    return replace(s, **{k: v for k, v in kw.items() if v is not None})
