"""Fault injection for raytrain's tests and chaos script, from outside the product.

raytrain has no fault code. A test cluster starts with this folder on PYTHONPATH and
RAYTRAIN_TEST_FAULTS naming a plan file, so every Python process of the cluster imports this
module at start-up (Python's `sitecustomize`). It wraps two raytrain functions as they are
imported, the way a site's own instrumentation would, and reads the plan (when the file
exists) at each step:

    {"dir": marker folder, "faults": [{"at": "step"|"save"|"rollout"|"tools"|"upload", "step": k|"*", "rank": r,
                                       "action": "exit"|"sigterm"|"pause"|"slow_down", "seconds": s}]}

"step" fires after rank r finished step k; "save" after rank r wrote its part of step k's
checkpoint and before the checkpoint is reported (so it is never committed); "rollout" after rank
r sampled the first micro-batch's completions of GRPO's step k (mid-rollout); "tools" after rank r ran
the first round of tool calls of step k's episodes (mid-episode); "upload" as Ray Train
starts copying rank r's part of step k's checkpoint to storage, where "slow_down" raises the error
S3 answers a client over its request rate (503 SlowDown), as pyarrow words it: Ray retries the
upload on that rank alone. A fault with
"after_commit": {"run_dir": d, "step": j} first waits until Ray Train has registered the
checkpoint of step j in d (its checkpoint_manager_snapshot.json names it): a kill that must
come after a background upload committed. One with "after_live": {"tracking_uri": u, "run_dir": d,
"step": j} first waits until MLflow holds live/loss of step j for that job's run: live values are
written in the background, best effort, and a kill that must come after one reached MLflow says
so. Each fault fires
once per job (a marker file in "dir" remembers it across restarts): "kill rank 1 after step 7"
is a real process death at a known point, which a test compares bit for bit with an
uninterrupted run. `"step": "*"` with "pause" slows every step (a chaos run lasts long enough
to be broken).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import os
import signal
import sys
import time
from pathlib import Path

PLAN_ENV = "RAYTRAIN_TEST_FAULTS"
_saving = {"step": 0}  # the step whose checkpoint this process is writing


def fire(at: str, step: int, rank: int) -> None:
    try:
        plan = json.loads(Path(os.environ[PLAN_ENV]).read_text())
    except (KeyError, FileNotFoundError, json.JSONDecodeError):  # no plan: nothing to do
        return
    for i, fault in enumerate(plan["faults"]):
        if fault["at"] != at or fault["rank"] != rank:
            continue
        if fault["step"] == "*" and fault["action"] == "pause":
            time.sleep(fault["seconds"])
            continue
        marker = Path(plan["dir"], f"fault-{i}")
        if fault["step"] != step or marker.exists():
            continue
        marker.write_text(json.dumps(fault))
        if "after_commit" in fault:
            _wait_for_commit(**fault["after_commit"])
        if "after_live" in fault:
            _wait_for_live(**fault["after_live"])
        print(f"[test] fault injection: {fault['action']} rank {rank} at {at} of step {step}", flush=True)
        if fault["action"] == "exit":
            os._exit(1)
        if fault["action"] == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)
        if fault["action"] == "pause":  # a hang at a known point (a test may freeze the process meanwhile)
            time.sleep(fault["seconds"])
        if fault["action"] == "slow_down":
            raise OSError(
                "When uploading part for key 'step': AWS Error SLOW_DOWN during UploadPart operation: "
                "Please reduce your request rate. (HTTP 503, injected by the test)"
            )


def _wait_until(reached, interval_s: float, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if reached():
            return
        time.sleep(interval_s)
    raise TimeoutError(f"{what} within {timeout_s} s")


def _wait_for_live(tracking_uri: str, run_dir: str, step: int, timeout_s: float = 120) -> None:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)

    def reached() -> bool:
        runs = client.search_runs(
            [e.experiment_id for e in client.search_experiments()], f"tags.`raytrain.run_dir` = '{run_dir}'"
        )
        return any(m.step == step for r in runs for m in client.get_metric_history(r.info.run_id, "live/loss"))

    _wait_until(reached, 0.2, timeout_s, f"live/loss of step {step} did not reach MLflow")


def _wait_for_commit(run_dir: str, step: int, timeout_s: float = 120) -> None:
    snapshot, name = Path(run_dir, "checkpoint_manager_snapshot.json"), f"step_{step:08d}"

    def reached() -> bool:
        try:
            return name in snapshot.read_text()
        except FileNotFoundError:
            return False

    _wait_until(reached, 0.05, timeout_s, f"the checkpoint of step {step} was not committed in {run_dir}")


def _after_step(module) -> None:  # raytrain.train.preemption: every rank reports each finished step here
    original = module.StopSignals.step_done

    def step_done(self, step, step_time, rank):
        original(self, step, step_time, rank)
        fire("step", step, rank)

    module.StopSignals.step_done = step_done


def _around_save(module) -> None:  # raytrain.train.checkpoint: the step being saved
    original = module.save_and_report

    def save_and_report(strategy, state, *args, **kwargs):
        _saving["step"] = state.step
        return original(strategy, state, *args, **kwargs)

    module.save_and_report = save_and_report


def _after_write(cls_name: str):
    def patch(module) -> None:  # a strategy's save/save_async: its files written (or staged)
        cls = getattr(module, cls_name)
        for name in ("save", "save_async"):
            original = cls.__dict__.get(name)
            if original is None:
                continue

            def wrapped(self, directory, _original=original):
                out = _original(self, directory)
                fire("save", _saving["step"], self.rank)
                return out

            setattr(cls, name, wrapped)

    return patch


def _in_rollout(module) -> None:  # raytrain.objectives.grpo: after the first micro-batch's completions of a step
    original_at, original_rollout = module.GRPO.at, module.rollout

    def at(self, step, rows):
        _saving["rollout"] = step + 1  # the step whose rollouts come next
        return original_at(self, step, rows)

    def rollout(strategy, *args, **kwargs):
        out = original_rollout(strategy, *args, **kwargs)
        fire("rollout", _saving.get("rollout", 0), strategy.rank)
        return out

    module.GRPO.at, module.rollout = at, rollout


def _in_episodes(module) -> None:  # raytrain.rl.episodes: after a round of tool calls
    original = module.tool_round

    def tool_round(host, episodes):
        import torch.distributed as dist

        out = original(host, episodes)
        fire("tools", _saving.get("rollout", 0), dist.get_rank() if dist.is_initialized() else 0)
        return out

    module.tool_round = tool_round


def _on_upload(module) -> None:  # Ray Train's storage: a rank's copy of its part of a checkpoint
    original = module.StorageContext.persist_current_checkpoint

    def persist_current_checkpoint(self, checkpoint, checkpoint_dir_name):
        import torch.distributed as dist

        fire("upload", int(checkpoint_dir_name[len("step_") :][:8]), dist.get_rank() if dist.is_initialized() else 0)
        return original(self, checkpoint, checkpoint_dir_name)

    module.StorageContext.persist_current_checkpoint = persist_current_checkpoint


PATCHES = {
    "ray.train.v2._internal.execution.storage": _on_upload,
    "raytrain.objectives.grpo": _in_rollout,
    "raytrain.rl.episodes": _in_episodes,
    "raytrain.train.preemption": _after_step,
    "raytrain.train.checkpoint": _around_save,
    "raytrain.strategies.base": _after_write("TorchStrategy"),
    "raytrain.strategies.zero3": _after_write("Zero3Strategy"),
}


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in PATCHES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            PATCHES[name](module)

        spec.loader.exec_module = exec_and_patch
        return spec


if os.environ.get(PLAN_ENV):
    sys.meta_path.insert(0, _PatchOnImport())
