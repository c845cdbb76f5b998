"""Where a job's start-up goes: each phase as seconds since `raytrain run` started, so a user
sees on their own cluster what the wait before step 1 was made of.

The driver marks its phases (MLflow run open, Ray connected) and hands them to the workers
with the job; rank 0 adds its own (worker up, model built and sharded, checkpoint restored,
token stores ready and open: the driver prepares them while the workers build the model,
step 1 done), prints the line once per attempt and logs each
phase to MLflow as `startup/<phase>_s` at step = the attempt's number. A restart's line is
the same phases, counted from the moment its workers came up.

Each worker also notes its host memory at each phase (resident, and the peak so far): the
busiest rank's figures are in the line and in MLflow as `startup/host_mb/<phase>` and
`startup/host_peak_mb/<phase>`, so where a worker's memory went (loading, sharding, the data,
the first step) is read off every run, not guessed.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

DRIVER_PHASES = (
    "ray",
    "mlflow",
)  # the MLflow run opens once this driver holds the run directory (its store seeded while Ray starts)
# loaded: the trained model's weights in place (sharded, filled); model: with its optimizer (and DPO's reference);
# data: the stores ready (prepared meanwhile) and open; steps: after the attempt's STEADY_AFTER-th step.
WORKER_PHASES = ("workers", "loaded", "model", "restored", "data", "step_1", "steps")
STEADY_AFTER = 5


@dataclass
class Timeline:
    started_at: float = field(default_factory=time.time)  # wall clock: the driver and workers share it
    marks: dict[str, float] = field(default_factory=dict)
    memory: dict[str, tuple[float, float]] = field(default_factory=dict)  # phase -> (resident, peak) MiB, this process

    def mark(self, phase: str) -> None:
        self.marks[phase] = round(time.time() - self.started_at, 3)
        if phase in WORKER_PHASES:
            self.memory[phase] = host_memory_mb()

    def with_busiest(self, every_rank: list[dict]) -> None:
        """Take, per phase, the largest of every rank's `memory` (gathered at step 1)."""
        for phase in WORKER_PHASES:
            seen = [m[phase] for m in every_rank if phase in m]
            if seen:
                self.memory[phase] = (max(r for r, _ in seen), max(p for _, p in seen))

    def to_config(self) -> dict:
        return {"started_at": self.started_at, "marks": dict(self.marks)}

    def steps_line(self) -> str:
        resident, peak = self.memory["steps"]
        return (
            f"host memory of the busiest rank after {STEADY_AFTER} steps (resident/peak MiB): {resident:.0f}/{peak:.0f}"
        )

    def line(self, attempt: int) -> str:
        memory = (
            (
                "; host memory of the busiest rank (resident/peak MiB): "
                + ", ".join(f"{p} {r:.0f}/{k:.0f}" for p, (r, k) in self.memory.items())
            )
            if self.memory
            else ""
        )
        if attempt == 1:
            return (
                "start-up: "
                + " -> ".join(f"{p} {self.marks[p]:.1f}s" for p in (*DRIVER_PHASES, *WORKER_PHASES) if p in self.marks)
                + memory
            )
        origin = self.marks.get("workers", 0.0)
        return (
            f"attempt {attempt} start-up (from its workers up): "
            + " -> ".join(f"{p} +{self.marks[p] - origin:.1f}s" for p in WORKER_PHASES[1:] if p in self.marks)
            + memory
        )

    def metrics(self, attempt: int, upto: str = "step_1") -> dict[str, float]:
        """The MLflow values of the phases marked since the last report (at step 1: all before it)."""
        phases = (*DRIVER_PHASES, *WORKER_PHASES) if attempt == 1 else WORKER_PHASES
        phases = phases[: phases.index(upto) + 1] if upto == "step_1" else (upto,)
        out = {f"startup/{p}_s": self.marks[p] for p in phases if p in self.marks}
        for p in phases:
            if p in self.memory:
                out[f"startup/host_mb/{p}"], out[f"startup/host_peak_mb/{p}"] = self.memory[p]
        return out


def host_memory_mb() -> tuple[float, float]:
    """(resident, peak resident) MiB of this process, from /proc (Linux); zeros elsewhere."""
    try:
        with open(f"/proc/{os.getpid()}/status") as f:
            fields = dict(line.split(":", 1) for line in f if line.startswith(("VmRSS", "VmHWM")))
        return tuple(int(fields[k].split()[0]) / 1024 for k in ("VmRSS", "VmHWM"))  # host: /proc text
    except (OSError, KeyError, ValueError):
        return 0.0, 0.0
