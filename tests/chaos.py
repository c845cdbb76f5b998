"""Chaos for raytrain: break a running job for real and check what a user relies on.

    python tests/chaos.py kill   [--kills 3] [--steps 32] [--seed 0]
    python tests/chaos.py spot   [--steps 40] [--nodes 2 --per-node 1] [--sp 1]   (16-rank rehearsal: --nodes 4
    --per-node 4)
    python tests/chaos.py soak   [--minutes 10] [--seed 0]

`kill` SIGKILLs a random training worker every few seconds during a run on a local Ray cluster. `spot` runs an elastic
job (1..2 workers) on a two-node local cluster and puts one node through a spot node's life: Ray's preemption notice
(what `ray drain-node --reason PREEMPTION`, KubeRay's preStop hook, sends; a checkpoint must commit within a few steps),
the reclaim (the job resumes from that checkpoint on 1 worker), then a replacement node (it grows back to 2). `soak`
runs an elastic job (1..2 workers) on a four-node local cluster for `--minutes` and breaks it at random every 15-35 s (a
SIGKILLed worker, a SIGTERMed worker, a drained-then-reclaimed node, a node lost without notice; each lost node is
replaced), then stops it as `ray job stop` does; it reports the faults, restarts, steps redone and recovery time per
fault.

Both compare with an uninterrupted run of the same job: the samples trained on at each step of the final lineage (steps
rolled back by a restart are replaced by their re-run) must be the same, none twice, the global batch constant, and the
per-step losses equal (bit for bit at a fixed world size; to fp32 rounding across world sizes, where the reduction order
changes). Prints a JSON summary; exit 0 when every check holds."""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


_CLUSTER = None  # the spot and soak modes' multi-node local cluster, shut down on exit


def final_lineage(log_dir: Path) -> dict[int, dict]:
    """step -> {"world", "samples"} of the last attempt that ran that step."""
    by_step: dict[int, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for file in log_dir.glob("rank*.jsonl"):
        for line in file.read_text().splitlines():
            rec = json.loads(line)
            by_step[rec["step"]][rec["attempt"]].append(rec)
    lineage = {}
    for step, attempts in by_step.items():
        latest = max(attempts, key=lambda a: float(a.split("-")[0]))
        records = attempts[latest]
        world = records[0]["world"]
        assert sorted(r["rank"] for r in records) == list(range(world)), f"step {step}: ranks missing {records}"
        lineage[step] = {
            "world": world,
            "samples": [tuple(s) for r in sorted(records, key=lambda r: r["rank"]) for s in r["samples"]],
        }
    return lineage


def compare(reference: dict, lineage: dict, global_batch: int) -> list[str]:
    """Problems with the sample accounting of `lineage` against `reference` (empty: all good)."""
    problems = []
    if sorted(lineage) != sorted(reference):
        problems.append(f"steps differ: {sorted(set(reference) ^ set(lineage))}")
    seen = [s for step in sorted(lineage) for s in lineage[step]["samples"]]
    if len(seen) != len(set(seen)):
        problems.append(f"{len(seen) - len(set(seen))} samples trained on twice")
    for step in sorted(set(reference) & set(lineage)):
        if len(lineage[step]["samples"]) != global_batch:
            problems.append(f"step {step}: {len(lineage[step]['samples'])} samples, not {global_batch}")
        if sorted(lineage[step]["samples"]) != sorted(reference[step]["samples"]):
            problems.append(f"step {step}: different samples than the uninterrupted run")
    return problems


def _job(assets: Path, storage: Path, name: str, steps: int, **over):
    from conftest import make_job

    checkpoint = {"every_n_steps": 4, "keep_last": 2, **over.pop("checkpoint", {})}
    training = {"max_steps": steps, "finetune": "full", **over.pop("training", {})}
    return make_job(assets, storage, name=name, training=training, checkpoint=checkpoint, **over)


def _throttle(seconds: float) -> None:
    """Slow every step (rank 0 pauses; the others wait at the next collective) so that a
    tiny model's run lasts long enough to be broken and to recover on any machine. Through
    the test fault injector (inject/sitecustomize.py), which main() puts on the cluster's path."""
    from conftest import write_plan

    write_plan(
        Path(os.environ["RAYTRAIN_TEST_FAULTS"]),
        [{"at": "step", "step": "*", "rank": 0, "action": "pause", "seconds": seconds}],
        Path(tempfile.mkdtemp()),
    )


def _run_logged(spec, log_dir: Path):
    from conftest import metric_history

    from raytrain.driver import launcher

    spec = spec.model_copy(update={"data": spec.data.model_copy(update={"sample_log": str(log_dir)})})
    result = launcher.run(spec)
    return result, metric_history(spec, result.run_id), final_lineage(log_dir)


def _steps_done(log_dir: Path, world: int | None = None) -> int:
    steps = [json.loads(line) for f in log_dir.glob("rank*.jsonl") for line in f.read_text().splitlines()]
    return max((r["step"] for r in steps if world is None or r["world"] == world), default=0)


def _records(log_dir: Path) -> int:
    return sum(len(f.read_text().splitlines()) for f in log_dir.glob("rank*.jsonl"))


def _in_thread(fn):
    box = {}
    thread = threading.Thread(target=lambda: box.update(value=fn()), daemon=True)
    thread.start()
    return thread, box


def chaos_kill(args, root: Path, assets: Path) -> dict:
    import psutil
    import ray

    ray.init(address="local", num_cpus=6, include_dashboard=False, log_to_driver=False)
    ref_spec = _job(assets, root / "ref", "ref", args.steps)
    _, ref_losses, ref_lineage = _run_logged(ref_spec, root / "ref-log")
    _throttle(0.4)
    spec = _job(assets, root / "chaos", "chaos", args.steps, failure={"max_failures": args.kills + 2})
    thread, box = _in_thread(lambda: _run_logged(spec, root / "chaos-log"))
    rng, kills, records_at_kill = random.Random(args.seed), [], 0
    while len(kills) < args.kills and thread.is_alive():
        time.sleep(rng.uniform(2, 5))
        records = _records(root / "chaos-log")
        if records < records_at_kill + 4:
            continue  # let the restarted group train at least two steps before the next kill
        alive = [p for p in psutil.process_iter(["cmdline"]) if "RayTrainWorker" in " ".join(p.info["cmdline"] or [])]
        if len(alive) == 2 and _steps_done(root / "chaos-log") < args.steps - 2:
            records_at_kill = records
            victim = rng.choice(alive)
            os.kill(victim.pid, signal.SIGKILL)  # a real, unannounced process death
            kills.append({"pid": victim.pid, "after_step": _steps_done(root / "chaos-log")})
    thread.join()
    result, losses, lineage = box["value"]
    problems = compare(ref_lineage, lineage, spec.training.global_batch_size)
    if losses != ref_losses:
        problems.append("per-step losses differ from the uninterrupted run")
    return {"mode": "kill", "kills": kills, "failures": result.goodput["failures"], "problems": problems}


def _drain(cluster_address: str, node_id: str, deadline_s: int) -> None:
    """What `ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION` does, in process."""
    import ray
    from ray.core.generated import autoscaler_pb2

    accepted, why = ray._raylet.GcsClient(address=cluster_address).drain_node(
        node_id,
        autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
        "chaos: spot reclaim",
        time.time_ns() // 1_000_000 + deadline_s * 1000,
    )
    assert accepted, why


def _latest_commit(spec) -> int | None:
    """The step of the latest committed checkpoint (raytrain's own definition), None before the first."""
    from raytrain.train.export import latest_checkpoint

    try:
        return int(Path(latest_checkpoint(spec.run_dir)).name.split("_")[-1])
    except FileNotFoundError:
        return None


def _max_rel_diff(losses: dict, ref_losses: dict) -> float:
    common = set(losses) & set(ref_losses)
    return max((abs(losses[s] - ref_losses[s]) / abs(ref_losses[s]) for s in common), default=float("inf"))


def chaos_spot(args, root: Path, assets: Path) -> dict:
    """One spot node's life, on an elastic job over `--nodes` nodes of `--per-node` workers (HSDP:
    sharded within a node, replicated across): its preemption notice, its reclaim (the job goes on
    with one node fewer) and its replacement (it grows back). At 1 x 2 it is the CI's 1..2-worker
    case; at 4 x 4 the 16-rank rehearsal (8..16 ranks, a 4 x 4 mesh, 3 x 4 after the reclaim)."""
    import ray
    from ray.cluster_utils import Cluster

    nodes, per_node = args.nodes, args.per_node
    full, fewer = nodes * per_node, (nodes - 1) * per_node
    # Ray Train polls for drains every 5 s; every 0.5 s here, so that the notice lands within a
    # step or two of 0.5 s. Set before the nodes start: their processes inherit it.
    os.environ["RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S"] = "0.5"
    global _CLUSTER
    # `nodes` nodes with `per_node` training slots each; the head keeps spare CPUs for Ray Data. The
    # GCS notices a lost node within a few seconds (Ray's default health checks take 15 s or more, a
    # wait that is Ray's, not the job's: RESULTS.md's 51-s spot recovery had two of them). Five
    # missed checks of 1 s each, so a busy 2-core machine's slow answer is not a lost node.
    cluster = _CLUSTER = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": per_node + 3,
            "resources": {"slot": per_node},
            "_system_config": {
                "health_check_period_ms": 500,
                "health_check_timeout_ms": 1000,
                "health_check_failure_threshold": 5,
            },
        },
    )
    added = [cluster.add_node(num_cpus=per_node, resources={"slot": per_node}) for _ in range(nodes - 1)]
    node_b = added[-1]
    ray.init(address=cluster.address, log_to_driver=False)
    every = 10  # the notice's checkpoint is the only one that can fall between multiples of 10
    over = {
        "checkpoint": {"every_n_steps": every, "keep_last": 3},
        "training": {"global_batch_size": max(8, 2 * full), "micro_batch_size": 2},
    }
    mesh = {
        "resources_per_worker": {"slot": 1},
        "workers_per_node": per_node,
        "hsdp": per_node > 1,
        "sequence_parallel": args.sp,
    }
    ref_spec = _job(assets, root / "ref", "ref", args.steps, scaling={"num_workers": full, **mesh}, **over)
    _, ref_losses, ref_lineage = _run_logged(ref_spec, root / "ref-log")

    _throttle(0.5)
    spec = _job(
        assets,
        root / "spot",
        "spot",
        args.steps,
        failure={"max_failures": 1},
        **over,
        scaling={"num_workers": None, "min_workers": fewer, "max_workers": full, "resize_check_interval_s": 5, **mesh},
    )
    log = root / "spot-log"
    thread, box = _in_thread(lambda: _run_logged(spec, log))
    started, at = time.monotonic(), {}
    while thread.is_alive() and _steps_done(log) < 3:
        time.sleep(0.2)
    at["step_3_s"] = round(time.monotonic() - started, 1)
    noticed_after = _steps_done(log)
    _drain(cluster.address, node_b.node_id, deadline_s=60)  # the notice: a checkpoint within a few steps
    while thread.is_alive() and _latest_commit(spec) is None:
        time.sleep(0.2)
    checkpoint_step = _latest_commit(spec)
    at["notice_checkpoint_s"] = round(time.monotonic() - started, 1)
    cluster.remove_node(node_b, allow_graceful=False)  # the reclaim: the job goes on with a node fewer
    at["reclaimed_s"] = round(time.monotonic() - started, 1)
    # The replacement once the smaller group has committed a checkpoint of its own (a resize
    # restarts from the latest one: its smaller-world steps stay in the final lineage).
    while thread.is_alive() and (_latest_commit(spec) or 0) < every:
        time.sleep(0.2)
    at["fewer_checkpoint_s"] = round(time.monotonic() - started, 1)
    cluster.add_node(num_cpus=per_node, resources={"slot": per_node})
    at["replaced_s"] = round(time.monotonic() - started, 1)
    events = {
        "noticed_after_step": noticed_after,
        "checkpoint_step": checkpoint_step,
        "added_node_after_step": _steps_done(log),
    }
    # The smaller group must still be training when the resize lands (Ray Train checks every
    # 5 s, then starts a full group): slow it down until the full group trains, then let the rest
    # run unthrottled. On a fast machine a fixed pace finished the job at the smaller size first.
    _throttle(2.0)
    while thread.is_alive() and _steps_done(log, world=full) <= events["added_node_after_step"]:
        time.sleep(0.2)
    _throttle(0.0)
    thread.join()
    at["end_s"] = round(time.monotonic() - started, 1)
    result, losses, lineage = box["value"]
    failures = result.goodput["failures"]
    problems = compare(ref_lineage, lineage, spec.training.global_batch_size)
    if (
        checkpoint_step is None
        or not noticed_after < checkpoint_step <= noticed_after + 4
        or checkpoint_step % every == 0
    ):
        problems.append(f"notice after step {noticed_after}: first checkpoint at {checkpoint_step}, not the notice's")
    if not failures or (failures[0]["kind"], failures[0]["resumed_from"]) != ("preemption", checkpoint_step):
        problems.append(f"the reclaim was not a preemption resumed from the notice's checkpoint: {failures}")
    if not any(f["kind"] == "resize" for f in failures):
        problems.append(f"no grow-back resize among the restarts: {failures}")
    worlds = [lineage[s]["world"] for s in sorted(lineage)]
    if worlds[0] != full or fewer not in worlds or worlds[-1] != full:
        problems.append(f"expected {full} workers, then {fewer}, then {full} again; saw {worlds}")
    if sorted(losses) != sorted(ref_losses):
        problems.append(f"MLflow steps differ from the uninterrupted run: {sorted(set(losses) ^ set(ref_losses))}")
    worst = _max_rel_diff(losses, ref_losses)
    if worst > 1e-5:  # across world sizes the reduction order changes: fp32 rounding, not bits
        problems.append(f"losses differ from the uninterrupted run (max relative {worst:.2e})")
    recovery = _recovery_s(log, at, started, fewer, full)
    return {
        "mode": "spot",
        "nodes": nodes,
        "per_node": per_node,
        **events,
        "at": at,
        "recovery_s": recovery,
        "worlds_per_step": worlds,
        "per_rank": _per_rank_costs(log),
        "max_rel_loss_diff": worst,
        "failures": failures,
        "problems": problems,
    }


def _recovery_s(log_dir: Path, at: dict, started: float, fewer: int, full: int) -> dict:
    """Seconds from the reclaim to the smaller group's first step, and from the replacement node
    to the full group's first step after it (the sample log's wall-clock times)."""
    rows = [json.loads(line) for f in log_dir.glob("rank0.jsonl") for line in f.read_text().splitlines()]
    origin = time.time() - (time.monotonic() - started)  # monotonic offsets -> wall clock

    def first(world: int, after: float) -> float | None:
        times = [r["time"] for r in rows if r["world"] == world and r["time"] > origin + after]
        return round(min(times) - origin - after, 1) if times else None

    return {"reclaim_to_step": first(fewer, at["reclaimed_s"]), "replacement_to_step": first(full, at["replaced_s"])}


def _per_rank_costs(log_dir: Path) -> dict:
    """Per world size: the largest resident memory of any rank and the median bytes a rank read
    from the token store per step (the sample log records both at every step)."""
    by_world: dict[int, dict] = defaultdict(lambda: {"rss_mb": 0.0, "read": []})
    for f in log_dir.glob("rank*.jsonl"):
        previous: dict[str, int] = {}
        for r in (json.loads(line) for line in f.read_text().splitlines()):
            w = by_world[r["world"]]
            w["rss_mb"] = max(w["rss_mb"], r.get("rss_mb", 0.0))
            if r["attempt"] in previous:
                w["read"].append(r.get("read_bytes", 0) - previous[r["attempt"]])
            previous[r["attempt"]] = r.get("read_bytes", 0)
    return {
        world: {
            "max_rss_mb": round(v["rss_mb"], 1),
            "read_bytes_per_step": sorted(v["read"])[len(v["read"]) // 2] if v["read"] else None,
        }
        for world, v in sorted(by_world.items())
    }


def _workers() -> list[dict]:
    """The live training workers: pid and node."""
    from ray.util.state import list_actors

    return [
        {"pid": a.pid, "node_id": a.node_id}
        for a in list_actors(filters=[("class_name", "=", "RayTrainWorker"), ("state", "=", "ALIVE")], detail=True)
    ]


def chaos_soak(args, root: Path, assets: Path) -> dict:
    import ray
    from mlflow.tracking import MlflowClient
    from ray.cluster_utils import Cluster

    from raytrain.driver.control import actor_name
    from raytrain.tracking.mlflow_run import tracking_uri

    os.environ["RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S"] = "0.5"  # see chaos_spot
    global _CLUSTER
    cluster = _CLUSTER = Cluster(initialize_head=True, head_node_args={"num_cpus": 4})  # driver, Ray Data, controller
    nodes = {n.node_id: n for n in (cluster.add_node(num_cpus=1, resources={"slot": 1}) for _ in range(3))}
    ray.init(address=cluster.address, log_to_driver=False)
    period, steps = 0.4, int(args.minutes * 60 / 0.4) + 200  # more steps than the soak lasts: it ends with a stop
    elastic = {
        "scaling": {
            "num_workers": None,
            "min_workers": 1,
            "max_workers": 2,
            "resize_check_interval_s": 5,
            "resources_per_worker": {"slot": 1},
        },
        "failure": {"max_failures": 1000},
    }
    ref_spec = _job(assets, root / "ref", "ref", steps, scaling={"num_workers": 2, "resources_per_worker": {"slot": 1}})
    _, ref_losses, ref_lineage = _run_logged(ref_spec, root / "ref-log")

    _throttle(period)
    spec = _job(assets, root / "soak", "soak", steps, **elastic)
    log = root / "soak-log"
    thread, box = _in_thread(lambda: _run_logged(spec, log))
    rng, faults, started = random.Random(args.seed), [], time.monotonic()
    while thread.is_alive() and time.monotonic() - started < args.minutes * 60:
        time.sleep(rng.uniform(15, 35))
        workers = _workers()
        if len(workers) < 2 or not thread.is_alive():
            continue  # wait for the group to be whole again before the next fault
        kind, victim = rng.choice(["sigkill", "sigterm", "drain", "node_loss"]), rng.choice(workers)
        fault = {"kind": kind, "after_step": _steps_done(log), "at_s": round(time.monotonic() - started, 1)}
        if kind in ("sigkill", "sigterm"):
            os.kill(victim["pid"], signal.SIGKILL if kind == "sigkill" else signal.SIGTERM)
        else:
            if kind == "drain":  # the spot notice, then the reclaim once its checkpoint committed
                before = _latest_commit(spec)
                _drain(cluster.address, victim["node_id"], deadline_s=60)
                deadline = time.monotonic() + 60
                while thread.is_alive() and _latest_commit(spec) == before and time.monotonic() < deadline:
                    time.sleep(0.2)
                fault["checkpoint_step"] = _latest_commit(spec)
            cluster.remove_node(nodes.pop(victim["node_id"]), allow_graceful=False)
            fresh = cluster.add_node(num_cpus=1, resources={"slot": 1})  # the spot pool's replacement
            nodes[fresh.node_id] = fresh
        faults.append(fault)
    ray.get(ray.get_actor(actor_name(spec.run_dir)).request_stop.remote("SIGTERM"))  # what `ray job stop` does
    thread.join()
    result, losses, lineage = box["value"]
    problems = compare({s: ref_lineage[s] for s in lineage}, lineage, spec.training.global_batch_size)
    if sorted(lineage) != list(range(1, max(lineage) + 1)):
        problems.append("the trained steps are not 1..last")
    client = MlflowClient(tracking_uri(spec))
    runs = client.search_runs(
        [client.get_experiment_by_name("tests").experiment_id], f"tags.`raytrain.run_dir` = '{spec.run_dir}'"
    )
    if [r.info.status for r in runs] != ["KILLED"]:
        problems.append(f"expected one MLflow run, KILLED: {[r.info.status for r in runs]}")
    history = client.get_metric_history(runs[0].info.run_id, "loss") if runs else []
    if sorted(m.step for m in history) != sorted(lineage):
        problems.append("MLflow's loss history is not each trained step once")
    if runs and "goodput_wall_s" not in runs[0].data.metrics:
        problems.append("no goodput figures in MLflow")
    worst = _max_rel_diff(losses, ref_losses)
    failures = result.goodput["failures"]
    recovery = sorted(f["recovery_s"] for f in failures)
    return {
        "mode": "soak",
        "minutes": round((time.monotonic() - started) / 60, 1),
        "steps": max(lineage),
        "faults": faults,
        "faults_by_kind": {
            k: sum(f["kind"] == k for f in faults) for k in ("sigkill", "sigterm", "drain", "node_loss")
        },
        "restarts": len(failures),
        "restarts_by_kind": {k: sum(f["kind"] == k for f in failures) for k in ("failure", "preemption", "resize")},
        "steps_redone": sum(f["steps_lost"] for f in failures),
        "recovery_s_median": recovery[len(recovery) // 2] if recovery else None,
        "recovery_s_max": recovery[-1] if recovery else None,
        "goodput": {k: v for k, v in result.goodput.items() if k != "failures"},
        "max_rel_loss_diff": worst,
        "problems": problems,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["kill", "spot", "soak"])
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--nodes", type=int, default=2, help="spot: nodes of the local cluster")
    parser.add_argument("--per-node", type=int, default=1, help="spot: training workers a node (HSDP when > 1)")
    parser.add_argument("--sp", type=int, default=1, help="spot: scaling.sequence_parallel (dividing --per-node)")
    parser.add_argument("--out", help="folder for runs and logs (default: a temp dir)")
    args = parser.parse_args(argv)
    from raytrain.demo_assets import make_all

    root = Path(args.out or tempfile.mkdtemp(prefix="raytrain-chaos-"))
    assets = make_all(root / "assets")
    from conftest import with_fault_injection

    with_fault_injection(root / "faults.json")  # before any cluster starts: its processes inherit it
    import ray

    try:
        modes = {"kill": chaos_kill, "spot": chaos_spot, "soak": chaos_soak}
        summary = modes[args.mode](args, root, assets)
    finally:
        ray.shutdown()
        if _CLUSTER:
            _CLUSTER.shutdown()
    print("CHAOS-SUMMARY " + json.dumps(summary), flush=True)
    return 1 if summary["problems"] else 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # not sys.exit: Ray's atexit hooks on an already shut-down cluster can turn 0 into 1
