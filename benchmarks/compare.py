"""P1, P2, P7, P8: one framework or strategy against another on the same model, batch and data.

P1  steady step period, raytrain (Ray Train, FSDP2) / bare torchrun FSDP2.   goal <= 1.02
P2  submit -> first finished step, raytrain / bare torchrun (raytrain cold: it starts its
    own local Ray cluster, as `raytrain run` does; warm: joins a running one, as on a cluster,
    and finds its token store already prepared by an earlier job on the same data).
P0b submit -> first finished step, raytrain (cold) / TRL's SFTTrainer in one process (trl_start.py):
    the same model, rows and batch. goal <= 2.0
P7  FSDP2 / FSDP1 tokens/s and peak memory, both bare.
P8  ZeRO-3 / FSDP2 step period and peak memory, both through raytrain.
P9  DPO / SFT step time through raytrain on the same rows (SFT trains prompt + chosen; DPO
    the pair, plus the reference's forward), LoRA and full fine-tuning.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from . import harness as h


def raytrain_arm(
    s: h.Setting,
    label: str,
    model: Path,
    data_file: Path,
    *extra: str,
    env: dict | None = None,
    inspect=None,
    probe: bool = False,
    primed: bool = False,
    **over,
) -> dict:
    """One raytrain run; its step timings as seen from outside and as logged to MLflow.
    `inspect(folder)`, if given, looks at the run's files before they are deleted;
    `probe` times the workers' per-step stop check (probe.py); `primed`: an untimed run of
    the same data first, so the timed one finds its token store prepared and its MLflow store made."""
    folder = h.scratch(label)
    try:
        if primed:
            prime = h.write_job(h.job(s, f"{label}-prime", folder / "runs", model, data_file, **over), folder / "prime")
            h.run_arm(
                f"{label}-prime",
                h.raytrain_command(prime, *extra),
                folder / "prime-steps",
                env=env,
                timeout_s=s.timeout_s,
            )
        job_file = h.write_job(h.job(s, label, folder / "runs", model, data_file, **over), folder)
        extra += ("--probe-log", str(folder)) if probe else ()
        run = h.run_arm(label, h.raytrain_command(job_file, *extra), folder / "steps", env=env, timeout_s=s.timeout_s)
        series = {
            k: h.metric_series(folder / "runs", k)
            for k in ("step_time_s", "data_wait_s", "loss", "peak_memory_gb", "checkpoint_s")
        }
        probes = {int(p.stem.split("rank")[1]): json.loads(p.read_text()) for p in folder.glob("probe-rank*.json")}
        return {"run": run, "inspected": inspect(folder) if inspect else None, "probe": probes, **series}
    finally:
        h.cleanup(folder)


def bare_arm(s: h.Setting, label: str, model: Path, data: Path, *extra: str, in_ray_train: bool = False) -> dict:
    """The bare FSDP2 loop under torchrun, or (`in_ray_train`) in a plain TorchTrainer."""
    folder = h.scratch(label)
    try:
        out = folder / "bare.json"
        command = (
            h.ray_train_command(s, model, data, out)
            if in_ray_train
            else h.torchrun_command(s, model, data, out, *extra)
        )
        run = h.run_arm(label, command, folder / "steps", env=h.bare_env(s), timeout_s=s.timeout_s)
        result = json.loads(out.read_text())
        return {"run": run, **result}
    finally:
        h.cleanup(folder)


def ordered(values) -> list:
    """Per-step values in step order (values: list or {step: value})."""
    return [values[k] for k in sorted(values)] if isinstance(values, dict) else list(values)


def steady(values, warmup: int) -> float:
    """Median of the per-step values after the warm-up steps."""
    return h.median(ordered(values)[warmup:])


# ---------------------------------------------------------------- P1
# `raytrain-before` puts back what raytrain did before P1's two fixes, to show what they bought side by side:
# the blocking per-step stop check (probe.py) and, on CPU, torch's thread pool sized by the core count.
# `torchrun-fused` is the bare script with raytrain's fused AdamW (`strategies.base.adamw`): P1 is against
# what a hand-rolled script gets (torch's default kernel); against this arm it is the overhead alone.
P1_ARMS = {
    "raytrain": [],
    "torchrun": [],
    "raytrain-before": ["--blocking-check", "--torch-threads", "2"],
    "torchrun-fused": ["--fused"],
}


EARLY = (5, 25)  # steps whose in-loop time P1 also reports: the warm-up transient


def p1(s: h.Setting) -> dict:
    if s.name == "quick":
        # Steady means past the warm-up: on this box a raytrain run's steps 5-25 take ~5% longer than its
        # steps 50-100 (Ray Data's first read-ahead, allocator warm-up), the bare script's ~1% (measured,
        # RESULTS.md). So P1 trains 60 steps and times the last 30; the early window is printed beside it.
        s = h.with_overrides(s, steps=60, warmup=30)
    h.header("P1 steady step time: raytrain (Ray Train + FSDP2) / bare torchrun FSDP2", s)
    model, data = h.assets(s)
    # The smoke setting checks the harness, not the fixes: it runs the two arms the ratio needs.
    arms = [a for a in P1_ARMS if not (s.name == "smoke" and a in ("raytrain-before", "torchrun-fused"))]
    periods, in_loop, early = {a: [] for a in arms}, {a: [] for a in arms}, {a: [] for a in arms}
    first_loss, check = {}, {a: [] for a in arms if not a.startswith("torchrun")}
    for arm in h.alternate(s.reps, arms):
        if arm.startswith("torchrun"):
            r = bare_arm(s, f"p1-{arm}", model, data, *P1_ARMS[arm])
            first_loss[arm] = r["loss"][0]
            note = ""
        else:
            flags = P1_ARMS[arm][:1] if s.gpu else P1_ARMS[arm]  # threads: a CPU-only fix
            r = raytrain_arm(s, f"p1-{arm}", model, data, *flags, probe=True)
            first_loss[arm] = r["loss"][1]
            share = steady({k: r["data_wait_s"][k] / r["step_time_s"][k] for k in r["step_time_s"]}, s.warmup)
            rank0 = {k: steady(v, s.warmup) for k, v in r["probe"].get(0, {}).items() if isinstance(v, list) and v}
            check[arm].append(rank0.get("stop_check_s", 0.0))
            note = (
                f", data wait {share:.1%} of the step; rank-0 stop check per step {check[arm][-1] * 1e3:.2f} ms"
                f" (preemption notice {rank0.get('preemption_info_s', 0) * 1e3:.2f} ms); torch threads per rank "
                f"{r['probe'].get(0, {}).get('torch_threads')}"
            )
        in_loop[arm].append(steady(r["step_time_s"], s.warmup))
        early[arm].append(h.median(ordered(r["step_time_s"])[EARLY[0] : EARLY[1]] or [float("nan")]))
        periods[arm].append(r["run"].period_s(s.warmup))
        print(
            f"    {arm}: period {periods[arm][-1]:.4f} s, in-loop {in_loop[arm][-1]:.4f} s (steps "
            f"{EARLY[0]}-{EARLY[1]}: "
            f"{early[arm][-1]:.4f} s){note}",
            flush=True,
        )
    print("P1 same work: step-1 loss " + ", ".join(f"{a} {v:.6f}" for a, v in first_loss.items()), flush=True)
    ratio = h.ratio_line(
        "P1 step period (wall time between finished steps)",
        "raytrain",
        periods["raytrain"],
        "torchrun",
        periods["torchrun"],
        goal="<= 1.02",
    )
    h.ratio_line(
        "P1 in-loop step time (data + compute + optimizer)",
        "raytrain",
        in_loop["raytrain"],
        "torchrun",
        in_loop["torchrun"],
    )
    if s.steps >= EARLY[1]:
        h.ratio_line(
            f"P1 in-loop step time, early steps {EARLY[0]}-{EARLY[1]}",
            "raytrain",
            early["raytrain"],
            "torchrun",
            early["torchrun"],
        )
    overhead = (
        None
        if "torchrun-fused" not in arms
        else h.ratio_line(
            "P1 overhead alone: step period, raytrain / bare torchrun with raytrain's fused AdamW",
            "raytrain",
            periods["raytrain"],
            "torchrun-fused",
            periods["torchrun-fused"],
            goal="<= 1.02",
        )
    )
    before = (
        None
        if "raytrain-before" not in arms
        else h.ratio_line(
            "P1 step period before P1's fixes",
            "raytrain-before",
            periods["raytrain-before"],
            "torchrun",
            periods["torchrun"],
            goal="<= 1.02",
        )
    )
    for arm, values in check.items():
        print(
            f"P1 {arm}: rank-0 stop check median {h.median(values) * 1e3:.2f} ms per step = "
            f"{h.median(values) / h.median(periods[arm]):.1%} of its step period",
            flush=True,
        )
    return {
        "ratio": ratio,
        "ratio_overhead": overhead,
        "ratio_before": before,
        "periods": periods,
        "in_loop": in_loop,
        "stop_check_s": {a: h.median(v) for a, v in check.items()},
    }


# ---------------------------------------------------------------- P2
def p2(s: h.Setting) -> dict:
    h.header("P2 submit -> first finished step: raytrain / bare torchrun / TRL's SFTTrainer (P0b)", s)
    s = h.with_overrides(s, steps=3)
    model, data = h.assets(s)
    # ray-train: the bare loop in a plain TorchTrainer on its own cluster, Ray Train's own floor.
    first = {"raytrain-cold": [], "raytrain-warm": [], "torchrun": [], "ray-train": [], "trl": []}
    exits: dict[str, list[float]] = {arm: [] for arm in first}
    milestones: dict[tuple[str, str], list[float]] = {}
    for arm in h.alternate(s.reps, list(first)):
        if arm in ("torchrun", "ray-train"):
            r = bare_arm(s, f"p2-{arm}", model, data, in_ray_train=arm == "ray-train")
        elif arm == "trl":
            r = trl_arm(s, model, data)
        elif arm == "raytrain-cold":
            r = raytrain_arm(s, f"p2-{arm}", model, data)
        else:
            with warm_cluster(s) as address:
                r = raytrain_arm(s, "p2-warm", model, data, "--address", address, primed=True)
        first[arm].append(r["run"].first_step_s)
        exits[arm].append(r["run"].exit_s)
        marks = {}
        if arm.startswith("raytrain"):
            marks = {name: r["run"].seen(text) for name, text in MILESTONES.items()}
            # raytrain's own start-up line (seconds since `raytrain run` started, launch ~ the same instant)
            marks.update({f"start-up: {name}": t for name, t in r["run"].startup().items()})
        for name, t in marks.items():
            if t is not None:
                milestones.setdefault((arm, name), []).append(t)
        print(
            f"    {arm}: first step {first[arm][-1]:.2f} s after launch"
            + "".join(f"; {name} at {t:.2f} s" for name, t in marks.items() if t is not None),
            flush=True,
        )
    ratio = h.ratio_line(
        "P2 submit -> first step, own local cluster",
        "raytrain",
        first["raytrain-cold"],
        "torchrun",
        first["torchrun"],
        fmt=".2f",
    )
    trl = h.ratio_line(
        "P0b submit -> first step, own local cluster",
        "raytrain",
        first["raytrain-cold"],
        "TRL SFTTrainer",
        first["trl"],
        fmt=".2f",
        goal="<= 2.0",
    )
    warm = h.ratio_line(
        "P2 submit -> first step, running cluster",
        "raytrain",
        first["raytrain-warm"],
        "torchrun",
        first["torchrun"],
        fmt=".2f",
    )
    exit_ratio = h.ratio_line(
        "P2 last step -> exit, own local cluster",
        "raytrain",
        exits["raytrain-cold"],
        "torchrun",
        exits["torchrun"],
        fmt=".2f",
        goal="<= 1.5",
    )
    over_ray = h.ratio_line(
        "P2 submit -> first step, both on their own local cluster",
        "raytrain",
        first["raytrain-cold"],
        "plain TorchTrainer",
        first["ray-train"],
        fmt=".2f",
    )
    h.ratio_line(
        "P2 last step -> exit, both on their own local cluster",
        "raytrain",
        exits["raytrain-cold"],
        "plain TorchTrainer",
        exits["ray-train"],
        fmt=".2f",
    )
    for arm in ("raytrain-cold", "raytrain-warm"):
        print(
            f"P2 {arm} milestones (median s after launch): "
            + ", ".join(f"{name} {h.median(v):.2f}" for (a, name), v in milestones.items() if a == arm)
            + f", first step {h.median(first[arm]):.2f}",
            flush=True,
        )
    return {
        "ratio": ratio,
        "ratio_warm": warm,
        "ratio_trl": trl,
        "ratio_exit": exit_ratio,
        "ratio_over_ray_train": over_ray,
        "first": first,
        "exit": exits,
    }


def trl_arm(s: h.Setting, model: Path, data: Path) -> dict:
    """TRL's SFTTrainer on the same model, rows and batch, one process as a TRL user starts it (trl_start.py)."""
    folder = h.scratch("p2-trl")
    try:
        command = [
            h.sys.executable,
            str(h.REPO / "benchmarks" / "trl_start.py"),
            "--model",
            str(model),
            "--data",
            str(data),
            *h.batch_args(s),
            "--out",
            str(folder / "out"),
        ]
        return {"run": h.run_arm("p2-trl", command, folder / "steps", env=h.bare_env(s), timeout_s=s.timeout_s)}
    finally:
        h.cleanup(folder)


# Lines of `raytrain run`'s own output (the driver's, not forwarded from workers) that mark its start-up.
MILESTONES = {
    "pre-flight done": ": valid (",
    "MLflow run + control actor ready": "[raytrain] job ",
}


class warm_cluster:
    """A local Ray cluster started by the bench process, sized as `raytrain run` sizes its own;
    up only while the warm arm runs (an idle cluster still costs the other arms CPU)."""

    def __init__(self, s: h.Setting):
        self.cpus = max(os.cpu_count() or 1, s.workers) + 2

    def __enter__(self) -> str:
        import ray

        ray.init(address="local", num_cpus=self.cpus, include_dashboard=False, log_to_driver=False)
        time.sleep(3)  # let the head's own start-up work finish: the job is submitted to a settled cluster
        return ray.get_runtime_context().gcs_address

    def __exit__(self, *exc) -> None:
        import ray

        ray.shutdown()


# ---------------------------------------------------------------- P7
def p7(s: h.Setting) -> dict:
    h.header("P7 FSDP2 / FSDP1 (both bare torchrun): tokens/s and peak memory", s)
    model, data = h.assets(s)
    tps, mem = {"fsdp2": [], "fsdp1": []}, {"fsdp2": [], "fsdp1": []}
    for arm in h.alternate(s.reps, ["fsdp2", "fsdp1"]):
        r = bare_arm(s, f"p7-{arm}", model, data, *(["--fsdp1"] if arm == "fsdp1" else []))
        tps[arm].append(r["tokens_per_step"] / r["run"].period_s(s.warmup))
        peaks = [m["peak_gb"] - (0 if s.gpu else m["start_rss_gb"]) for m in r["memory"]]
        mem[arm].append(max(peaks))
        print(
            f"    {arm}: {tps[arm][-1]:,.0f} tokens/s, peak memory added {mem[arm][-1]:.3f} GiB "
            f"(ranks: {', '.join(f'{p:.3f}' for p in peaks)})",
            flush=True,
        )
    ratio = h.ratio_line("P7 tokens/s", "fsdp2", tps["fsdp2"], "fsdp1", tps["fsdp1"], unit="tok/s", fmt=",.0f")
    mem_ratio = h.ratio_line(
        "P7 peak memory (" + ("max allocated" if s.gpu else "peak RSS - RSS at start") + ")",
        "fsdp2",
        mem["fsdp2"],
        "fsdp1",
        mem["fsdp1"],
        unit="GiB",
    )
    return {"ratio": ratio, "memory_ratio": mem_ratio, "tokens_per_s": tps, "memory": mem}


# ---------------------------------------------------------------- P8
def p8(s: h.Setting) -> dict:
    h.header("P8 ZeRO-3 / FSDP2, both through raytrain", s)
    model, data = h.assets(s)
    period, in_loop, mem = ({"zero3": [], "fsdp2": []} for _ in range(3))
    # A persistent op cache: DeepSpeed compiles its CPU comm op once, not in every timed run.
    env = {"TORCH_EXTENSIONS_DIR": str(h.CACHE / "torch_extensions")}
    for arm in h.alternate(s.reps, ["zero3", "fsdp2"]):
        try:
            r = raytrain_arm(
                s, f"p8-{arm}", model, data, env=env, probe=True, training={"strategy": arm, "gradient_sync": "auto"}
            )  # both reduce each micro-batch
        except RuntimeError as exc:
            if arm != "zero3":
                raise
            why = str(exc).strip().splitlines()[-1][:300]
            print(f"P8: not measured: the zero3 arm failed ({why})", flush=True)
            return {"ratio": None, "not_measured": why}
        period[arm].append(r["run"].period_s(s.warmup))
        in_loop[arm].append(steady(r["step_time_s"], s.warmup))
        key = "peak_allocated_gb" if s.gpu else "peak_rss_gb"
        mem[arm].append(max(p[key] for p in r["probe"].values()))  # the largest rank's peak (probe.py)
        print(
            f"    {arm}: period {period[arm][-1]:.4f} s, in-loop {in_loop[arm][-1]:.4f} s, largest rank's peak "
            f"{'allocated' if s.gpu else 'RSS'} {mem[arm][-1]:.3f} GiB",
            flush=True,
        )
    ratio = h.ratio_line("P8 step period", "zero3", period["zero3"], "fsdp2", period["fsdp2"])
    h.ratio_line("P8 in-loop step time", "zero3", in_loop["zero3"], "fsdp2", in_loop["fsdp2"])
    mem_ratio = h.ratio_line("P8 peak memory, largest rank", "zero3", mem["zero3"], "fsdp2", mem["fsdp2"], unit="GiB")
    return {"ratio": ratio, "memory_ratio": mem_ratio, "period": period, "memory": mem}


# ---------------------------------------------------------------- P9
def p9(s: h.Setting, objectives: tuple[str, ...] = ("sft", "dpo", "reward", "kto")) -> dict:
    h.header("P9 DPO, reward-model and KTO / SFT in-loop step time per row, same rows, all through raytrain", s)
    model, _ = h.assets(s)
    pairs = h.CACHE / f"base-{s.data_rows}" / "pairs.jsonl"
    sft_rows = h.CACHE / f"base-{s.data_rows}" / "pairs-as-sft.jsonl"  # each pair's prompt + chosen, one sequence
    if not sft_rows.exists():
        rows = [json.loads(line) for line in pairs.read_text().splitlines()]
        sft_rows.write_text("".join(json.dumps({"text": r["prompt"] + r["chosen"]}) + "\n" for r in rows))
    times: dict[str, list[float]] = {}
    arms = [f"{objective}-{finetune}" for finetune in ("lora", "full") for objective in objectives]
    for arm in h.alternate(s.reps, arms):
        objective, finetune = arm.split("-")
        rows = {"sft": sft_rows, "kto": pairs.with_name("kto.jsonl")}.get(objective, pairs)  # KTO: one completion a row
        r = raytrain_arm(
            s, f"p9-{arm}", model, rows, data={"pack": False}, training={"objective": objective, "finetune": finetune}
        )
        times.setdefault(arm, []).append(steady(r["step_time_s"], s.warmup))
        print(f"    {arm}: in-loop step {times[arm][-1]:.4f} s", flush=True)
    out = {}
    for finetune in ("lora", "full"):
        for objective in objectives[1:]:  # each against SFT on the same rows
            unit = "a completion" if objective == "kto" else "a pair"
            out[objective, finetune] = h.ratio_line(
                f"P9 step time per row, {finetune}",
                f"{objective} ({unit})",
                times[f"{objective}-{finetune}"],
                "sft (one sequence)",
                times[f"sft-{finetune}"],
            )
    first = objectives[1]
    return {
        "ratio": out[first, "lora"],
        "ratio_full": out[first, "full"],
        "times": times,
        **{f"ratio_{o}_{f}": r for (o, f), r in out.items()},
    }


# ---------------------------------------------------------------- P10
def p10(s: h.Setting) -> dict:
    h.header("P10 training.compile on / off: in-loop step time, fsdp2 full, both through raytrain", s)
    model, data = h.assets(s)
    times, first = {"compiled": [], "eager": []}, {"compiled": [], "eager": []}
    for arm in h.alternate(s.reps, ["compiled", "eager"]):
        r = raytrain_arm(s, f"p10-{arm}", model, data, training={"finetune": "full", "compile": arm == "compiled"})
        times[arm].append(steady(r["step_time_s"], s.warmup))
        first[arm].append(ordered(r["step_time_s"])[0])  # step 1 pays the compilation (inductor caches it on disk)
        print(f"    {arm}: in-loop step {times[arm][-1]:.4f} s, step 1 {first[arm][-1]:.2f} s", flush=True)
    ratio = h.ratio_line("P10 in-loop step time", "compiled", times["compiled"], "eager", times["eager"])
    h.ratio_line("P10 step 1 (compilation)", "compiled", first["compiled"], "eager", first["eager"])
    return {"ratio": ratio, "times": times, "first_step": first}


# ---------------------------------------------------------------- P11
def p11(s: h.Setting) -> dict:
    """QLoRA's step against LoRA's on the same rows (#34's measure): the NF4 base is
    dequantized for every forward and backward of the adapted layers, which costs compute here."""
    h.header("P11 QLoRA / LoRA in-loop step time, fsdp2, same rows, both through raytrain", s)
    model, data = h.assets(s)
    times: dict[str, list[float]] = {"qlora": [], "lora": []}
    for arm in h.alternate(s.reps, ["qlora", "lora"]):
        r = raytrain_arm(s, f"p11-{arm}", model, data, training={"finetune": arm})
        times[arm].append(steady(r["step_time_s"], s.warmup))
        print(f"    {arm}: in-loop step {times[arm][-1]:.4f} s", flush=True)
    return {
        "ratio": h.ratio_line("P11 in-loop step time", "qlora", times["qlora"], "lora", times["lora"]),
        "times": times,
    }
