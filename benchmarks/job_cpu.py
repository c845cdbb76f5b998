"""Where a job's CPU-seconds go (#61): what the test suite, a restart and a resize pay per job on a
cluster that is already up. On 2 cores the suite is CPU-bound (both lanes busy), so its time is the
sum of its jobs' CPU-seconds over 2, and this is the figure that sets it.

One local cluster (as a test lane's), a warm-up job, then the quickstart-shaped job of tests/conftest
`make_job` at 10 and at 30 steps: each process's CPU-seconds (utime + stime from /proc, sampled every
0.1 s, so a process that lived under 0.1 s is missed), grouped by what Ray calls it (`ray::NAME`),
beside the whole machine's busy CPU-seconds over the job (`/proc/stat`).

    PYTHONPATH=.:tests .venv/bin/python -m benchmarks.job_cpu

Run it alone on the machine: the machine's total counts every process."""

from __future__ import annotations

import collections
import os
import tempfile
import threading
import time
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def busy_s() -> float:
    v = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    return (sum(v) - v[3] - v[4]) / TICK  # less idle and iowait


def processes() -> dict[int, tuple[str, float]]:
    """pid -> (its kind, CPU-seconds so far)."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        kind = argv[0].split(".")[0] if argv[0].startswith("ray::") else _program(argv)
        out[int(pid)] = (kind, (int(fields[11]) + int(fields[12])) / TICK)
    return out


def _program(argv: list[str]) -> str:
    """A process's program: a Python interpreter's script or module (Ray's setup_worker.py, its dashboard agent,
    raytrain's fork server), else the executable's name."""
    if Path(argv[0]).name.startswith("python"):
        args = [a for a in argv[1:] if a]
        if "-m" in args[:-1]:
            return "-m " + args[args.index("-m") + 1]
        script = next((a for a in args if a.endswith(".py")), None)
        if script:
            return Path(script).name
    return Path(argv[0]).name or "?"


def measured(run) -> tuple[float, float, collections.Counter, collections.Counter]:
    """(wall s, machine busy CPU-s, CPU-s by process kind, processes of each kind that used CPU) of `run()`."""
    before, last, done = processes(), {}, threading.Event()

    def sample() -> None:
        while not done.is_set():
            for pid, (kind, cpu) in processes().items():  # an exiting process has no command line left
                last[pid] = (last[pid][0] if kind == "?" and pid in last else kind, cpu)
            time.sleep(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    began, busy = time.time(), busy_s()
    sampler.start()
    run()
    time.sleep(2)  # the job's processes exit
    done.set()
    sampler.join()
    wall, busy = time.time() - began, busy_s() - busy
    kinds, count = collections.Counter(), collections.Counter()
    for pid, (kind, cpu) in last.items():
        old = before.get(pid)
        used = cpu - (old[1] if old and old[0] == kind else 0)
        if used >= 0.05:
            label = "driver (this process)" if pid == os.getpid() else kind
            kinds[label] += used
            count[label] += 1
    return wall, busy, kinds, count


def main() -> None:
    import ray
    from conftest import make_job

    from raytrain.demo_assets import make_all
    from raytrain.driver import launcher

    root = Path(tempfile.mkdtemp(prefix="raytrain-job-cpu-"))
    assets = make_all(root / "assets")
    ray.init(address="local", num_cpus=6, include_dashboard=False, log_to_driver=False)
    launcher.run(make_job(assets, root / "warm", name="warm"))
    for steps in (10, 30):
        spec = make_job(assets, root / f"s{steps}", name=f"steps-{steps}", training={"max_steps": steps})
        wall, busy, kinds, count = measured(lambda: launcher.run(spec))
        seen = sum(kinds.values())
        print(f"[job-cpu] {steps} steps: wall {wall:.1f} s, machine busy {busy:.1f} CPU-s, per process {seen:.1f}:")
        for kind, cpu in kinds.most_common():
            if cpu >= 0.1:
                print(f"[job-cpu]   {cpu:6.2f}  {kind} ({count[kind]} process(es))")
    ray.shutdown()


if __name__ == "__main__":
    main()
