"""`raytrain k8s jobs/X.yaml`: the KubeRay objects that run one job on Kubernetes.

The source of truth is `k8s/rayjob.template.yaml` (a complete ConfigMap + PodDisruptionBudget
+ RayJob); this module only fills in what follows from the job, so the rendered RayJob and
the job file can never disagree:

- the job file itself goes into the ConfigMap, mounted on the head at /etc/raytrain/job.yaml;
- one worker pod per node holds `scaling.workers_per_node` training workers, and the worker
  group's replica range is `scaling.worker_range` in such pods, so KubeRay's autoscaler grows
  and shrinks the cluster inside exactly the range Ray Train's elastic scaling uses; the pods'
  GPUs, CPUs, memory and ephemeral storage come from the job (pod_sizing.py);
- the job's NetworkPolicy admits the Ray ports from its own pods (and KubeRay's operator) only;
- grace periods come from `failure.preemption_grace_s`: the preStop drain window equals it and
  the pod's terminationGracePeriodSeconds leaves a margin on top, so a checkpoint that the
  worker may take that long to commit is never cut off by the kubelet's SIGKILL.

Output is multi-document YAML on stdout (exit 0), or the job's problems on stderr (exit 2).
"""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import yaml

from raytrain.deploy import pod_sizing
from raytrain.model.facts import ModelFacts
from raytrain.rundir import storage
from raytrain.validate import preflight

TEMPLATE_NAME = "rayjob.template.yaml"
JOB_MOUNT = "/etc/raytrain"  # where the head mounts the ConfigMap; the entrypoint reads job.yaml there
SHARED_MOUNT = "/mnt/shared"  # paths under it live on the shared PVC (k8s/shared-storage.yaml)
SHARED_CLAIM = "raytrain-shared"
MAX_NAME = 47  # KubeRay: RayJob names longer than 47 characters are rejected
GRACE_MARGIN_S = 30  # kubelet SIGKILL comes this long after the worker's own checkpoint deadline
EXIT_OK, EXIT_INVALID = 0, 2


def template_path() -> Path:
    """k8s/ beside the package (a checkout or editable install), else ./k8s."""
    for root in (Path(__file__).resolve().parents[1], Path.cwd()):
        if (root / "k8s" / TEMPLATE_NAME).is_file():
            return root / "k8s" / TEMPLATE_NAME
    raise FileNotFoundError(f"k8s/{TEMPLATE_NAME} not found: run `raytrain k8s` from the raytrain repository")


def load_template(path: Path | None = None) -> dict[str, dict]:
    """The template's documents by kind. The JSON round trip drops YAML anchors, so editing
    one pod's securityContext never edits another's through a shared object."""
    docs = [d for d in yaml.safe_load_all((path or template_path()).read_text()) if d]
    return {d["kind"]: json.loads(json.dumps(d)) for d in docs}


def k8s_name(name: str) -> str:
    """A job name as a DNS-1035 label KubeRay accepts: lowercase, [a-z0-9-], starts with a
    letter, at most 47 characters."""
    out = re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")
    out = re.sub(r"-{2,}", "-", out)
    if not out or not out[0].isalpha():
        out = "rt-" + out
    return out[:MAX_NAME].rstrip("-")


def _labels(meta: dict, name: str) -> None:
    labels = meta.setdefault("labels", {})
    labels["app.kubernetes.io/instance"] = name
    labels["raytrain.io/job"] = name


def _set_env(container: dict, name: str, value: str) -> None:
    env = container.setdefault("env", [])
    for item in env:
        if item["name"] == name:
            item.pop("valueFrom", None)
            item["value"] = value
            return
    env.append({"name": name, "value": value})


def _uses_shared(spec) -> bool:
    paths = (spec.checkpoint.storage_path, *(d.path for _, d in spec.data.named_inputs()), spec.model.path)
    return any(p == SHARED_MOUNT or p.startswith(SHARED_MOUNT + "/") for p in paths)


def _pod_templates(rayjob: dict) -> list[dict]:
    cluster = rayjob["spec"]["rayClusterSpec"]
    return [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]


def render(
    spec, job_text: str, image: str, namespace: str, template: Path | None = None, facts: ModelFacts | None = None
) -> list[dict]:
    """ConfigMap, PodDisruptionBudget, NetworkPolicy and RayJob for `spec`, whose file text is
    `job_text`; `facts` (the model's dimensions) size the worker pods."""
    docs = load_template(template)
    config_map, pdb, policy, rayjob = (docs[k] for k in ("ConfigMap", "PodDisruptionBudget", "NetworkPolicy", "RayJob"))
    name = k8s_name(spec.name)
    for doc, doc_name in ((config_map, f"{name}-job"), (pdb, name), (policy, f"{name}-ray"), (rayjob, name)):
        doc["metadata"]["name"], doc["metadata"]["namespace"] = doc_name, namespace
        _labels(doc["metadata"], name)
    config_map["data"] = {"job.yaml": job_text}
    pdb["spec"]["selector"]["matchLabels"]["raytrain.io/job"] = name
    policy["spec"]["podSelector"]["matchLabels"]["raytrain.io/job"] = name
    policy["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"]["raytrain.io/job"] = name

    cluster = rayjob["spec"]["rayClusterSpec"]
    submitter = rayjob["spec"]["submitterPodTemplate"]
    _labels(submitter["metadata"], name)
    for container in submitter["spec"]["containers"]:
        container["image"] = image

    # Grace: the worker's own SIGTERM deadline (failure.preemption_grace_s, when this version
    # of the spec has it) is the drain window; the kubelet waits a margin longer.
    drain_s = math.ceil(getattr(spec.failure, "preemption_grace_s", 120))
    for pod in _pod_templates(rayjob):
        _labels(pod["metadata"], name)
        pod["spec"]["terminationGracePeriodSeconds"] = drain_s + GRACE_MARGIN_S
        for container in pod["spec"]["containers"]:
            container["image"] = image
            _set_env(container, "RAYTRAIN_DRAIN_S", str(drain_s))
            _set_env(container, "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", str(drain_s))
            if any(e["name"] == "RAY_JOB_STOP_WAIT_TIME_S" for e in container.get("env", [])):
                _set_env(container, "RAY_JOB_STOP_WAIT_TIME_S", str(drain_s))
        if _uses_shared(spec):
            pod["spec"].setdefault("volumes", []).append(
                {"name": "shared", "persistentVolumeClaim": {"claimName": SHARED_CLAIM}}
            )
            pod["spec"]["containers"][0].setdefault("volumeMounts", []).append(
                {"name": "shared", "mountPath": SHARED_MOUNT}
            )
    for volume in cluster["headGroupSpec"]["template"]["spec"]["volumes"]:
        if volume["name"] == "job":
            volume["configMap"]["name"] = f"{name}-job"

    _size_workers(cluster["workerGroupSpecs"][0], pod_sizing.size_pods(spec, facts), spec.scaling.use_gpu)
    return [config_map, pdb, policy, rayjob]


def _size_workers(group: dict, size: pod_sizing.PodSize, gpu: bool) -> None:
    """One worker pod per node, `size.workers` training workers in it; replicas follow the job's range."""
    group["groupName"] = "gpu-spot" if gpu else "cpu-spot"
    group["replicas"], group["minReplicas"] = size.pods[0], size.pods[0]
    group["maxReplicas"] = size.pods[1]
    pod = group["template"]["spec"]
    container = pod["containers"][0]
    for kind in ("requests", "limits"):
        res = container["resources"][kind]
        res["cpu"] = str(size.cpus)
        if gpu:
            res["nvidia.com/gpu"] = str(size.gpus)
        else:
            res.pop("nvidia.com/gpu", None)
            res["memory"] = f"{4 * size.cpus}Gi"  # CPU pods without an estimate: memory scales with cores
        if size.memory_gib:
            res["memory"] = f"{size.memory_gib}Gi"
        if size.disk_gib:
            res["ephemeral-storage"] = f"{size.disk_gib}Gi"
    for volume in pod["volumes"]:
        if volume["name"] == "tmp" and size.disk_gib:
            volume["emptyDir"]["sizeLimit"] = f"{size.disk_gib}Gi"
        if volume["name"] == "dshm":
            volume["emptyDir"]["sizeLimit"] = f"{size.shm_gib}Gi"
    if size.basis:  # how each figure was reached, for `kubectl describe`
        group["template"]["metadata"].setdefault("annotations", {})["raytrain.io/sizing"] = "; ".join(size.basis)
    if not gpu:  # no GPU: no GPU taint to tolerate, and no reason to land on a GPU node
        pod["tolerations"] = [t for t in pod.get("tolerations", []) if t.get("key") != "nvidia.com/gpu"]


def cluster_warnings(spec, namespace: str, facts: ModelFacts | None) -> list[str]:
    """Things that validate but would not work, or not survive, on a Kubernetes cluster."""
    out = []
    local = lambda p: not storage.is_remote(p) and not (p == SHARED_MOUNT or p.startswith(SHARED_MOUNT + "/"))
    if local(spec.checkpoint.storage_path):
        out.append(
            f"checkpoint.storage_path={spec.checkpoint.storage_path!r} is local to a pod: checkpoints die with it "
            f"and a retry cannot resume; use s3://... or a path under {SHARED_MOUNT}"
        )
    for field, data in spec.data.named_inputs():
        if local(data.path):
            out.append(f"{field}={data.path!r} is not in the image: use s3://... or a path under {SHARED_MOUNT}")
    if spec.model.path.startswith((".", "/")) and local(spec.model.path):
        out.append(
            f"model.path={spec.model.path!r} is a local folder the pods do not have: use a hub id "
            f"(downloaded on the cluster with HF_TOKEN) or a path under {SHARED_MOUNT}"
        )
    if not (spec.tracking.uri or "").startswith(("http://", "https://")):
        out.append(
            f"tracking.uri is not an MLflow server: runs would be written inside the head pod; use "
            f"http://mlflow.{namespace}.svc.cluster.local:5000 (k8s/mlflow.yaml)"
        )
    if not spec.scaling.use_gpu:
        out.append("scaling.use_gpu is false: rendering CPU worker pods")
    if facts is None:
        out.append(
            f"model.path={spec.model.path!r}: its dimensions are not readable here, so the worker pods keep the "
            f"template's memory and disk; to size them from the job, run `hf download {spec.model.path} config.json` "
            "(or point model.path at a local copy) and render again"
        )
    return out


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the job file, preStop scripts) as readable `|` blocks."""


_Dumper.add_representer(
    str, lambda d, s: d.represent_scalar("tag:yaml.org,2002:str", s, style="|" if "\n" in s else None)
)


def dump(docs: list[dict]) -> str:
    return yaml.dump_all(docs, Dumper=_Dumper, sort_keys=False, width=1000)


def job_text(path: str, overrides: list[str]) -> str:
    """The job file as the cluster should run it: verbatim (comments kept) unless --set
    changed it, then the merged mapping."""
    if not overrides:  # trailing blanks would force YAML's quoted style onto the whole block
        return "\n".join(line.rstrip() for line in Path(path).read_text().splitlines()) + "\n"
    raw, problems = preflight.load_raw(path, list(overrides))
    if raw is None:
        raise ValueError("; ".join(str(p) for p in problems))
    return yaml.safe_dump(raw, sort_keys=False)


def cmd_render(args) -> int:
    overrides = list(getattr(args, "overrides", None) or [])
    spec, problems = preflight.check_job(args.job, overrides, probes=False)
    if problems:
        print(f"{args.job}: {len(problems)} problem(s); nothing was rendered:", file=sys.stderr)
        for p in problems:
            print(f"  - {p}", file=sys.stderr)
        return EXIT_INVALID
    namespace = getattr(args, "namespace", None) or "raytrain"
    facts = preflight.model_facts(spec)
    docs = render(
        spec, job_text(args.job, overrides), getattr(args, "image", None) or "raytrain:latest", namespace, facts=facts
    )
    for warning in cluster_warnings(spec, namespace, facts):
        print(f"# warning: {warning}", file=sys.stderr)
    sys.stdout.write(dump(docs))
    return EXIT_OK
