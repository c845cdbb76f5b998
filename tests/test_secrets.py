"""Secrets reach the workers from the nodes' own environment; one set only in the submitting
shell is forwarded (and said), since a forwarded value is readable in Ray's dashboard."""

from __future__ import annotations

from raytrain.worker_env import lacking, runtime_env, secrets_the_cluster_lacks


def test_only_secrets_some_node_lacks_are_forwarded():
    nodes = [["HF_TOKEN", "AWS_ACCESS_KEY_ID"], ["HF_TOKEN"]]
    assert lacking(["HF_TOKEN", "AWS_ACCESS_KEY_ID", "MLFLOW_TRACKING_PASSWORD"], nodes) == \
        ["AWS_ACCESS_KEY_ID", "MLFLOW_TRACKING_PASSWORD"]


def test_a_secret_the_cluster_lacks_is_forwarded_and_one_it_has_is_not(ray_address, assets, tmp_path, monkeypatch):
    from conftest import make_job

    for key in ("HF_TOKEN", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        monkeypatch.delenv(key, raising=False)
    assert secrets_the_cluster_lacks() == []
    monkeypatch.setenv("HF_TOKEN", "hf_only_in_this_shell")  # set after the cluster started: its nodes lack it
    forward = secrets_the_cluster_lacks()
    assert forward == ["HF_TOKEN"]
    env = runtime_env(make_job(assets, tmp_path), forward)["env_vars"]
    assert env["HF_TOKEN"] == "hf_only_in_this_shell"
    assert "HF_TOKEN" not in runtime_env(make_job(assets, tmp_path), [])["env_vars"]
