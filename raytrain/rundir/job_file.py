"""The job's two signed documents, each bound to its run directory: the job as it ran (`job.json` in
the run directory), which `raytrain export` and `raytrain sync-metrics` rebuild the job from
(trust_remote_code included), and the run plan the driver hands each worker group. Each is read
back only once its signature and its place hold."""

from __future__ import annotations

import json
from dataclasses import asdict

from raytrain.job.plan import RunPlan
from raytrain.job.spec import JobSpec
from raytrain.rundir import signing, storage

JOB_FILE = "job.json"


def write_job_file(spec: JobSpec) -> None:
    """The job as it ran, signed: export rebuilds the model from it (trust_remote_code included)."""
    fs, path = storage.filesystem(spec.run_dir)
    fs.create_dir(path, recursive=True)
    with fs.open_output_stream(f"{path}/{JOB_FILE}") as f:
        doc = {**spec.model_dump(mode="json"), "run_dir": signing.place(spec.run_dir)}
        f.write(json.dumps(signing.sign_document(doc), indent=2).encode())


def read_job_file(run_dir: str) -> JobSpec:
    uri = storage.join(run_dir, JOB_FILE)
    doc = signing.verify_document(json.loads(storage.read_text(uri)), uri)
    signing.require_place(doc, "run_dir", signing.place(run_dir), uri)
    doc.pop("run_dir")
    return JobSpec.model_validate(doc)


def sign_plan(plan: RunPlan, spec: JobSpec) -> dict:
    """One signed document of everything a worker acts on: the driver's plan and the job itself (its
    `model.path`, `trust_remote_code`, data, every field), bound to the run directory."""
    return signing.sign_document(
        {**asdict(plan), "spec": spec.model_dump(mode="json"), "run_dir": signing.place(spec.run_dir)}
    )


def verify_plan(doc: dict) -> tuple[JobSpec, RunPlan]:
    """(the job, the driver's plan), if the signature holds and it was made for the job's run
    directory; a changed field anywhere in it (a worker config edited on its way) is refused."""
    doc = signing.verify_document(doc, "the run plan")
    spec = JobSpec.model_validate(doc.pop("spec"))  # validated again: the rules hold on this side too
    signing.require_place(doc, "run_dir", signing.place(spec.run_dir), f"the run plan for {spec.run_dir}")
    doc.pop("run_dir")
    return spec, RunPlan(**doc)
