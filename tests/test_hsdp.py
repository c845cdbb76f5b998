"""HSDP: `scaling.hsdp` makes FSDP2's mesh replicate x shard (across x within nodes). On 4 CPU
workers with workers_per_node 2 that is a 2 x 2 mesh; it must train with the flat mesh's losses,
and a checkpoint written under one mesh must resume under the other (DCP reshards).

One job, run twice: (A) HSDP for 6 steps, checkpointing at 3 and 6; (B) a copy of A's run
directory without step 6, continued to step 6 on the flat mesh. B's steps 4-6 (flat) against A's
(HSDP), both from A's step-3 state, is the parity and the resume across meshes in one: were
HSDP's gradients reduced wrongly, the two would part from step 4. The checkpoints themselves
show the mesh: DCP stores each weight as the shards of one replica, 2 under the 2 x 2 mesh and
4 under the flat one.
"""

from __future__ import annotations

import pytest
from torch.distributed.checkpoint import FileSystemReader

from conftest import make_job, metric_history, without_checkpoint
from raytrain import launcher
from raytrain.export import latest_checkpoint

pytestmark = pytest.mark.slow
REL_TOL = 1e-5  # a 2 x 2 mesh reduces in another order than a flat 4: fp32 rounding, not bit equality


def job(assets, storage, hsdp: bool, steps: int):
    return make_job(assets, storage, name="hsdp",
                    training={"finetune": "full", "max_steps": steps, "global_batch_size": 8, "micro_batch_size": 1},
                    scaling={"num_workers": 4, "workers_per_node": 2, "hsdp": hsdp},
                    checkpoint={"every_n_steps": 3, "keep_last": 3}, optimizer={"lr": 3e-3, "schedule": "constant"})


def shards_per_weight(step_dir: str) -> int:
    metadata = FileSystemReader(step_dir).read_metadata().state_dict_metadata
    return len(metadata["model.model.layers.0.mlp.up_proj.weight"].chunks)


def test_hsdp_trains_like_the_flat_mesh_and_checkpoints_reshard_between_them(ray_address, assets, tmp_path):
    hsdp = job(assets, tmp_path / "a", hsdp=True, steps=6)
    a = metric_history(hsdp, launcher.run(hsdp).run_id)
    assert sorted(a) == [1, 2, 3, 4, 5, 6] and a[6] < a[1]  # it trained
    assert shards_per_weight(latest_checkpoint(hsdp.run_dir)) == 2  # one replica's 2 shards

    # Same name: A's run directory, continued, without its step-6 folder (deleted as a user deletes a
    # refused checkpoint: Ray Train's snapshot still lists it, and raytrain drops it from there).
    with without_checkpoint(hsdp.run_dir, 6) as storage:
        flat = job(assets, storage, hsdp=False, steps=6)
        b = metric_history(flat, launcher.run(flat).run_id)  # resumes at A's step 3
        assert shards_per_weight(latest_checkpoint(flat.run_dir)) == 4

    assert sorted(b) == [1, 2, 3, 4, 5, 6]  # steps 1-3 as A's checkpoint recorded them, 4-6 trained flat
    worst = max(abs(a[s] - b[s]) / a[s] for s in (4, 5, 6))
    print(f"\n[hsdp] max relative loss difference, 2 x 2 mesh vs flat resumed across meshes: {worst:.1e}")
    assert worst <= REL_TOL
