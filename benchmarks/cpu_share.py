"""Who uses the CPU while a P1 arm steps: every process's user + system CPU over a window of its
steady steps, grouped by command line (a measurement beside P1, not part of it).

    python -m benchmarks.bench p1 --quick --reps 1 &
    python -m benchmarks.cpu_share 10 p1-raytrain          # then again with p1-torchrun-fused

Waits until the arm's step log (`benchmarks/.cache/runs/<arm>-<id>/.../rank0.jsonl`) has 35 lines
(past P1's 30 warm-up steps), samples every process's CPU time, sleeps SECONDS, samples again and
prints the busiest command lines in cores (CPU-s / wall-s). On 2 cores that is what the arm's
training processes got, and what everything else took beside them."""

from __future__ import annotations

import collections
import glob
import sys
import time

import psutil


def snapshot() -> dict[int, tuple[str, float]]:
    out = {}
    for p in psutil.process_iter(["pid", "name", "cmdline"]):
        try:
            t = p.cpu_times()
            out[p.pid] = (" ".join(p.info["cmdline"] or [p.info["name"]])[:60], t.user + t.system)
        except psutil.Error:
            pass
    return out


def steps(arm: str) -> int:
    files = glob.glob(f"benchmarks/.cache/runs/{arm}-[0-9]*/**/rank0.jsonl", recursive=True)
    return max((sum(1 for _ in open(f)) for f in files), default=0)


def main() -> None:
    seconds, arm = float(sys.argv[1]), sys.argv[2]
    while steps(arm) < 35:
        time.sleep(0.5)
    a, t0 = snapshot(), time.time()
    time.sleep(seconds)
    b, t1 = snapshot(), time.time()
    wall, groups = t1 - t0, collections.Counter()
    for pid, (name, cpu) in b.items():
        if pid in a:
            groups[name] += cpu - a[pid][1]
    total = sum(groups.values())
    print(f"window {wall:.1f} s; all processes {total:.2f} CPU-s = {total / wall:.2f} cores")
    for name, cpu in groups.most_common(14):
        print(f"  {cpu:7.2f} CPU-s  {cpu / wall:5.2f} cores  {name}")


if __name__ == "__main__":
    main()
