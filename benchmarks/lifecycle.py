"""P3-P6: what raytrain does around the steps: data, restarts, checkpoints, memory.

P3  the data reader's wait as a share of step time (the token store itself: datastore.py, D1-D5).
P4  restart latency (kill -> first resumed step) / cold start (submit -> first step).
P5  time training is blocked by a save: async prototype / raytrain's synchronous save.  goal <= 0.1
P6  peak memory per rank / raytrain.memory's formula (the pre-flight estimate).
"""

from __future__ import annotations

import json
from pathlib import Path

from . import harness as h
from .compare import raytrain_arm, steady


# ---------------------------------------------------------------- P3
def p3(s: h.Setting) -> dict:
    h.header("P3 data: the reader's wait as a share of the step", s)
    model, data = h.assets(s)
    share, first_wait = [], []
    for _ in range(s.reps):
        r = raytrain_arm(s, "p3-train", model, data)
        wait, step = r["data_wait_s"], r["step_time_s"]
        share.append(steady({k: wait[k] / step[k] for k in step}, s.warmup))
        first_wait.append(wait[1])
        print(f"    train: data wait {share[-1]:.2%} of the steady step (step 1 waited {wait[1]:.3f} s)", flush=True)
    print(
        f"P3 data wait share of step time: median {h.median(share):.2%} (n={len(share)}, "
        f"{min(share):.2%}..{max(share):.2%}); step 1 data wait median {h.median(first_wait):.3f} s",
        flush=True,
    )
    return {"share": h.median(share)}


# ---------------------------------------------------------------- P4
def p4(s: h.Setting) -> dict:
    h.header("P4 restart: kill -> first resumed step / submit -> first step", s)
    s = h.with_overrides(s, steps=10)
    kill_at, every = 6, 5
    model, data = h.assets(s)
    recovery, watched, cold, lost, rebuilt = [], [], [], [], []
    for _ in range(s.reps):
        folder = h.scratch("p4")
        try:
            faults = h.fault_env(folder, [{"at": "step", "step": kill_at, "rank": 1, "action": "exit"}])
            job_file = h.write_job(
                h.job(
                    s,
                    "p4",
                    folder / "runs",
                    model,
                    data,
                    failure={"max_failures": 1},
                    checkpoint={"every_n_steps": every},
                ),
                folder,
            )
            run = h.run_arm("p4", h.raytrain_command(job_file), folder / "steps", env=faults, timeout_s=s.timeout_s)
            _, mlrun = h.mlflow_run(folder / "runs")
            failure = json.loads(mlrun.data.tags["raytrain.goodput"])["failures"][0]
        finally:
            h.cleanup(folder)
        attempts = [line["attempt"] for line in run.lines]
        second = attempts.index(attempts[-1])  # first line of the last attempt
        killed = run.step_times[second - 1]  # rank 1 exits right after the line of step `kill_at`
        rebuilt.append(float(attempts[-1].split("-")[0]) - killed)  # the stamp: model built and restored
        recovery.append(failure["recovery_s"])
        watched.append(run.step_times[second] - killed)
        cold.append(run.first_step_s)
        lost.append(failure["steps_lost"])
        print(
            f"    attempt 2 start-up (s after its workers came up): {run.startup(2)}; cold: {run.startup(1)}",
            flush=True,
        )
        print(
            f"    killed rank 1 after step {kill_at} (checkpoint every {every}): recovery {recovery[-1]:.2f} s "
            f"(goodput), {watched[-1]:.2f} s (step lines), of which {rebuilt[-1]:.2f} s until the new workers had "
            f"built the model and restored; steps lost {lost[-1]}; cold start -> first step {cold[-1]:.2f} s",
            flush=True,
        )
    ratio = h.ratio_line(
        "P4 restart latency / cold start",
        "kill -> first resumed step",
        recovery,
        "submit -> first step",
        cold,
        fmt=".2f",
    )
    return {"ratio": ratio, "recovery_s": recovery, "cold_s": cold}


# ---------------------------------------------------------------- P5
P5_ARMS = {  # arm -> checkpoint.async_save
    "sync": False,  # raytrain's default: write, upload and commit before the next step
    "async": True,  # checkpoint.async_save: DCP stages to CPU memory, writes and uploads in the background
}


def p5(s: h.Setting) -> dict:
    h.header("P5 checkpoint: time a save blocks training, asynchronous / raytrain's synchronous save", s)
    arms = list(P5_ARMS)
    # Saves far enough apart that an asynchronous upload is done by the next save (Ray Train's
    # controller registers reported checkpoints at its poll, every 2 s by default).
    every = max(2, s.steps // 3)
    model, data = h.assets(s)
    blocked = {a: [] for a in arms}
    parts = {a: {} for a in arms}
    after = {a: [] for a in arms}
    for arm in h.alternate(s.reps, arms):
        folder = h.scratch(f"p5-{arm}")
        try:
            checkpoint = {"every_n_steps": every, "async_save": P5_ARMS[arm]}
            r = raytrain_arm(
                s,
                f"p5-{arm}",
                model,
                data,
                "--ckpt",
                "timed",
                "--ckpt-log",
                str(folder),
                inspect=committed_folders,
                checkpoint=checkpoint,
            )
            per_step: dict[int, list[dict]] = {}
            for path in folder.glob("ckpt-rank*.jsonl"):
                for line in path.read_text().splitlines():
                    record = json.loads(line)
                    per_step.setdefault(record["step"], []).append(record)
        finally:
            h.cleanup(folder)
        saves = sorted(k for k in per_step if k < s.steps)  # the final save is synchronous in every arm
        step_times, ck = r["step_time_s"], r["checkpoint_s"]  # checkpoint_s: reported with the step after the save
        blocked[arm] += [ck[k + 1] for k in saves]  # the loop's own clock: confirm + save, rank 0
        for k in saves:
            slowest = max(per_step[k], key=lambda rec: rec["save_s"] + rec.get("confirm_s", 0.0))
            for key, value in slowest.items():
                if key.endswith("_s"):
                    parts[arm].setdefault(key, []).append(value)
        base = steady({k: v for k, v in step_times.items() if k - 1 not in saves}, s.warmup)
        after[arm] += [step_times[k + 1] - base for k in saves if k + 1 in step_times]
        print(
            f"    {arm}: saves at steps {saves} blocked {', '.join(f'{ck[k + 1]:.3f}' for k in saves)} s "
            f"(MLflow checkpoint_s); kept checkpoints {r['inspected']}",
            flush=True,
        )
    for arm in arms:
        print(
            f"P5 {arm} parts (median per save, slowest rank): "
            + ", ".join(f"{k} {h.median(v):.4f}" for k, v in sorted(parts[arm].items())),
            flush=True,
        )
        print(
            f"P5 {arm}: the step after a save took {h.median(after[arm]):+.4f} s more than a steady step "
            f"(background work competing for the CPU)",
            flush=True,
        )
    ratios = {
        f"ratio_{a.replace('-', '_')}": h.ratio_line(
            f"P5 blocked by a save, {a} / sync", a, blocked[a], "sync", blocked["sync"], goal="<= 0.1"
        )
        for a in arms
        if a != "sync"
    }
    return {**ratios, "blocked": blocked, "parts": parts}


def committed_folders(folder: Path) -> list[str]:
    """The kept step_* folders and whether each is complete: DCP's .metadata (written last),
    both ranks' shards, train_state.json, and registered in Ray Train's run snapshot."""
    import json

    from raytrain.rundir.checkpoints import RAY_SNAPSHOT

    out = []
    for step in sorted((folder / "runs").glob("*/step_*")):
        names = {p.name for p in step.iterdir()}
        snapshot = step.parent / RAY_SNAPSHOT
        known = (
            {r["checkpoint_dir_name"] for r in json.loads(snapshot.read_text())["checkpoint_results"]}
            if snapshot.exists()
            else set()
        )
        complete = (
            {".metadata", "train_state.json"} <= names
            and sum(n.endswith(".distcp") for n in names) >= 2
            and step.name in known
        )
        out.append(f"{step.name}:{'complete' if complete else 'INCOMPLETE ' + ','.join(sorted(names))}")
    return out


# ---------------------------------------------------------------- P6
def p6(s: h.Setting) -> dict:
    h.header("P6 peak memory per rank / raytrain.memory formula", s)
    from raytrain.job.spec import JobSpec
    from raytrain.model.facts import read_facts
    from raytrain.validate import memory

    s = h.with_overrides(s, steps=3, warmup=0)
    # A model 8x P1's, so that its weights show above the runtime; on CPU each mode also runs a
    # 64-hidden 2-layer model, whose peak is the floor (Python, torch, Ray, transformers, peft).
    models = {
        "": h.assets(s, hidden=s.hidden * 2, layers=s.layers * 2)[0],
        "floor-": h.assets(s, hidden=64, layers=2)[0],
    }
    data = h.assets(s)[1]
    arms = [f"{m}{mode}" for m in models if m == "" or not s.gpu for mode in ("full", "lora")]
    key = "peak_allocated_gb" if s.gpu else "peak_rss_gb"
    measured: dict[str, list[dict[int, float]]] = {a: [] for a in arms}  # per rep: rank -> peak bytes
    estimate = {}
    for arm in h.alternate(s.reps, arms):
        mode, path = arm.split("-")[-1], models["floor-" if arm.startswith("floor") else ""]
        over = {"training": {"finetune": mode, "lora": {"rank": 8, "alpha": 16}}}
        r = raytrain_arm(s, f"p6-{arm}", path, data, probe=True, **over)
        spec = JobSpec.model_validate(h.job(s, "p6", Path("/tmp"), path, data, **over))
        estimate[arm] = memory.estimate(spec, read_facts(path), s.workers)
        ranks = {rank: p[key] * 2**30 for rank, p in sorted(r["probe"].items())}
        measured[arm].append(ranks)
        print(
            f"    {arm}: peak {'allocated' if s.gpu else 'RSS'} per rank "
            + ", ".join(f"{rank}: {v / 2**30:.3f} GiB" for rank, v in ranks.items()),
            flush=True,
        )
    ratios = {}
    for mode in ("full", "lora"):
        print(f"P6 {mode} formula ({s.workers} ranks): {estimate[mode].arithmetic()}", flush=True)
        # Each rank's own floor (rank 0 also imports MLflow): the median floor run of that rank.
        floor = {
            rank: 0.0 if s.gpu else h.median([m[rank] for m in measured[f"floor-{mode}"]]) for rank in range(s.workers)
        }
        want = estimate[mode].total - (0.0 if s.gpu else estimate[f"floor-{mode}"].total)
        if s.gpu:
            want -= 2**30  # the formula's runtime term (CUDA context, NCCL) is not in max_memory_allocated
        else:
            print(
                f"P6 {mode} floor: the 64-hidden model's run peaks at "
                + ", ".join(f"rank {r} {v / 2**30:.3f} GiB" for r, v in floor.items())
                + f" RSS; its formula is "
                f"{estimate[f'floor-{mode}'].total / 2**20:.1f} MiB",
                flush=True,
            )
        got = [max(m[r] - floor[r] for r in m) / 2**30 for m in measured[mode]]  # the formula bounds every rank
        label = "largest rank, minus the floor run" if not s.gpu else "largest rank"
        ratios[f"ratio_{mode}"] = h.ratio_line(
            f"P6 {mode} fine-tune peak memory ({label}) / formula",
            "measured",
            got,
            "formula",
            [want / 2**30],
            unit="GiB",
        )
    return ratios
