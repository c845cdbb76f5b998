"""P5's timer, installed inside raytrain's Ray Train workers (never in the product).

`arm_raytrain.py --ckpt timed` has each worker wrap what `raytrain.checkpoint.save_and_report`
calls (the loop looks it up at every save) and log, per save and rank, how long each part
blocked training: the state write (`strategy.save`, or for `checkpoint.async_save` the staging
in `strategy.save_async`), `ray.train.report` (dir-name barrier, plus the copy to storage when
synchronous), and the wait for the controller's commit (`get_all_reported_checkpoints
(COMMITTED)`, in `confirm`, which an asynchronous save pays at the next save, long after).

Each rank appends one JSON line per save ({"mode", "step", part timings}) to
<log_dir>/ckpt-rank<r>.jsonl.
"""

from __future__ import annotations

import json
import os
import time


def install(mode: str, log_dir: str) -> None:
    import raytrain.rundir.checkpoints as ck

    assert mode == "timed", mode
    timings: dict[str, float] = {}
    ck.confirm = _timed(ck.confirm, "confirm_s", timings)  # the loop calls it before a save, for the previous async one
    ck.save_and_report = _timed_save(ck.save_and_report, log_dir, timings)


def _timed(fn, name: str, timings: dict):
    def call(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            timings[name] = timings.get(name, 0.0) + time.perf_counter() - start

    return call


def _log(log_dir: str, rank: int, record: dict) -> None:
    with open(os.path.join(log_dir, f"ckpt-rank{rank}.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")


def _timed_save(original, log_dir: str, timings: dict):
    """raytrain's own save, unchanged, with its parts timed by wrapping what it calls."""
    import ray.train

    def save_and_report(strategy, state, metrics, **kwargs):
        saved = (ray.train.report, ray.train.get_all_reported_checkpoints)
        strategy.save = _timed(strategy.save, "write_s", timings)
        strategy.save_async = _timed(strategy.save_async, "stage_s", timings)
        ray.train.report = _timed(saved[0], "report_s", timings)
        ray.train.get_all_reported_checkpoints = _timed(saved[1], "commit_wait_s", timings)
        start = time.perf_counter()
        try:
            return original(strategy, state, metrics, **kwargs)
        finally:
            del strategy.save, strategy.save_async  # back to the class's methods
            ray.train.report, ray.train.get_all_reported_checkpoints = saved
            record = {
                "mode": "timed",
                "step": state.step,
                "wait": kwargs.get("wait", True),
                "save_s": time.perf_counter() - start,
                **timings,
            }
            timings.clear()
            _log(log_dir, strategy.rank, record)

    return save_and_report
