"""k8s/: every manifest, and the objects rendered for every jobs/*.yaml, validated against the
real KubeRay CRD schemas (../shared/schemas/kuberay, unknown fields are errors as with
`kubectl apply --validate=strict`) and Kubernetes' own schemas (kubernetes-validate, strict);
then the deployment's invariants: the `restricted` Pod Security rules one by one, the
service-account token only where the autoscaler reads it, each job's NetworkPolicy, pods sized
from the job, replica range = the job's worker range in whole nodes, grace periods and preStop
drains, a PodDisruptionBudget, nothing public, no secrets."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
import subprocess
import sys
import tempfile
from functools import lru_cache
from pathlib import Path
from unittest import mock

import jsonschema
import kubernetes_validate
import pytest
import yaml
from conftest import KNOWN_CONFIGS, REPO, hub_cache

from raytrain import cli
from raytrain.deploy import k8s, pod_sizing
from raytrain.job.spec import JobSpec
from raytrain.model.facts import DTYPE_BYTES, ModelFacts, layout_from_config
from raytrain.validate import memory, preflight

SCHEMAS = REPO.parent / "shared" / "schemas" / "kuberay"
CRDS = {("ray.io/v1", "RayJob"): "ray.io_rayjobs.yaml", ("ray.io/v1", "RayCluster"): "ray.io_rayclusters.yaml"}
K8S_VERSIONS = ("1.30", "1.37")  # the oldest Kubernetes we expect on EKS/GKE, and the newest schema shipped
MANIFESTS = sorted(p for p in (REPO / "k8s").glob("*.yaml") if p.name != "kustomization.yaml")
JOBS = sorted((REPO / "jobs").glob("*.yaml"))
RAY = str(Path(sys.executable).parent / "ray")  # the venv's CLI, whatever PATH says
SECRETISH = re.compile(r"(token|secret|password|passwd|api[_-]?key|access[_-]?key|credential)", re.I)


# ---------------------------------------------------------------- validators
def _strict(schema):
    """A CRD's structural schema with unknown fields forbidden wherever it lists fields."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "properties":
            out[key] = {name: _strict(sub) for name, sub in value.items()}
        elif key in ("items", "additionalProperties", "anyOf", "allOf", "oneOf", "not"):
            out[key] = _strict(value)
        else:
            out[key] = value
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


@lru_cache(maxsize=None)
def _crd_schema(filename: str) -> dict:
    crd = yaml.safe_load((SCHEMAS / filename).read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v.get("storage")]
    return version["schema"]["openAPIV3Schema"]


def _extension_errors(schema: dict, value, path: str) -> list[str]:
    """What jsonschema cannot see: list-map/set uniqueness and CEL rules. A CEL rule on a field
    the object sets fails the test (it is not evaluated here) unless it only constrains updates."""
    errors = []
    for rule in schema.get("x-kubernetes-validations", []):
        if rule["rule"] != "self == oldSelf":
            errors.append(f"{path}: CEL rule not evaluated by this test: {rule['rule']}")
    if isinstance(value, dict):
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            sub = schema.get("properties", {}).get(key) or (extra if isinstance(extra, dict) else None)
            if sub:
                errors += _extension_errors(sub, item, f"{path}.{key}")
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        kind = schema.get("x-kubernetes-list-type")
        if kind == "map":
            keys = [tuple(json.dumps(i.get(k)) for k in schema["x-kubernetes-list-map-keys"]) for i in value]
            if len(set(keys)) != len(keys):
                errors.append(f"{path}: duplicate keys {schema['x-kubernetes-list-map-keys']} in a list-map")
        elif kind == "set" and len({json.dumps(i, sort_keys=True) for i in value}) != len(value):
            errors.append(f"{path}: duplicate items in a list-set")
        for i, item in enumerate(value):
            errors += _extension_errors(schema["items"], item, f"{path}[{i}]")
    return errors


def _core_errors(doc: dict) -> list[str]:
    errors = []
    for version in K8S_VERSIONS:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            errors.append(
                f"{doc['kind']} {doc['metadata'].get('name')} (k8s {version}) at "
                f"{'.'.join(map(str, exc.path))}: {exc.message}"
            )
    return errors


def _pod_template_doc(template: dict, name: str) -> dict:
    """An embedded pod template, checked again as a core `v1 PodTemplate` (stricter than the CRD)."""
    return {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name}, "template": template}


def validation_errors(doc: dict) -> list[str]:
    key = (doc["apiVersion"], doc["kind"])
    if key not in CRDS:
        return _core_errors(doc)
    schema = _crd_schema(CRDS[key])
    validator = jsonschema.Draft7Validator(_strict(schema))
    errors = [f"{doc['kind']} at {'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(doc)]
    errors += _extension_errors(schema, doc, doc["kind"])
    # The CRD leaves metadata open; the API server checks it as ObjectMeta: so do we.
    meta = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": doc["metadata"]}
    errors += [e.replace("ConfigMap", f"{doc['kind']} metadata") for e in _core_errors(meta)]
    for i, template in enumerate(pod_templates(doc)):
        errors += _core_errors(_pod_template_doc(template, f"{doc['metadata']['name']}-{i}"))
    return errors


# ---------------------------------------------------------------- what is deployed
def pod_templates(doc: dict) -> list[dict]:
    if doc["kind"] == "RayJob":
        cluster = doc["spec"]["rayClusterSpec"]
        return [doc["spec"]["submitterPodTemplate"], cluster["headGroupSpec"]["template"]] + [
            g["template"] for g in cluster["workerGroupSpecs"]
        ]
    if doc["kind"] in ("Deployment", "StatefulSet", "Job"):
        return [doc["spec"]["template"]]
    return []


def ray_pods(rayjob: dict) -> list[dict]:
    cluster = rayjob["spec"]["rayClusterSpec"]
    return [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]


def manifest_docs() -> list[tuple[str, dict]]:
    return [
        (f"{p.name}:{d['kind']}/{d['metadata']['name']}", d)
        for p in MANIFESTS
        for d in yaml.safe_load_all(p.read_text())
        if d
    ]


def run_cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(list(argv))
    return code, out.getvalue(), err.getvalue()


@lru_cache(maxsize=None)
def cached_configs() -> str:
    """A Hugging Face cache with the shipped jobs' model configs, as `hf download ID config.json` leaves it."""
    return hub_cache(Path(tempfile.mkdtemp(prefix="hf-cache-")), *KNOWN_CONFIGS)["HF_HUB_CACHE"]


@lru_cache(maxsize=None)
def rendered(job: str, *extra: str) -> tuple[dict, ...]:
    from huggingface_hub import constants

    with mock.patch.object(constants, "HF_HUB_CACHE", cached_configs()):  # where the hub client looks
        code, out, err = run_cli("k8s", job, *extra)
    assert code == 0, err
    return tuple(yaml.safe_load_all(out))


def by_kind(docs) -> dict[str, dict]:
    return {d["kind"]: d for d in docs}


def spec_of(job: Path) -> JobSpec:
    return JobSpec.model_validate(yaml.safe_load(job.read_text()))


def all_docs() -> list[tuple[str, dict]]:
    docs = manifest_docs()
    for job in JOBS:
        docs += [(f"rendered {job.name}:{d['kind']}", d) for d in rendered(str(job))]
    return docs


# ---------------------------------------------------------------- schemas
@pytest.mark.parametrize("name,doc", manifest_docs(), ids=[n for n, _ in manifest_docs()])
def test_every_manifest_validates(name, doc):
    assert validation_errors(doc) == []


@pytest.mark.parametrize("job", JOBS, ids=[j.name for j in JOBS])
def test_rendered_objects_validate_and_follow_the_job(job):
    docs = rendered(str(job))
    assert [d["kind"] for d in docs] == ["ConfigMap", "PodDisruptionBudget", "NetworkPolicy", "RayJob"]
    for doc in docs:
        assert validation_errors(doc) == []
    config_map, pdb, rayjob = (by_kind(docs)[k] for k in ("ConfigMap", "PodDisruptionBudget", "RayJob"))
    spec = spec_of(job)

    # The ConfigMap is the job file, and the head mounts it where the entrypoint reads it.
    assert JobSpec.model_validate(yaml.safe_load(config_map["data"]["job.yaml"])) == spec
    head = rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    (volume,) = [v for v in head["volumes"] if v.get("configMap")]
    assert volume["configMap"]["name"] == config_map["metadata"]["name"]
    (mount,) = [m for m in head["containers"][0]["volumeMounts"] if m["name"] == volume["name"]]
    assert rayjob["spec"]["entrypoint"] == f"python -m raytrain run {mount['mountPath']}/job.yaml"
    assert rayjob["spec"]["rayClusterSpec"]["enableInTreeAutoscaling"] is True

    # The PDB covers exactly this job's Ray pods.
    for pod in ray_pods(rayjob):
        assert pdb["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert (
        not pdb["spec"]["selector"]["matchLabels"].items()
        <= rayjob["spec"]["submitterPodTemplate"]["metadata"]["labels"].items()
    )


def matches(selector: dict, labels: dict) -> bool:
    return selector.get("matchLabels", {}).items() <= labels.items()


@pytest.mark.parametrize("job", JOBS, ids=[j.name for j in JOBS])
def test_only_the_jobs_own_pods_and_the_operator_reach_its_ray_ports(job):
    policy, rayjob = (by_kind(rendered(str(job)))[k] for k in ("NetworkPolicy", "RayJob"))
    other = by_kind(rendered(str(next(j for j in JOBS if j != job))))["RayJob"]  # another job in the namespace
    own_pods = [p["metadata"]["labels"] for p in ray_pods(rayjob)]
    submitter = rayjob["spec"]["submitterPodTemplate"]["metadata"]["labels"]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert all(matches(policy["spec"]["podSelector"], labels) for labels in own_pods)  # it guards every Ray pod
    assert not matches(policy["spec"]["podSelector"], submitter)

    def admitted(labels: dict, namespace_labels: dict, port: int) -> bool:
        for rule in policy["spec"]["ingress"]:
            ports = {p["port"] for p in rule.get("ports", [])}
            for peer in rule["from"]:
                same_namespace = "namespaceSelector" not in peer
                namespace_ok = (
                    same_namespace
                    and namespace_labels.get("kubernetes.io/metadata.name") == "raytrain"
                    or not same_namespace
                    and matches(peer["namespaceSelector"], namespace_labels)
                )
                if namespace_ok and matches(peer.get("podSelector", {}), labels) and (not ports or port in ports):
                    return True
        return False

    here = {"kubernetes.io/metadata.name": "raytrain"}
    for port in (6379, 8265, 10001, 20000):  # GCS, dashboard/job API, client, a worker port
        assert all(admitted(labels, here, port) for labels in own_pods + [submitter])
        assert not any(admitted(p["metadata"]["labels"], here, port) for p in ray_pods(other))
        assert not admitted({"app": "anything"}, here, port) and not admitted({}, {"team": "x"}, port)
    operator = {"app.kubernetes.io/name": "kuberay-operator"}
    assert admitted(operator, {"kubernetes.io/metadata.name": "kuberay-system"}, 8265)
    assert not admitted(operator, {"kubernetes.io/metadata.name": "kuberay-system"}, 6379)


def test_mlflow_needs_a_password_and_admits_only_raytrain_pods():
    docs = {d["kind"]: d for d in yaml.safe_load_all((REPO / "k8s" / "mlflow.yaml").read_text()) if d}
    (container,) = docs["Deployment"]["spec"]["template"]["spec"]["containers"]
    assert "--app-name=basic-auth" in container["args"]
    env = {e["name"]: e for e in container["env"]}
    for name in ("MLFLOW_AUTH_ADMIN_USERNAME", "MLFLOW_AUTH_ADMIN_PASSWORD", "MLFLOW_FLASK_SERVER_SECRET_KEY"):
        assert env[name]["valueFrom"]["secretKeyRef"]["name"] == "mlflow-auth"
    assert container["image"].endswith("-full")  # the image variant with mlflow[auth]
    (rule,) = docs["NetworkPolicy"]["spec"]["ingress"]
    (peer,) = rule["from"]
    assert peer == {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "raytrain"}}}
    rayjob = by_kind(rendered(str(JOBS[0])))["RayJob"]
    for template in pod_templates(rayjob):  # head, workers and submitter carry the label it admits
        assert matches(peer["podSelector"], template["metadata"]["labels"])


@pytest.mark.parametrize("job", JOBS, ids=[j.name for j in JOBS])
def test_worker_pods_are_whole_nodes_sized_from_the_job(job, assets):
    hub = spec_of(job).model.path in KNOWN_CONFIGS  # else the quickstart's local model: the demo one
    docs = by_kind(rendered(str(job), *(() if hub else ("--set", f"model.path={assets / 'model'}"))))
    spec, rayjob = JobSpec.model_validate(yaml.safe_load(docs["ConfigMap"]["data"]["job.yaml"])), docs["RayJob"]
    (group,) = rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    per, (lo, hi) = spec.scaling.workers_per_node, spec.scaling.worker_range
    assert (group["minReplicas"] * per, group["maxReplicas"] * per, group["replicas"]) == (lo, hi, group["minReplicas"])
    pod = group["template"]["spec"]
    resources = pod["containers"][0]["resources"]
    assert resources["requests"] == resources["limits"]  # Guaranteed QoS: never the first evicted
    res = resources["limits"]
    assert res.get("nvidia.com/gpu") == (str(per) if spec.scaling.use_gpu else None)
    assert float(res["cpu"]) >= per * spec.scaling.cpus_per_worker + 1  # room for Ray Data beside the workers
    gib = lambda q: float(q.removesuffix("Gi"))
    volumes = {v["name"]: v for v in pod["volumes"]}
    shm, tmp = gib(volumes["dshm"]["emptyDir"]["sizeLimit"]), gib(volumes["tmp"]["emptyDir"]["sizeLimit"])
    assert tmp == gib(res["ephemeral-storage"])  # the kubelet evicts at the volume's limit: they agree
    facts = (
        preflight.model_facts(spec)
        if not hub
        else ModelFacts(
            KNOWN_CONFIGS[spec.model.path], layout_from_config(KNOWN_CONFIGS[spec.model.path]), "config", False
        )
    )
    # What must fit, counted here independently of pod_sizing: the full copies a load holds
    # (one per rank under ddp; fsdp2 and zero3 read shards / one module at a time), a process per
    # rank, /dev/shm (memory-backed);
    # on disk the model's download and one whole checkpoint (a restart downloads it).
    model = facts.n_params * DTYPE_BYTES[spec.model.dtype] / memory.GiB
    copies = per if spec.training.strategy == "ddp" else 0
    assert gib(res["memory"]) >= copies * model + per * 3 + shm
    assert gib(res["ephemeral-storage"]) >= model + memory.checkpoint_bytes(spec, facts) / memory.GiB
    assert "memory" in group["template"]["metadata"]["annotations"]["raytrain.io/sizing"]
    if spec.scaling.use_gpu:
        assert gib(res["memory"]) < 1000, res  # an 8-GPU node's share is 1-2 TB: it must be schedulable


def test_a_model_not_readable_here_keeps_the_template_sizes_and_says_how_to_size(tmp_path):
    job = tmp_path / "unknown.yaml"
    job.write_text(
        yaml.safe_dump(
            {
                "name": "unknown",
                "model": {"path": "org/not-cached"},
                "data": {"path": "s3://b/d/"},
                "training": {"global_batch_size": 16, "micro_batch_size": 1},
                "scaling": {"num_workers": 4, "use_gpu": True},
                "checkpoint": {"storage_path": "s3://b/runs"},
                "tracking": {"uri": "http://mlflow:5000"},
            }
        )
    )
    code, out, err = run_cli("k8s", str(job))
    assert code == 0, err
    (group,) = by_kind(yaml.safe_load_all(out))["RayJob"]["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    template = k8s.load_template()["RayJob"]["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]
    limits, template_limits = (g["template"]["spec"]["containers"][0]["resources"]["limits"] for g in (group, template))
    assert (limits["memory"], limits["ephemeral-storage"]) == (
        template_limits["memory"],
        template_limits["ephemeral-storage"],
    )
    assert "hf download org/not-cached config.json" in err


def test_sizing_counts_each_workers_share_per_node():
    facts = ModelFacts(
        KNOWN_CONFIGS["Qwen/Qwen2.5-7B"], layout_from_config(KNOWN_CONFIGS["Qwen/Qwen2.5-7B"]), "config", False
    )
    base = spec_of(JOBS[-1])  # qwen full zero3, 8 workers
    one = pod_sizing.size_pods(
        base.model_copy(update={"scaling": base.scaling.model_copy(update={"workers_per_node": 1})}), facts
    )
    eight = pod_sizing.size_pods(base, facts)
    assert (one.pods, one.gpus, eight.pods, eight.gpus) == ((8, 8), 1, (1, 1), 8)
    # Each rank's process and /dev/shm share count once per rank in the pod (ZeRO-3 fills its
    # partitions one module at a time and exports one gathered tensor at a time: no full copy).
    per_rank = pod_sizing.PROCESS_GIB[True] + pod_sizing.SHM_GIB_PER_GPU_WORKER
    assert eight.memory_gib - one.memory_gib >= pod_sizing.MARGIN * 7 * per_rank - 1
    assert eight.disk_gib > one.disk_gib  # all eight ranks stage their checkpoint parts on this pod's disk


def test_an_invalid_job_renders_nothing_and_exits_2(tmp_path):
    job = tmp_path / "bad.yaml"
    job.write_text("name: bad\nmodel: {path: m}\ndata: {path: d}\nscaling: {min_workers: 4, max_workers: 2}\n")
    code, out, err = run_cli("k8s", str(job))
    assert (code, out) == (2, "")
    assert "scaling.min_workers" in err and "max_workers" in err


def test_names_become_kuberay_names():
    assert k8s.k8s_name("llama3-8b-lora") == "llama3-8b-lora"
    assert k8s.k8s_name("7B_run.final") == "rt-7b-run-final"
    long = k8s.k8s_name("a" * 30 + "_" + "b" * 30)
    assert len(long) <= 47 and re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", long)


# ---------------------------------------------------------------- invariants of every pod and object
def pods_as_deployed(doc: dict) -> list[dict]:
    """The pod specs a document makes, with the containers KubeRay adds: the autoscaler runs in
    the head pod (its securityContext from autoscalerOptions)."""
    pods = [json.loads(json.dumps(t["spec"])) for t in pod_templates(doc)]
    if doc["kind"] == "RayJob":
        options = doc["spec"]["rayClusterSpec"]["autoscalerOptions"]
        head = pods[1]  # submitter, head, workers
        head["containers"].append(
            {
                "name": "autoscaler",
                **{k: v for k, v in options.items() if k in ("securityContext", "resources", "volumeMounts")},
            }
        )
    return pods


def containers(pod: dict) -> list[dict]:
    return pod["containers"] + pod.get("initContainers", []) + pod.get("ephemeralContainers", [])


def effective(pod: dict, container: dict, key: str):
    """A container's security setting, or the pod's where the container leaves it unset."""
    return container.get("securityContext", {}).get(key, pod.get("securityContext", {}).get(key))


# The Pod Security Standards' `restricted` profile (which includes `baseline`), rule by rule as
# https://kubernetes.io/docs/concepts/security/pod-security-standards/ states them, plus
# raytrain's own read-only root filesystem. Each returns what violates it.
SAFE_SYSCTLS = {
    "kernel.shm_rmid_forced",
    "net.ipv4.ip_local_port_range",
    "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies",
    "net.ipv4.ping_group_range",
    "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time",
    "net.ipv4.tcp_fin_timeout",
    "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
}
RESTRICTED_VOLUMES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}
SELINUX_TYPES = {None, "", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}
PSS_RULES = {
    "HostProcess": lambda pod: [
        c["name"] for c in containers(pod) if (effective(pod, c, "windowsOptions") or {}).get("hostProcess")
    ],
    "Host Namespaces": lambda pod: [k for k in ("hostNetwork", "hostPID", "hostIPC") if pod.get(k)],
    "Privileged Containers": lambda pod: [
        c["name"] for c in containers(pod) if c.get("securityContext", {}).get("privileged")
    ],
    "Capabilities": lambda pod: [
        c["name"]
        for c in containers(pod)
        if "ALL" not in c.get("securityContext", {}).get("capabilities", {}).get("drop", [])
        or set(c["securityContext"]["capabilities"].get("add", [])) - {"NET_BIND_SERVICE"}
    ],
    "HostPath Volumes": lambda pod: [v["name"] for v in pod.get("volumes", []) if "hostPath" in v],
    "Host Ports": lambda pod: [c["name"] for c in containers(pod) for p in c.get("ports", []) if p.get("hostPort")],
    "AppArmor": lambda pod: [
        c["name"] for c in containers(pod) if (effective(pod, c, "appArmorProfile") or {}).get("type") == "Unconfined"
    ],
    "SELinux": lambda pod: [
        c["name"]
        for c in containers(pod)
        if (o := effective(pod, c, "seLinuxOptions") or {})
        and (o.get("type") not in SELINUX_TYPES or o.get("user") or o.get("role"))
    ],
    "/proc Mount Type": lambda pod: [
        c["name"] for c in containers(pod) if c.get("securityContext", {}).get("procMount", "Default") != "Default"
    ],
    "Seccomp": lambda pod: [
        c["name"]
        for c in containers(pod)
        if (effective(pod, c, "seccompProfile") or {}).get("type") not in ("RuntimeDefault", "Localhost")
    ],
    "Sysctls": lambda pod: [
        s["name"] for s in pod.get("securityContext", {}).get("sysctls", []) if s["name"] not in SAFE_SYSCTLS
    ],
    "Volume Types": lambda pod: [
        v["name"] for v in pod.get("volumes", []) if not set(v) - {"name"} <= RESTRICTED_VOLUMES
    ],
    "Privilege Escalation": lambda pod: [
        c["name"] for c in containers(pod) if c.get("securityContext", {}).get("allowPrivilegeEscalation") is not False
    ],
    "Running as Non-root": lambda pod: [
        c["name"] for c in containers(pod) if effective(pod, c, "runAsNonRoot") is not True
    ],
    "Running as Non-root user": lambda pod: [c["name"] for c in containers(pod) if effective(pod, c, "runAsUser") == 0],
    "raytrain: read-only root filesystem": lambda pod: [
        c["name"] for c in containers(pod) if c.get("securityContext", {}).get("readOnlyRootFilesystem") is not True
    ],
}
# One violation per rule, applied to a compliant pod: each rule above must catch its own.
VIOLATIONS = {
    "HostProcess": lambda pod: pod["containers"][0]["securityContext"].update(windowsOptions={"hostProcess": True}),
    "Host Namespaces": lambda pod: pod.update(hostPID=True),
    "Privileged Containers": lambda pod: pod["containers"][0]["securityContext"].update(privileged=True),
    "Capabilities": lambda pod: pod["containers"][0]["securityContext"]["capabilities"].update(add=["SYS_ADMIN"]),
    "HostPath Volumes": lambda pod: pod["volumes"].append({"name": "host", "hostPath": {"path": "/"}}),
    "Host Ports": lambda pod: (
        pod["containers"][0].setdefault("ports", []).append({"containerPort": 80, "hostPort": 80})
    ),
    "AppArmor": lambda pod: pod["securityContext"].update(appArmorProfile={"type": "Unconfined"}),
    "SELinux": lambda pod: pod["securityContext"].update(seLinuxOptions={"type": "spc_t"}),
    "/proc Mount Type": lambda pod: pod["containers"][0]["securityContext"].update(procMount="Unmasked"),
    "Seccomp": lambda pod: pod["containers"][0]["securityContext"].update(seccompProfile={"type": "Unconfined"}),
    "Sysctls": lambda pod: pod["securityContext"].update(sysctls=[{"name": "kernel.msgmax", "value": "1"}]),
    "Volume Types": lambda pod: pod["volumes"].append({"name": "nfs", "nfs": {"server": "x", "path": "/"}}),
    "Privilege Escalation": lambda pod: pod["containers"][0]["securityContext"].pop("allowPrivilegeEscalation"),
    "Running as Non-root": lambda pod: pod["containers"][0]["securityContext"].update(runAsNonRoot=False),
    "Running as Non-root user": lambda pod: pod["containers"][0]["securityContext"].update(runAsUser=0),
    "raytrain: read-only root filesystem": lambda pod: pod["containers"][0]["securityContext"].update(
        readOnlyRootFilesystem=False
    ),
}


@pytest.mark.parametrize("rule", PSS_RULES)
def test_every_pod_meets_the_restricted_pod_security_rule(rule):
    checked = 0
    for name, doc in all_docs():
        for pod in pods_as_deployed(doc):
            assert PSS_RULES[rule](pod) == [], (rule, name)
            checked += 1
    assert checked >= 10  # the submitter, head and workers of every job, and MLflow
    namespace = yaml.safe_load((REPO / "k8s" / "namespace.yaml").read_text())
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    compliant = pods_as_deployed(by_kind(rendered(str(JOBS[0])))["RayJob"])[2]  # a worker pod
    VIOLATIONS[rule](compliant)
    assert PSS_RULES[rule](compliant), f"rule {rule!r} missed its violation"


def test_only_the_autoscaler_holds_a_kubernetes_api_token():
    token_path = "/var/run/secrets/kubernetes.io/serviceaccount"
    for name, doc in all_docs():
        for template in pod_templates(doc):
            assert template["spec"].get("automountServiceAccountToken") is False, name
            for container in containers(template["spec"]):
                assert all(
                    m["mountPath"] != token_path and m["name"] != "autoscaler-token"
                    for m in container.get("volumeMounts", [])
                ), (name, container["name"])
        if doc["kind"] == "RayJob":
            cluster = doc["spec"]["rayClusterSpec"]
            (mount,) = cluster["autoscalerOptions"]["volumeMounts"]
            assert (mount["mountPath"], mount["readOnly"]) == (token_path, True)
            (volume,) = [
                v for v in cluster["headGroupSpec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]
            ]
            sources = [next(iter(s)) for s in volume["projected"]["sources"]]
            assert sources == [
                "serviceAccountToken",
                "configMap",
                "downwardAPI",
            ]  # token, CA, namespace: what in-cluster clients read


@pytest.mark.parametrize("name,doc", all_docs(), ids=[n for n, _ in all_docs()])
def test_pods_have_resources_and_take_secrets_from_secrets(name, doc):
    for pod in pods_as_deployed(doc):
        for container in containers(pod):
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(container["resources"][kind]), (container["name"], kind)
            writable = {m["mountPath"] for m in container.get("volumeMounts", []) if not m.get("readOnly")}
            if container["name"] != "autoscaler":  # KubeRay gives it /tmp/ray
                assert "/tmp" in writable or "/mlflow" in writable, container[
                    "name"
                ]  # read-only root: a writable place
            for env in container.get("env", []):
                if SECRETISH.search(env["name"]):  # a secret-looking variable never carries a literal
                    assert "value" not in env and "secretKeyRef" in env.get("valueFrom", {}), env
    if doc["kind"] == "RayJob":  # the signing key: required on every Ray pod, from the Secret
        for pod in ray_pods(doc):
            (key,) = [e for e in pod["spec"]["containers"][0]["env"] if e["name"] == "RAYTRAIN_CHECKPOINT_KEY"]
            assert key["valueFrom"]["secretKeyRef"] == {"name": "raytrain-secrets", "key": "RAYTRAIN_CHECKPOINT_KEY"}


@pytest.mark.parametrize("name,doc", all_docs(), ids=[n for n, _ in all_docs()])
def test_nothing_is_exposed_outside_the_cluster(name, doc):
    assert doc["kind"] not in ("Ingress", "Route", "Gateway", "HTTPRoute")
    if doc["kind"] == "Service":
        assert doc["spec"].get("type", "ClusterIP") == "ClusterIP"
        assert not doc["spec"].get("externalIPs") and not doc["spec"].get("loadBalancerIP")
    if doc["kind"] == "RayJob":
        head = doc["spec"]["rayClusterSpec"]["headGroupSpec"]
        assert head.get("serviceType") == "ClusterIP" and head.get("enableIngress") is False
    if doc["kind"] == "ConfigMap":  # the job file: pre-flight refuses secrets in it, checked again here
        for key in _flatten_keys(yaml.safe_load(doc["data"].get("job.yaml", "{}")) or {}):
            assert not SECRETISH.search(key), key


def _flatten_keys(tree, prefix=""):
    for key, value in tree.items() if isinstance(tree, dict) else ():
        yield prefix + str(key)
        yield from _flatten_keys(value, f"{prefix}{key}.")


@pytest.mark.parametrize("job", JOBS, ids=[j.name for j in JOBS])
def test_spot_workers_drain_on_termination_within_the_grace_period(job):
    # A terminating pod runs preStop (ask Ray to drain the node, then hold), and the kubelet
    # SIGKILLs it terminationGracePeriodSeconds after the start. The worker's own timer (the
    # checkpoint deadline raytrain gives it in its runtime_env) must fit between the latest
    # moment the drain notice can land and that SIGKILL, and preStop must end before it.
    from raytrain.driver import worker_env
    from raytrain.train import entry

    spec = spec_of(job)
    worker_deadline = float(worker_env.runtime_env(spec, [])["env_vars"][entry.GRACE_ENV])
    rayjob = by_kind(rendered(str(job)))["RayJob"]
    for pod in ray_pods(rayjob):
        grace = pod["spec"]["terminationGracePeriodSeconds"]
        container = pod["spec"]["containers"][0]
        env = {e["name"]: e.get("value") for e in container["env"]}
        script = container["lifecycle"]["preStop"]["exec"]["command"][-1]
        notice = re.search(
            r"timeout (\d+) ray drain-node .*--reason DRAIN_NODE_REASON_PREEMPTION .*"
            r"--deadline-remaining-seconds \"\$RAYTRAIN_DRAIN_S\"",
            script,
        )
        assert notice, script
        notice_lands_by, hold = int(notice.group(1)), float(env["RAYTRAIN_DRAIN_S"])
        assert grace - notice_lands_by >= worker_deadline  # the worker's whole deadline before SIGKILL
        assert hold >= worker_deadline  # the drain's own deadline is no shorter than the worker's
        assert notice_lands_by + hold <= grace  # preStop (drain command, then hold) ends before SIGKILL
    cluster = rayjob["spec"]["rayClusterSpec"]
    head, (workers,) = cluster["headGroupSpec"]["template"]["spec"], cluster["workerGroupSpecs"]
    # On-demand head, spot workers: node affinity terms on the capacity-type labels of EKS,
    # Karpenter and GKE, and GPU/spot taints tolerated on the workers only.
    head_terms = head["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    worker_terms = workers["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"]
    assert all(e["operator"] == "NotIn" for t in head_terms for e in t["matchExpressions"])
    assert all(
        e["operator"] == "In" and e["values"][0].lower() in ("spot", "true")
        for t in worker_terms
        for e in t["matchExpressions"]
    )
    assert "tolerations" not in head
    tolerated = {t["key"] for t in workers["template"]["spec"]["tolerations"]}
    assert ("nvidia.com/gpu" in tolerated) == spec.scaling.use_gpu
    # A failed attempt is retried on a new cluster; it resumes only if checkpoints outlive pods.
    assert rayjob["spec"]["backoffLimit"] >= 1
    _, _, err = run_cli("k8s", str(job))
    shared = spec.checkpoint.storage_path.startswith(("s3://", "gs://", "/mnt/shared/"))
    assert ("checkpoint.storage_path" in err) == (not shared), err


def test_prestop_scripts_are_valid_shell_using_real_ray_cli_options():
    rayjob = by_kind(rendered(str(JOBS[0])))["RayJob"]
    help_text = subprocess.run([RAY, "drain-node", "--help"], capture_output=True, text=True, check=True).stdout
    for pod in ray_pods(rayjob):
        script = pod["spec"]["containers"][0]["lifecycle"]["preStop"]["exec"]["command"][-1]
        subprocess.run(["sh", "-n", "-c", script], check=True)
        for flag in set(re.findall(r"ray drain-node.*", script)[0].split()):
            if flag.startswith("--"):
                assert flag in help_text, flag
        assert "DRAIN_NODE_REASON_PREEMPTION" in help_text


def test_renderer_builds_on_the_template():
    """What the renderer does not derive from the job is the template's, unchanged."""
    template = k8s.load_template()["RayJob"]["spec"]
    rayjob = by_kind(rendered(str(JOBS[0])))["RayJob"]
    spec = rayjob["spec"]
    for key in ("entrypoint", "backoffLimit", "shutdownAfterJobFinishes", "submissionMode"):
        assert spec[key] == template[key]
    for key in ("rayVersion", "authOptions", "autoscalerOptions"):
        assert spec["rayClusterSpec"][key] == template["rayClusterSpec"][key]
    head, head_t = (s["rayClusterSpec"]["headGroupSpec"]["template"]["spec"] for s in (spec, template))
    assert head["containers"][0]["resources"] == head_t["containers"][0]["resources"]
    assert head["affinity"] == head_t["affinity"] and head["securityContext"] == head_t["securityContext"]


def test_kustomization_lists_every_base_manifest():
    kustomization = yaml.safe_load((REPO / "k8s" / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == sorted(p.name for p in MANIFESTS if p.name != k8s.TEMPLATE_NAME)
    if shutil.which("kubectl") is None:
        return  # kubectl's built-in kustomize is an extra check where it is installed
    built = subprocess.run(["kubectl", "kustomize", str(REPO / "k8s")], capture_output=True, text=True, check=True)
    docs = [d for d in yaml.safe_load_all(built.stdout) if d]
    assert {d["kind"] for d in docs} == {
        "Namespace",
        "ServiceAccount",
        "PersistentVolumeClaim",
        "Deployment",
        "Service",
        "NetworkPolicy",
    }
    for doc in docs:
        assert validation_errors(doc) == []


def test_the_validators_catch_what_a_strict_api_server_would():
    """The checks above can fail: typos, wrong types, bad quantities, duplicates, CEL rules."""
    rayjob = by_kind(rendered(str(JOBS[0])))["RayJob"]

    def errors_after(change) -> list[str]:
        doc = json.loads(json.dumps(rayjob))
        change(doc)
        return validation_errors(doc)

    workers = lambda d: d["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]
    worker_pod = lambda d: workers(d)["template"]["spec"]
    assert errors_after(lambda d: workers(d).update(minReplica=1))  # unknown field (typo)
    assert errors_after(lambda d: workers(d).update(maxReplicas="8"))  # wrong type
    assert errors_after(lambda d: worker_pod(d)["containers"][0]["resources"]["limits"].update(cpu="ten"))
    assert errors_after(lambda d: worker_pod(d)["containers"].append(dict(worker_pod(d)["containers"][0])))
    assert errors_after(lambda d: d["spec"].update(deletionStrategy={"onSuccess": {"policy": "DeleteCluster"}}))
    assert errors_after(lambda d: d["metadata"].update(lables={"a": "b"}))  # metadata is ObjectMeta, strictly
    service = next(doc for _, doc in manifest_docs() if doc["kind"] == "Service")
    assert _core_errors({**service, "spec": {**service["spec"], "typo": 1}})
