"""Where a job's start-up goes: each phase as seconds since `raytrain run` started, so a user
sees on their own cluster what the wait before step 1 was made of.

The driver marks its phases (MLflow run open, Ray connected) and hands them to the workers
with the job; rank 0 adds its own (worker up, model built and sharded, checkpoint restored,
token stores ready and open: the driver prepares them while the workers build the model,
step 1 done), prints the line once per attempt and logs each
phase to MLflow as `startup/<phase>_s` at step = the attempt's number. A restart's line is
the same phases, counted from the moment its workers came up.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

DRIVER_PHASES = ("ray", "mlflow")  # the MLflow run opens once this driver holds the run directory (its store seeded while Ray starts)
WORKER_PHASES = ("workers", "model", "restored", "data", "step_1")  # data: the stores ready (prepared meanwhile) and open


@dataclass
class Timeline:
    started_at: float = field(default_factory=time.time)  # wall clock: the driver and workers share it
    marks: dict[str, float] = field(default_factory=dict)

    def mark(self, phase: str) -> None:
        self.marks[phase] = round(time.time() - self.started_at, 3)

    def to_config(self) -> dict:
        return {"started_at": self.started_at, "marks": dict(self.marks)}

    def line(self, attempt: int) -> str:
        if attempt == 1:
            return "start-up: " + " -> ".join(f"{p} {self.marks[p]:.1f}s" for p in (*DRIVER_PHASES, *WORKER_PHASES)
                                              if p in self.marks)
        origin = self.marks.get("workers", 0.0)
        return f"attempt {attempt} start-up (from its workers up): " + " -> ".join(
            f"{p} +{self.marks[p] - origin:.1f}s" for p in WORKER_PHASES[1:] if p in self.marks)

    def metrics(self, attempt: int) -> dict[str, float]:
        phases = (*DRIVER_PHASES, *WORKER_PHASES) if attempt == 1 else WORKER_PHASES
        return {f"startup/{p}_s": self.marks[p] for p in phases if p in self.marks}
