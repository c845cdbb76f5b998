"""Deterministic fault injection for the fault-tolerance tests and the chaos script.

Off unless RAYTRAIN_FAULTS is set (JSON: {"dir": marker folder, "faults": [{"at": "step"|
"save", "step": k, "rank": r, "action": "exit"|"sigterm"}]}). Each fault fires once per job
(a marker file in "dir" remembers it across restarts), so "kill rank 1 after step 7" means
exactly that: a real process death at a known point, which a test can compare bit for bit
with an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

ENV = "RAYTRAIN_FAULTS"


def maybe_fire(at: str, step: int, rank: int) -> None:
    plan = os.environ.get(ENV)
    if not plan:
        return
    plan = json.loads(plan)
    for i, fault in enumerate(plan["faults"]):
        if fault["at"] != at or fault["rank"] != rank:
            continue
        if fault["step"] == "*" and fault["action"] == "pause":
            time.sleep(fault["seconds"])  # slow every step: gives a chaos run time to be broken
            continue
        if fault["step"] != step:
            continue
        marker = Path(plan["dir"], f"fault-{i}")
        if marker.exists():
            continue
        marker.write_text(json.dumps(fault))
        print(f"[raytrain] fault injection: {fault['action']} rank {rank} at {at} of step {step}", flush=True)
        if fault["action"] == "exit":
            os._exit(1)
        if fault["action"] == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)
