"""Committed step metrics MLflow has not taken yet, kept in the run directory, each step once.

A checkpoint holds the metrics of its own steps (checkpoint.METRICS_FILE): a restart, the
driver at the end or `raytrain sync-metrics` writes them if rank 0 never could. While MLflow is
down, the steps of earlier checkpoints are not in MLflow either, and those checkpoints may be
pruned (`checkpoint.keep_last`). Rewriting every unwritten step into each new checkpoint kept
them, but an outage of n steps then wrote O(n^2) step records. Here rank 0 writes the steps that
were still unwritten at a checkpoint, and not written here before, into one signed file of their
own (`steps_<first>-<last>.json`): each step is written once, and a file is deleted once MLflow
has all its steps. Nothing is written while MLflow keeps up.

Readers take the files' steps up to the step of the checkpoint they restore, with that
checkpoint's own: steps are written to MLflow only if the run has not got them (its watermark,
tracking.logged_through), so a step read twice is logged once.
"""

from __future__ import annotations

import json

from raytrain.rundir import signing, storage

FOLDER = "mlflow_backlog"


def _folder(run_dir: str) -> str:
    return storage.join(run_dir, FOLDER)


def _spans(run_dir: str) -> list[tuple[int, int, str]]:
    """(first step, last step, file name) of each complete backlog file, oldest first."""
    spans = []
    for name in storage.files(_folder(run_dir)):
        if name.startswith("steps_") and name.endswith(".json"):  # not a local write's temporary name
            first, last = name[len("steps_") : -len(".json")].split("-")
            spans.append((int(first), int(last), name))
    return sorted(spans)


class Journal:
    """Rank 0's side: `keep` at each checkpoint the steps MLflow has not taken yet; `forget` those
    MLflow has. Built at the step the run resumed from: files of steps past it are a lineage that
    was rolled back (a takeover or a deleted checkpoint resumed before them), so their steps are
    not "kept already" (the watermark is at most the resumed step), and the first `keep` or
    `forget` (each after the loop's lease check: a fenced group touches nothing here) trims them
    to the resumed step, so a later restore never reads the old lineage's values for its steps."""

    def __init__(self, run_dir: str, resumed: int = 0):
        self.run_dir, self.resumed = run_dir, resumed
        spans = _spans(run_dir)  # listed once: kept in memory after
        self.files = [(last, name) for _, last, name in spans if last <= resumed]
        self.stale = [(first, last, name) for first, last, name in spans if last > resumed]
        self.through = max((last for last, _ in self.files), default=0)  # steps kept here already

    def _trim(self) -> None:
        """The rolled-back lineage's files: whole ones past the resumed step deleted, one that
        straddles it rewritten with its steps up to that step."""
        for first, last, name in self.stale:
            uri = storage.join(_folder(self.run_dir), name)
            if first <= self.resumed:
                doc = signing.verify_document(json.loads(storage.read_text(uri)), uri)
                signing.require_place(doc, "run_dir", signing.place(self.run_dir), uri)
                self._write([(step, m) for step, m in doc["steps"] if step <= self.resumed])
            storage.delete(uri)
        self.stale = []

    def _write(self, steps: list[tuple[int, dict]]) -> None:
        if not steps:
            return
        first, last = min(step for step, _ in steps), max(step for step, _ in steps)
        name = f"steps_{first:08d}-{last:08d}.json"
        doc = signing.sign_document({"run_dir": signing.place(self.run_dir), "steps": steps})
        storage.write_whole(storage.join(_folder(self.run_dir), name), json.dumps(doc))  # complete or invisible
        self.through = max(self.through, last)
        self.files.append((last, name))

    def keep(self, steps: list[tuple[int, dict]]) -> None:
        if self.stale:
            self._trim()
        self._write([(step, metrics) for step, metrics in steps if step > self.through])

    def forget(self, logged_through: int) -> None:
        if self.stale:
            self._trim()
        for last, name in [f for f in self.files if f[0] <= logged_through]:
            storage.delete(storage.join(_folder(self.run_dir), name))
            self.files.remove((last, name))


def forget(run_dir: str, logged_through: int) -> None:
    """Delete the backlog files whose steps MLflow has, all of them."""
    for _, last, name in _spans(run_dir):
        if last <= logged_through:
            storage.delete(storage.join(_folder(run_dir), name))


def unwritten(run_dir: str, state) -> list[tuple[int, dict]]:
    """The steps a restore of `state` (a TrainState read with its metrics; None: no checkpoint, so
    nothing committed) may still owe MLflow: the backlog's up to its step, then its own, in step order."""
    if state is None:
        return []
    steps: list[tuple[int, dict]] = []  # a checkpoint's step has two entries: its metrics, its checkpoint_step
    for first, last, name in _spans(run_dir):
        if first > state.step:
            continue  # kept by a later checkpoint this restore is not (a takeover resumed before it)
        uri = storage.join(_folder(run_dir), name)
        doc = signing.verify_document(json.loads(storage.read_text(uri)), uri)
        signing.require_place(doc, "run_dir", signing.place(run_dir), uri)
        steps += [(step, metrics) for step, metrics in doc["steps"] if step <= state.step]
    return sorted(steps + [tuple(pair) for pair in state.metrics], key=lambda pair: pair[0])  # stable: in order
