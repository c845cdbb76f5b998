"""P5's checkpoint arms, installed inside raytrain's Ray Train workers (never in the product).

`arm_raytrain.py --ckpt timed|async-dcp` replaces the trainer's train function, on the
driver, with `make_train_func(mode, log_dir)`; each worker then patches `raytrain.checkpoint`
(the loop looks its functions up at every save) and runs raytrain's own worker.

- timed: raytrain's save unchanged, its parts timed: the DCP write (`strategy.save`),
  `ray.train.report` (dir-name barrier, plus the copy to storage when synchronous) and the
  wait for the controller's commit (`get_all_reported_checkpoints(COMMITTED)`, inside
  `confirm`). With `checkpoint.async_upload: true` in the job this times raytrain's own
  asynchronous upload; without, its synchronous save.
- async-dcp: the prototype that also takes the DCP write off the step. `dcp.async_save`
  stages the state dict into CPU memory (a copy: training may go on mutating parameters)
  and writes the files in a background thread, over a dedicated gloo group (the training
  thread keeps the default group: two threads on one gloo group could interleave
  collectives). `ray.train.report(checkpoint_upload_mode=ASYNC)` gets an upload function
  that first waits for DCP's future, so Ray copies complete files. At most one save is in
  flight. A save the loop marks urgent (wait=True: final, preemption, stop) is raytrain's
  synchronous one, after the in-flight write finishes. With the older save interface
  (no `wait`), the last save is synchronous and the previous save's commit wait and
  COMMITTED marker happen at the next save, counted there.

Each rank appends one JSON line per save ({"mode", "step", part timings}) to
<log_dir>/ckpt-rank<r>.jsonl.
"""

from __future__ import annotations

import inspect
import json
import os
import tempfile
import time


def make_train_func(mode: str, log_dir: str):
    """A train function for TorchTrainer that installs `mode` in the worker, then runs raytrain's."""

    def train_func(config: dict) -> None:
        install(mode, log_dir)
        from raytrain import worker

        worker.train_func(config)

    return train_func


def install(mode: str, log_dir: str) -> None:
    import raytrain.checkpoint as ck

    timings: dict[str, float] = {}
    if hasattr(ck, "confirm"):  # the loop calls it before a save, for the previous async one
        ck.confirm = _timed(ck.confirm, "confirm_s", timings)
    save = _timed_save if mode == "timed" else _async_dcp
    ck.save_and_report = save(ck.save_and_report, log_dir, timings)


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
        strategy.save = _timed(strategy.save, "dcp_write_s", timings)
        ray.train.report = _timed(saved[0], "report_s", timings)
        ray.train.get_all_reported_checkpoints = _timed(saved[1], "commit_wait_s", timings)
        start = time.perf_counter()
        try:
            return original(strategy, state, metrics, **kwargs)
        finally:
            del strategy.save  # back to the class's method
            ray.train.report, ray.train.get_all_reported_checkpoints = saved
            record = {"mode": "timed", "step": state.step, "wait": kwargs.get("wait", True),
                      "save_s": time.perf_counter() - start, **timings}
            timings.clear()
            _log(log_dir, strategy.rank, record)

    return save_and_report


def _async_dcp(original, log_dir: str, timings: dict):
    """Asynchronous DCP write + Ray ASYNC upload for the saves the loop does not wait for."""
    import ray.train
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from ray.train import CheckpointUploadMode
    from raytrain.checkpoint import STATE_FILE

    new_interface = "wait" in inspect.signature(original).parameters
    inflight: dict = {}

    def save_and_report(strategy, state, metrics, wait: bool = True):
        start = time.perf_counter()
        if inflight.get("future") is not None:
            inflight.pop("future").result()  # one save in flight at most: bounded staging memory
            if not new_interface:
                _commit_marker(strategy, inflight.pop("step"))  # the previous save's deferred commit
        urgent = wait if new_interface else state.step >= strategy.spec.training.max_steps
        if urgent:  # committed before training goes on, as raytrain does it
            result = original(strategy, state, metrics, **({"wait": True} if new_interface else {}))
            _log(log_dir, strategy.rank, {"mode": "async-dcp:urgent-sync", "step": state.step,
                                          "save_s": time.perf_counter() - start, **timings})
            timings.clear()
            return result
        if "group" not in inflight:  # collective: every rank saves at the same step
            inflight["group"] = dist.new_group(backend="gloo")
        folder = tempfile.mkdtemp(prefix="raytrain-ckpt-")  # Ray deletes it after the upload
        future = dcp.async_save(strategy._state(), checkpoint_id=folder, process_group=inflight["group"])
        if strategy.rank == 0:
            with open(os.path.join(folder, STATE_FILE), "w") as f:
                f.write(state.to_json())
        staged = time.perf_counter()
        from ray.train.v2._internal.execution.context import get_train_context

        storage = get_train_context().storage_context

        def upload(checkpoint, dir_name):
            future.result()  # DCP's files are complete before Ray copies the folder
            return storage.persist_current_checkpoint(checkpoint, dir_name)

        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(folder),
                         checkpoint_dir_name=f"step_{state.step:08d}", checkpoint_upload_mode=CheckpointUploadMode.ASYNC,
                         checkpoint_upload_fn=upload)
        inflight["future"], inflight["step"] = future, state.step
        end = time.perf_counter()
        _log(log_dir, strategy.rank, {"mode": "async-dcp", "step": state.step, "save_s": end - start,
                                      "stage_s": staged - start, "report_s": end - staged, **timings})
        timings.clear()
        return None

    return save_and_report


def _commit_marker(strategy, step: int) -> None:
    """Older interface: what raytrain's sync save does right after report, one save later:
    wait for Ray to commit the (by now long uploaded) checkpoint, then mark it COMMITTED."""
    import ray.train
    from ray.train import CheckpointConsistencyMode
    from raytrain.checkpoint import COMMITTED_FILE

    committed = ray.train.get_all_reported_checkpoints(consistency_mode=CheckpointConsistencyMode.COMMITTED)
    if strategy.rank == 0 and committed:
        latest = committed[-1].checkpoint
        with latest.filesystem.open_output_stream(f"{latest.path}/{COMMITTED_FILE}") as marker:
            marker.write(str(step).encode())
