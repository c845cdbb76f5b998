"""Secrets reach the workers from the nodes' own environment; a worker whose node lacks one gets
it from the driver's secret relay as its train function starts, and says so (names only). No
secret value is ever in the workers' runtime_env, which Ray's dashboard and state API show.
(tests/test_deploy.py: a node that joins after the submit, on a real cluster.)"""

from __future__ import annotations

import contextlib
import io
import json
import os

from raytrain.driver import worker_env
from raytrain.rundir import signing
from raytrain.train import entry

OTHER_SECRETS = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "MLFLOW_TRACKING_USERNAME",
    "MLFLOW_TRACKING_PASSWORD",
)


def _probe(config: dict) -> dict:
    return {"HF_TOKEN": os.environ.get("HF_TOKEN"), "key_id": signing.key_id(), "config": config}


def import_hashlib_sha256_prefix() -> str:
    import hashlib

    return hashlib.sha256(os.environ[signing.KEY_ENV].encode()).hexdigest()[:16]


def _start_worker(train_func, config: dict) -> tuple[dict, str]:
    """A worker process as the train workers start (the setup hook, then the train function
    wrapped as the launcher wraps it): what it saw and what it printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        seen = entry.with_secrets(train_func)(config)
    return seen, out.getvalue()


def start_relay(**named) -> worker_env.Relay:
    """A job's control actor holding this process's secrets, as the driver's (`named`: its name and
    namespace, as `control.start_actor` gives them; without the lease, which is not the point here)."""
    import ray

    from raytrain.driver.control import JobControl

    actor = ray.remote(num_cpus=0, max_concurrency=16)(JobControl).options(**named).remote()
    return worker_env.relay_secrets(actor)


def _run_on_a_worker(runtime_env: dict, relay=None) -> tuple[dict, str]:
    import sys

    import ray

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import this test file
    task = ray.remote(num_cpus=0)(_start_worker).options(runtime_env=runtime_env)
    config = {"step": 1, **({entry.RELAY_CONFIG: relay} if relay is not None else {})}
    return ray.get(task.remote(_probe, config), timeout=120)


def test_a_worker_gets_only_what_its_node_lacks_and_no_value_is_in_the_runtime_env(
    ray_address, assets, tmp_path, monkeypatch
):
    from conftest import make_job

    for key in OTHER_SECRETS:
        monkeypatch.delenv(key, raising=False)
    # Set after the cluster started: its nodes lack it. The signing key they have (the same one).
    monkeypatch.setenv("HF_TOKEN", "hf_only_in_this_shell")
    relay = start_relay()
    spec = make_job(assets, tmp_path)
    env = worker_env.runtime_env(spec, relay.env)
    text = json.dumps(env)
    assert "hf_only_in_this_shell" not in text and os.environ[signing.KEY_ENV] not in text
    assert env["env_vars"][entry.WANTED_ENV] == f"HF_TOKEN,{signing.KEY_ENV}"
    salt, key_id = env["env_vars"][entry.KEY_ID_ENV].split(":")  # a fresh salt each job, an HMAC under the key
    assert key_id == signing.key_id(salt) != signing.key_id() and salt not in start_relay().env[entry.KEY_ID_ENV]
    assert import_hashlib_sha256_prefix() not in text  # not the unsalted hash of the key it was before

    seen, printed = _run_on_a_worker(env, relay.config)
    assert seen == {"HF_TOKEN": "hf_only_in_this_shell", "key_id": signing.key_id(), "config": {"step": 1}}
    lines = printed.splitlines()
    assert len(lines) == 1 and "lacks HF_TOKEN:" in lines[0] and "setting them on the node" in lines[0]
    assert signing.KEY_ENV not in lines[0] and "hf_only_in_this_shell" not in lines[0]  # same key id: nothing sent

    # A node with another signing key gets the driver's (compared by id, never by value).
    other = {"env_vars": {**env["env_vars"], signing.KEY_ENV: "this node's own, other key"}}
    seen, printed = _run_on_a_worker(other, relay.config)
    assert seen["key_id"] == signing.key_id() and f"lacks HF_TOKEN, {signing.KEY_ENV}:" in printed

    # The driver gone (its relay with it): one clear line, and the worker goes on without them.
    import ray

    ray.kill(relay.actor)
    seen, printed = _run_on_a_worker({"env_vars": {**env["env_vars"], "RAYTRAIN_TEST": "relay gone"}}, relay.config)
    assert seen["HF_TOKEN"] is None and "relay did not answer" in printed and "going on without them" in printed


def test_a_worker_whose_node_has_everything_asks_nothing(ray_address, assets, tmp_path, monkeypatch):
    from conftest import make_job

    for key in (*OTHER_SECRETS, "HF_TOKEN"):
        monkeypatch.delenv(key, raising=False)
    relay = start_relay()
    env = worker_env.runtime_env(make_job(assets, tmp_path), relay.env)
    seen, printed = _run_on_a_worker(env, relay.config)
    assert seen["key_id"] == signing.key_id() and printed == ""


def test_cpu_workers_run_mimalloc_unless_the_submitter_chose(assets, tmp_path, monkeypatch):
    # glibc keeps what a CPU worker's step frees (SmolLM2-135M-shaped LoRA: a 2.48 GiB peak, growing
    # every step); mimalloc reuses it (allocator.py; benchmarks/RESULTS.md). A user's own allocator
    # setting reaches the workers as set, which a `ray start` cluster's workers would not get (they
    # inherit the node's environment, not the shell's); a GPU job stays on glibc.
    from conftest import make_job

    from raytrain import allocator

    for key in [k for k in os.environ if k.startswith(("MALLOC_", "MIMALLOC_"))] + ["LD_PRELOAD", allocator.CHOICE_ENV]:
        monkeypatch.delenv(key, raising=False)

    def allocator_env(**job) -> dict:
        env = worker_env.runtime_env(make_job(assets, tmp_path, **job))["env_vars"]
        return {k: v for k, v in env.items() if k.startswith(("MALLOC_", "MIMALLOC_")) or k == "LD_PRELOAD"}

    assert allocator_env() == {"LD_PRELOAD": allocator.mimalloc_path(), "MIMALLOC_PURGE_DELAY": "-1"}
    assert os.path.isfile(allocator_env()["LD_PRELOAD"])
    assert allocator_env(scaling={"use_gpu": True}) == {}
    monkeypatch.setenv("MIMALLOC_PURGE_DELAY", "100")  # mimalloc's own settings pass as set
    assert allocator_env()["MIMALLOC_PURGE_DELAY"] == "100"
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "262144")
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "262144")
    assert allocator_env() == {
        "MALLOC_MMAP_THRESHOLD_": "262144",
        "MALLOC_TRIM_THRESHOLD_": "262144",
        "MIMALLOC_PURGE_DELAY": "100",
    }
    monkeypatch.setenv("LD_PRELOAD", "/opt/libtcmalloc.so")  # the submitter's, for CPU workers: never a GPU job's
    assert allocator_env(scaling={"use_gpu": True}) == {}
    monkeypatch.delenv("LD_PRELOAD")
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_")
    monkeypatch.setenv(allocator.CHOICE_ENV, "glibc")
    assert allocator_env() == {"MIMALLOC_PURGE_DELAY": "100"}


def test_another_job_on_the_cluster_cannot_reach_the_relay(ray_address, tmp_path, monkeypatch):
    # The secrets live in the job's control actor, which is named (`ray list actors` shows it: it is the
    # job's lock). It gives a value, the checkpoint signing key among them, only against the job's
    # capability, which only the driver's train workers hold: another job (here, a second driver
    # connected to the same cluster) asks every actor it can look up and gets nothing.
    import subprocess
    import sys

    import ray

    monkeypatch.setenv("HF_TOKEN", "hf_relayed")
    from raytrain.driver import control

    relay = start_relay(name=control.actor_name(str(tmp_path)), namespace=control.NAMESPACE)
    # its holder, with the job's capability, can; a wrong capability gets nothing
    assert ray.get(relay.actor.give.remote(["HF_TOKEN"], relay.capability), timeout=60) == {"HF_TOKEN": "hf_relayed"}
    assert ray.get(relay.actor.give.remote(["HF_TOKEN"], "guessed"), timeout=60) == {}
    other = subprocess.run(
        [
            sys.executable,
            "-c",
            f"""
import json, ray
ray.init(address={ray_address!r}, namespace="another-job", log_to_driver=False)
got = []
for actor in ray.util.list_named_actors(all_namespaces=True):  # every actor another job can look up
    try:
        named = ray.get_actor(actor["name"], namespace=actor["namespace"])
        got.append(ray.get(named.give.remote(["HF_TOKEN"], ""), timeout=30))
    except Exception as exc:  # no `give`: not a relay
        got.append(type(exc).__name__)
print(json.dumps({{"named": ray.util.list_named_actors(all_namespaces=True), "got": got}}))
""",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HF_TOKEN": ""},
    )
    assert other.returncode == 0 and other.stdout.strip(), other.stderr[-3000:]
    seen = json.loads(other.stdout.strip().splitlines()[-1])
    assert any(a["name"] == control.actor_name(str(tmp_path)) for a in seen["named"]), seen  # it did find it
    assert "hf_relayed" not in other.stdout and not any(g for g in seen["got"] if isinstance(g, dict)), seen
