"""`raytrain validate | run | prepare | quickstart | export | sync-metrics | key | k8s`. Never imports torch at module
level: `validate` answers in about a second, before any cluster or GPU is involved.

Exit codes: 0 success/valid, 2 invalid job (nothing was started), 1 the run failed."""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

from raytrain.errors import JobError, user_message
from raytrain.job.plan import RunPlan
from raytrain.validate import preflight

EXIT_OK, EXIT_FAILED, EXIT_INVALID = 0, 1, 2
# The checkout's jobs/ folder (setup-local.sh installs raytrain editable from it), found from the
# package rather than the working directory, so `raytrain quickstart` runs from any folder.
QUICKSTART_JOB = Path(__file__).resolve().parents[1] / "jobs" / "quickstart.yaml"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="raytrain", description="Elastic fine-tuning of Hugging Face causal LMs on Ray.")
    sub = p.add_subparsers(dest="command", required=True)
    for name, text in (
        ("validate", "check a job without starting anything"),
        ("run", "validate, then run a job"),
        ("prepare", "validate, then tokenize and pack the job's data into its token store (reused by run)"),
    ):
        c = sub.add_parser(name, help=text)
        c.add_argument("job", help="job YAML file")
        c.add_argument(
            "--set",
            dest="overrides",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="override a field, e.g. --set training.max_steps=20 (repeatable)",
        )
        c.add_argument("--json", action="store_true", help="machine-readable problems on stdout")
        c.add_argument(
            "--skip-probes", action="store_true", help="schema and arithmetic only: no file, model or storage probes"
        )
    for name in ("run", "prepare"):
        sub.choices[name].add_argument(
            "--address", help="Ray cluster address (default: RAY_ADDRESS, else a local cluster)"
        )
    sub.choices["run"].add_argument(
        "--takeover",
        action="store_true",
        help=(
            "if another driver runs this job: on this Ray cluster, have it checkpoint and stop; on another,"
            " fence it (its workers stop and commit nothing more); then continue here from the last checkpoint"
        ),
    )
    q = sub.add_parser("quickstart", help="make the offline demo model and data, then run jobs/quickstart.yaml")
    q.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    e = sub.add_parser("export", help="write a plain HF model/adapter from a run's latest (or given) checkpoint")
    e.add_argument("run_dir", help="the run directory, <storage_path>/<name>")
    e.add_argument("--out", required=True, help="output folder or URI")
    e.add_argument("--checkpoint", help="a step_* folder (default: the latest committed one)")
    m = sub.add_parser(
        "sync-metrics", help="write what MLflow missed while it was unreachable (kept in the run directory)"
    )
    m.add_argument("run_dir", help="the run directory, <storage_path>/<name>")
    sub.add_parser("key", help="make this machine's checkpoint-signing key if it has none; print where it is")
    k = sub.add_parser("k8s", help="render the KubeRay RayJob (+ ConfigMap) that runs a job on Kubernetes")
    k.add_argument("job", help="job YAML file")
    k.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    k.add_argument("--image", default="raytrain:latest", help="container image with raytrain installed")
    k.add_argument("--namespace", default="raytrain")
    return p


def _report(report, as_json: bool) -> None:
    """Errors refuse the job; notes (what only the cluster can check, the memory estimate) are said either way."""
    if as_json:
        print(
            json.dumps(
                {
                    "valid": not report.errors,
                    "problems": [p.to_dict() for p in report.errors],
                    "notes": [p.to_dict() for p in report.notes],
                },
                indent=2,
            )
        )
        return
    # On a terminal a long problem (the memory estimate's note) wraps to its width; piped, one line each.
    width = max(60, shutil.get_terminal_size().columns - 1) if sys.stderr.isatty() else 0
    for lead, problems in (("  - ", report.errors), ("  note: ", report.notes)):
        for p in problems:
            text = lead + str(p)
            print(textwrap.fill(text, width, subsequent_indent=" " * 4) if width else text, file=sys.stderr)


def cmd_validate(args) -> int:
    # `run` needs what `validate` may only note: the driver itself must reach storage and MLflow.
    report = preflight.check(
        args.job, args.overrides, probes=not args.skip_probes, network_required=args.command in ("run", "prepare")
    )
    if report.errors:
        if not args.json:
            print(f"{args.job}: {len(report.errors)} problem(s); nothing was started:", file=sys.stderr)
        _report(report, args.json)
        return EXIT_INVALID
    spec = report.spec
    if not args.json:
        lo, hi = spec.scaling.worker_range
        budget = "any number of" if spec.failure.max_failures < 0 else spec.failure.max_failures
        objective = "" if spec.training.objective == "sft" else f", {spec.training.objective}"
        plan = RunPlan.of(spec)
        m, mesh = plan.mesh(lo), ""
        if m.sp * m.tp > 1:  # only dp changes with the worker count
            dp = f"{m.dp}..{plan.mesh(hi).dp}" if hi != lo else str(m.dp)
            mesh = f", mesh dp {dp}" + "".join(f" x {k} {v}" for k, v in (("sp", m.sp), ("tp", m.tp)) if v > 1)
        print(
            f"{args.job}: valid ({spec.training.strategy}, {spec.training.finetune}{objective}, workers "
            f"{lo}..{hi}{mesh}, "
            f"accumulation {plan.accumulation_steps(hi)}..{plan.accumulation_steps(lo)}; survives {budget} worker "
            "failures, preemptions not counted)"
        )
    _report(report, args.json)
    return EXIT_OK


def cmd_run(args) -> int:
    code = cmd_validate(args)
    if code != EXIT_OK:
        return code
    spec, _ = preflight.check_job(args.job, args.overrides, probes=False)
    from raytrain.driver import worker_env

    worker_env.start_fork_server(spec, getattr(args, "address", None))  # before the driver's own imports
    from raytrain.driver import launcher

    try:
        result = launcher.run(spec, address=getattr(args, "address", None), takeover=getattr(args, "takeover", False))
    except JobError as exc:
        print(f"raytrain: job {spec.name} failed: {user_message(exc)}", file=sys.stderr)
        return EXIT_FAILED
    except Exception as exc:  # a failure inside Ray: show its first meaningful line, not the nested traceback
        lines = [ln for ln in str(exc).splitlines() if ln.strip()]
        print(
            f"raytrain: job {spec.name} failed: {lines[-1] if lines else type(exc).__name__}\n"
            f"  (full worker logs: the Ray logs of this run; MLflow run marked FAILED)",
            file=sys.stderr,
        )
        return EXIT_FAILED
    m = result.metrics
    evaluated = f" eval_loss {m['eval_loss']:.4f};" if "eval_loss" in m else ""
    # Only what exists: no final model when export_final is off or the job was stopped before the end.
    exported = spec.checkpoint.export_final and m.get("step") == spec.training.max_steps
    final = f"final model {result.run_dir}/final_model; " if exported else ""
    print(
        f"[raytrain] done in {result.wall_s:.0f}s: step {m.get('step', '?')} loss "
        f"{m.get('loss', float('nan')):.4f};{evaluated} "
        f"bad rows skipped {int(m.get('bad_rows', 0))}; checkpoint {result.checkpoint}; {final}mlflow run "
        f"{result.run_id}"
    )
    return EXIT_OK


def cmd_prepare(args) -> int:
    """The first phase of `run` on its own: a later run (or another job on the same data,
    tokenizer and settings) finds the store and tokenizes nothing."""
    code = cmd_validate(args)
    if code != EXIT_OK:
        return code
    spec, _ = preflight.check_job(args.job, args.overrides, probes=False)
    from raytrain.driver import launcher

    try:
        prepared = launcher.prepare_data(spec, address=args.address)
    except JobError as exc:
        print(f"raytrain: preparing {spec.name}'s data failed: {user_message(exc)}", file=sys.stderr)
        return EXIT_FAILED
    for uri in prepared["train"] + ([prepared["eval"]] if prepared["eval"] else []):
        print(f"[raytrain] token store ready: {uri}")
    return EXIT_OK


def cmd_quickstart(args) -> int:
    if not QUICKSTART_JOB.is_file():
        print(
            f"raytrain quickstart: {QUICKSTART_JOB} is not there: the quickstart runs from a checkout of raytrain "
            "installed with cluster/setup-local.sh (pip install -e .)",
            file=sys.stderr,
        )
        return EXIT_INVALID
    root = Path(".raytrain/quickstart")
    # Built in a process of its own (torch makes the model), so that this one, the job's driver, runs
    # without torch as `raytrain run` does; kept for later quickstarts.
    subprocess.run([sys.executable, "-m", "raytrain.demo_assets", str(root)], check=True)
    print(f"[raytrain] demo model and data in {root}")
    args.job, args.json, args.skip_probes, args.address = str(QUICKSTART_JOB), False, False, None
    return cmd_run(args)


def cmd_export(args) -> int:
    from raytrain.train.export import export_checkpoint

    try:
        used = export_checkpoint(args.run_dir, args.out, args.checkpoint)
    except (FileNotFoundError, ValueError, JobError) as exc:  # a tampered checkpoint too: one message
        print(f"raytrain export: {exc}", file=sys.stderr)
        return EXIT_INVALID
    print(f"[raytrain] exported {used} to {args.out}")
    return EXIT_OK


def cmd_sync_metrics(args) -> int:
    from raytrain.driver.launcher import sync_metrics

    try:
        written, run_id = sync_metrics(args.run_dir)
    except FileNotFoundError:
        print(
            f"raytrain sync-metrics: {args.run_dir} is not a run directory (it has no job.json); give "
            "<checkpoint.storage_path>/<name> of the job",
            file=sys.stderr,
        )
        return EXIT_INVALID
    except JobError as exc:
        print(f"raytrain sync-metrics: {user_message(exc)}", file=sys.stderr)
        return EXIT_INVALID
    except Exception as exc:  # MLflow still unreachable: nothing was lost, try again later
        why = (str(exc).strip().splitlines() or [""])[0][:300]
        print(
            f"raytrain sync-metrics: MLflow did not take them ({type(exc).__name__}: {why}); nothing is lost, run it "
            "again once it is reachable",
            file=sys.stderr,
        )
        return EXIT_FAILED
    if run_id is None:
        print(f"[raytrain] nothing to write: {args.run_dir} has no checkpoint and no kept MLflow record")
    else:
        print(f"[raytrain] wrote {written} steps' metrics (and any kept run status) into MLflow run {run_id}")
    return EXIT_OK


def cmd_key(args) -> int:
    from raytrain.rundir import signing

    signing.ensure_key()
    where = f"${signing.KEY_ENV}" if os.environ.get(signing.KEY_ENV) else signing.KEY_FILE
    print(
        f"[raytrain] checkpoints are signed with the key in {where} (id {signing.key_id()}); every node of a cluster "
        "needs the same one (cluster/*.yaml mount the file; on Kubernetes it is in the Secret raytrain-secrets)"
    )
    return EXIT_OK


def cmd_k8s(args) -> int:
    from raytrain.deploy import k8s

    return k8s.cmd_render(args)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return {
        "validate": cmd_validate,
        "run": cmd_run,
        "prepare": cmd_prepare,
        "quickstart": cmd_quickstart,
        "export": cmd_export,
        "sync-metrics": cmd_sync_metrics,
        "key": cmd_key,
        "k8s": cmd_k8s,
    }[args.command](args)


def entry(argv: list[str] | None = None) -> None:
    """The `raytrain` command (and `python -m raytrain`): run it, then end the process. Once a
    command that used Ray is over and recorded, the exit handlers run as at any exit (Ray's
    shutdown stops a local cluster this process started; logging flushes; temporary folders
    go) and the process ends without the interpreter's teardown of torch, Ray and their
    threads, which took 1.9 s on 2 cores after the job had already finished (P2's exit). After a
    success Ray is shut down first, by a call: at exit its handler waits 0.5 s more for late lines
    of the workers' errors, which a failure keeps."""
    code = main(argv)
    if "ray" not in sys.modules:
        sys.exit(code)
    if code == 0:
        sys.modules["ray"].shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    entry()
