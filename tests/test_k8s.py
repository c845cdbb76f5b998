"""k8s/: every manifest, and the RayJob rendered for every jobs/*.yaml, validated against the
real KubeRay CRD schemas (../shared/schemas/kuberay, unknown fields are errors as with
`kubectl apply --validate=strict`) and Kubernetes' own schemas (kubernetes-validate, strict);
then the deployment's invariants: replica range = the job's worker range, grace periods and
preStop drains, a PodDisruptionBudget, non-root, resources, nothing public, no secrets."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from conftest import REPO
from raytrain import cli, k8s
from raytrain.config import JobSpec

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
    if "properties" in out and "additionalProperties" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
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
            errors.append(f"{doc['kind']} {doc['metadata'].get('name')} (k8s {version}) at "
                          f"{'.'.join(map(str, exc.path))}: {exc.message}")
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
        return ([doc["spec"]["submitterPodTemplate"], cluster["headGroupSpec"]["template"]]
                + [g["template"] for g in cluster["workerGroupSpecs"]])
    if doc["kind"] in ("Deployment", "StatefulSet", "Job"):
        return [doc["spec"]["template"]]
    return []


def ray_pods(rayjob: dict) -> list[dict]:
    cluster = rayjob["spec"]["rayClusterSpec"]
    return [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]


def manifest_docs() -> list[tuple[str, dict]]:
    return [(f"{p.name}:{d['kind']}/{d['metadata']['name']}", d)
            for p in MANIFESTS for d in yaml.safe_load_all(p.read_text()) if d]


def run_cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(list(argv))
    return code, out.getvalue(), err.getvalue()


@lru_cache(maxsize=None)
def rendered(job: str, *extra: str) -> tuple[dict, ...]:
    code, out, err = run_cli("k8s", job, *extra)
    assert code == 0, err
    return tuple(yaml.safe_load_all(out))


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
    config_map, pdb, rayjob = rendered(str(job))
    for doc in (config_map, pdb, rayjob):
        assert validation_errors(doc) == []
    spec = spec_of(job)

    # The ConfigMap is the job file, and the head mounts it where the entrypoint reads it.
    assert JobSpec.model_validate(yaml.safe_load(config_map["data"]["job.yaml"])) == spec
    head = rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    (volume,) = [v for v in head["volumes"] if v.get("configMap")]
    assert volume["configMap"]["name"] == config_map["metadata"]["name"]
    (mount,) = [m for m in head["containers"][0]["volumeMounts"] if m["name"] == volume["name"]]
    assert rayjob["spec"]["entrypoint"] == f"python -m raytrain run {mount['mountPath']}/job.yaml"

    # One worker group whose replica range is the job's worker range, with one GPU per pod.
    (group,) = rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    lo, hi = spec.scaling.worker_range
    assert (group["minReplicas"], group["maxReplicas"], group["replicas"]) == (lo, hi, lo)
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits.get("nvidia.com/gpu") == ("1" if spec.scaling.use_gpu else None)
    assert float(limits["cpu"]) >= spec.scaling.cpus_per_worker + 1  # room for Ray Data beside the worker
    assert rayjob["spec"]["rayClusterSpec"]["enableInTreeAutoscaling"] is True

    # The PDB covers exactly this job's Ray pods.
    for pod in ray_pods(rayjob):
        assert pdb["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert not pdb["spec"]["selector"]["matchLabels"].items() <= \
        rayjob["spec"]["submitterPodTemplate"]["metadata"]["labels"].items()


def test_an_elastic_job_gets_its_range_and_overrides_reach_the_configmap(tmp_path):
    job = tmp_path / "elastic.yaml"
    job.write_text(yaml.safe_dump({
        "name": "Elastic_Job.v2", "model": {"path": "org/model"}, "data": {"path": "s3://b/d/"},
        "training": {"global_batch_size": 48, "micro_batch_size": 1},
        "scaling": {"min_workers": 2, "max_workers": 4, "use_gpu": True, "cpus_per_worker": 6},
        "checkpoint": {"storage_path": "/mnt/shared/runs"}, "tracking": {"uri": "http://mlflow:5000"}}))
    code, out, err = run_cli("k8s", str(job), "--set", "scaling.max_workers=3", "--image", "reg/rt:1", "--namespace", "ml")
    assert code == 0, err
    config_map, pdb, rayjob = yaml.safe_load_all(out)
    for doc in (config_map, pdb, rayjob):
        assert validation_errors(doc) == []
        assert doc["metadata"]["namespace"] == "ml"
    assert rayjob["metadata"]["name"] == "elastic-job-v2"  # a DNS-1035 label KubeRay accepts
    (group,) = rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    assert (group["minReplicas"], group["maxReplicas"]) == (2, 3)
    assert yaml.safe_load(config_map["data"]["job.yaml"])["scaling"]["max_workers"] == 3
    images = {c["image"] for t in pod_templates(rayjob) for c in t["spec"]["containers"]}
    assert images == {"reg/rt:1"}
    # A path under /mnt/shared puts the shared PVC on every Ray pod, mounted there.
    for pod in ray_pods(rayjob):
        claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod["spec"]["volumes"]
                  if "persistentVolumeClaim" in v}
        mounts = {m["name"]: m["mountPath"] for m in pod["spec"]["containers"][0]["volumeMounts"]}
        assert {mounts[n] for n, c in claims.items() if c == "raytrain-shared"} == {"/mnt/shared"}
    assert "is local to a pod" not in err


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
@pytest.mark.parametrize("name,doc", all_docs(), ids=[n for n, _ in all_docs()])
def test_pods_run_non_root_with_resources_and_secrets_from_the_environment(name, doc):
    templates = pod_templates(doc)
    if doc["kind"] in ("RayJob",):
        templates = templates + [{"spec": {"securityContext": {}, "containers": [
            {"name": "autoscaler", **doc["spec"]["rayClusterSpec"]["autoscalerOptions"]}]}}]
    for template in templates:
        pod = template["spec"]
        assert not pod.get("hostNetwork") and not pod.get("hostPID") and not pod.get("hostIPC")
        for container in pod["containers"] + pod.get("initContainers", []):
            security = {**pod.get("securityContext", {}), **container.get("securityContext", {})}
            assert security.get("runAsNonRoot") is True and security.get("runAsUser", 1000) != 0, container["name"]
            assert security.get("allowPrivilegeEscalation") is False and not security.get("privileged")
            assert security.get("capabilities", {}).get("drop") == ["ALL"]
            assert security.get("seccompProfile", {}).get("type") == "RuntimeDefault"
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(container["resources"][kind]), (container["name"], kind)
            for port in container.get("ports", []):
                assert "hostPort" not in port
            for env in container.get("env", []):
                if SECRETISH.search(env["name"]):  # a secret-looking variable never carries a literal
                    assert "value" not in env and "secretKeyRef" in env.get("valueFrom", {}), env


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
    for key, value in (tree.items() if isinstance(tree, dict) else ()):
        yield prefix + str(key)
        yield from _flatten_keys(value, f"{prefix}{key}.")


@pytest.mark.parametrize("job", JOBS, ids=[j.name for j in JOBS])
def test_spot_workers_drain_on_termination_within_the_grace_period(job):
    # A terminating pod runs preStop (ask Ray to drain the node, then hold), and the kubelet
    # SIGKILLs it terminationGracePeriodSeconds after the start. The worker's own timer (the
    # checkpoint deadline raytrain gives it in its runtime_env) must fit between the latest
    # moment the drain notice can land and that SIGKILL, and preStop must end before it.
    from raytrain import launcher, preemption

    spec = spec_of(job)
    worker_deadline = float(launcher.runtime_env(spec, [])["env_vars"][preemption.GRACE_ENV])
    _, _, rayjob = rendered(str(job))
    for pod in ray_pods(rayjob):
        grace = pod["spec"]["terminationGracePeriodSeconds"]
        container = pod["spec"]["containers"][0]
        env = {e["name"]: e.get("value") for e in container["env"]}
        script = container["lifecycle"]["preStop"]["exec"]["command"][-1]
        notice = re.search(r"timeout (\d+) ray drain-node .*--reason DRAIN_NODE_REASON_PREEMPTION .*"
                           r"--deadline-remaining-seconds \"\$RAYTRAIN_DRAIN_S\"", script)
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
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert all(e["operator"] == "NotIn" for t in head_terms for e in t["matchExpressions"])
    assert all(e["operator"] == "In" and e["values"][0].lower() in ("spot", "true")
               for t in worker_terms for e in t["matchExpressions"])
    assert "tolerations" not in head
    tolerated = {t["key"] for t in workers["template"]["spec"]["tolerations"]}
    assert ("nvidia.com/gpu" in tolerated) == spec.scaling.use_gpu
    # A failed attempt is retried on a new cluster; it resumes only if checkpoints outlive pods.
    assert rayjob["spec"]["backoffLimit"] >= 1
    _, _, err = run_cli("k8s", str(job))
    shared = spec.checkpoint.storage_path.startswith(("s3://", "gs://", "/mnt/shared/"))
    assert ("checkpoint.storage_path" in err) == (not shared), err


def test_prestop_scripts_are_valid_shell_using_real_ray_cli_options():
    _, _, rayjob = rendered(str(JOBS[0]))
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
    _, _, rayjob = rendered(str(JOBS[0]))
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
    assert {d["kind"] for d in docs} == {"Namespace", "ServiceAccount", "PersistentVolumeClaim", "Deployment",
                                         "Service", "NetworkPolicy"}
    for doc in docs:
        assert validation_errors(doc) == []


def test_the_validators_catch_what_a_strict_api_server_would():
    """The checks above can fail: typos, wrong types, bad quantities, duplicates, CEL rules."""
    _, _, rayjob = rendered(str(JOBS[0]))

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
