"""The signing key's life outside Kubernetes: generated once beside the local cluster, private
to its user, and forwarded only to nodes that would sign with another key."""

from __future__ import annotations

import stat
from pathlib import Path

from raytrain import signing, worker_env


def test_the_key_is_generated_once_private_and_the_environment_wins(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv(signing.KEY_ENV, raising=False)
    assert signing.key_id() is None
    signing.ensure_key()
    key_file = Path(tmp_path, ".raytrain", "checkpoint.key")
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600 and stat.S_IMODE(key_file.parent.stat().st_mode) == 0o700
    first = signing.key_id()
    signing.ensure_key()  # a second driver on the same machine keeps it: its checkpoints still verify
    assert signing.key_id() == first and len(key_file.read_text()) == 64
    document = signing.sign_document({"a": 1})
    monkeypatch.setenv(signing.KEY_ENV, "the cluster's secret")
    assert signing.key_id() != first
    try:
        signing.verify_document(document, "doc")
        raise AssertionError("a document signed with another key verified")
    except signing.JobError as exc:
        assert "doc: its signature is wrong" in str(exc)
    # A node with the same key has it (nothing forwarded); a node with another key lacks it.
    assert worker_env._present([signing.KEY_ENV], signing.key_id()) == [signing.KEY_ENV]
    assert worker_env._present([signing.KEY_ENV], first) == []
