"""model.revision: the driver pins a hub model to one commit for the job's whole life, so a
push to the hub mid-run cannot change the base a restart (or the export) loads. The hub is a
real Hugging Face cache on disk, read offline, as the hub client lays it out."""

from __future__ import annotations

import shutil

import pytest
import torch
from conftest import make_job

A, B = "a" * 40, "b" * 40


@pytest.fixture
def hub(tmp_path, assets, monkeypatch):
    """org/tiny with two commits: A (the demo model) and B (the same model, weights moved);
    refs/main points at A."""
    import huggingface_hub.constants as constants
    from transformers import AutoModelForCausalLM

    repo = tmp_path / "hub" / "models--org--tiny"
    shutil.copytree(assets / "model", repo / "snapshots" / A)
    model = AutoModelForCausalLM.from_pretrained(str(assets / "model"))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    model.save_pretrained(str(repo / "snapshots" / B))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(A)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return repo


def first_weight(model) -> torch.Tensor:
    return next(p for n, p in model.named_parameters() if n.endswith("q_proj.weight")).detach()


def test_a_hub_push_mid_run_does_not_change_the_base_a_restart_loads(hub, assets, tmp_path):
    from raytrain.driver.launcher import pin_model
    from raytrain.model import modeling

    spec = make_job(
        assets, tmp_path, model={"path": "org/tiny", "tokenizer": str(assets / "model")}, training={"finetune": "full"}
    )
    pinned = pin_model(spec, None, None)
    assert pinned.model.revision == A
    at_start = first_weight(modeling.load_model(pinned))
    (hub / "refs" / "main").write_text(B)  # the hub moves on while the job runs
    assert torch.equal(first_weight(modeling.load_model(pinned)), at_start)  # a restart loads the same base
    assert torch.equal(first_weight(modeling.load_model(spec)), at_start + 1)  # unpinned, it would have moved


def test_a_resume_keeps_the_commit_its_checkpoint_was_trained_on(hub, assets, tmp_path):
    from raytrain.driver.launcher import pin_model
    from raytrain.errors import JobError
    from raytrain.rundir.checkpoints import TrainState

    spec = make_job(assets, tmp_path, model={"path": "org/tiny", "tokenizer": str(assets / "model")})
    (hub / "refs" / "main").write_text(B)  # resubmitted after the hub moved on
    saved = TrainState(step=4, model_commit=A)
    assert pin_model(spec, saved, "step_00000004").model.revision == A
    assert TrainState.from_json(saved.to_json()).model_commit == A  # the checkpoint keeps it
    with pytest.raises(JobError, match=f"model.revision {B} differs from commit {A} that step_00000004 was trained on"):
        pin_model(make_job(assets, tmp_path, model={"path": "org/tiny", "revision": B}), saved, "step_00000004")


def test_an_unknown_revision_is_one_message_naming_the_fields(hub, assets, tmp_path):
    from raytrain.driver.launcher import pin_model
    from raytrain.errors import JobError

    spec = make_job(assets, tmp_path, model={"path": "org/tiny", "revision": "v2"})
    with pytest.raises(JobError, match=r"model.path 'org/tiny' at model.revision 'v2': cannot resolve it to a commit"):
        pin_model(spec, None, None)
