"""S4 (issue #24): storage requests one rank's restore verification makes, by world size.

    python -m benchmarks.restore_reads [--ranks 4 16 512]

S4  reads one rank makes verifying a checkpoint written by 16 ranks / by 4 ranks    goal <= 1.2

A fake checkpoint per world size, each rank's part a DCP-like shard file, signed with the real
signing functions and merged as Ray merges the ranks' folders; then `SignedCheckpoint` (what
`checkpoint.restore` runs on every rank before it fetches a byte) on it, counting the requests
it makes through `raytrain.storage` (`storage.REQUESTS`). "before" is signing.py as of BEFORE
(one manifest per rank, each read and checked on every rank), loaded from git beside this
checkout's; "after" is this checkout's (one manifest, rank 0's, of every rank's files). Every
rank makes the same requests, so a restart of N ranks makes N times a rank's.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

BEFORE = "7253d34"  # the last commit with one manifest per rank


def _signing_before():
    """signing.py as of BEFORE, as module raytrain._signing_before (its `from . import storage` is this checkout's)."""
    try:
        source = subprocess.run(
            ["git", "show", f"{BEFORE}:raytrain/signing.py"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).parent,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None  # not a git checkout with that commit: the after figures alone
    spec = importlib.util.spec_from_loader("raytrain._signing_before", loader=None)
    module = importlib.util.module_from_spec(spec)
    module.__package__ = "raytrain"
    exec(compile(source, f"{BEFORE}:raytrain/signing.py", "exec"), module.__dict__)
    return module


def _checkpoint(signing, root: Path, ranks: int, run_dir: str, before: bool) -> Path:
    """A checkpoint of `ranks` ranks as a save leaves it: each rank's folder, signed, merged."""
    step = root / f"{'before' if before else 'after'}-{ranks}" / "step_00000004"
    parts = [root / f"parts-{'before' if before else 'after'}-{ranks}" / str(rank) for rank in range(ranks)]
    for rank, part in enumerate(parts):
        part.mkdir(parents=True)
        (part / f"__{rank}_0.distcp").write_bytes(os.urandom(256))  # its shards
        (part / f"__{rank}_shared0.distcp").write_bytes(os.urandom(64))  # its share of the replicated state
        if rank == 0:
            (part / ".metadata").write_bytes(os.urandom(512))
            (part / "train_state.json").write_text("{}")
        if before:
            signing.sign_checkpoint(str(part), run_dir, step.name, rank, ranks)
    if not before:  # rank 0, once the ranks' sha256s are gathered (checkpoint.sign)
        signing.sign_checkpoint(str(parts[0]), run_dir, step.name, [signing.checkpoint_part(str(p)) for p in parts])
    for part in parts:
        shutil.copytree(part, step, dirs_exist_ok=True)
    return step


def requests(signing, root: Path, ranks: int, before: bool) -> dict[str, int]:
    from raytrain.rundir import storage

    run_dir = str(root / "run")
    step = _checkpoint(signing, root, ranks, run_dir, before)
    storage.REQUESTS.clear()
    with signing.SignedCheckpoint(str(step), run_dir, step.name) as checkpoint:
        assert len(checkpoint.names) == 2 * ranks + 2
    return {"read": storage.REQUESTS["read"], "list": storage.REQUESTS["list"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, nargs="+", default=[4, 16])
    args = parser.parse_args()
    ranks = sorted({4, 16, *args.ranks})

    from raytrain.rundir import signing

    os.environ[signing.KEY_ENV] = "benchmarks/restore_reads.py: a key for this process only"
    arms = {"before": _signing_before(), "after": signing}
    root = Path(tempfile.mkdtemp(prefix="raytrain-restore-reads-"))
    try:
        print(
            f"S4 storage requests one rank's restore verification makes (SignedCheckpoint), by the world size "
            f"N that wrote the checkpoint; before = {BEFORE}'s signing.py, after = this checkout's"
        )
        print(f"{'':6s}  {'N':>5s}  {'reads':>6s}  {'listings':>8s}  {'reads of all N ranks':>20s}")
        for arm, module in arms.items():
            if module is None:
                print(f"{arm:6s}  (git show {BEFORE}:raytrain/signing.py failed: no before figures)")
                continue
            counts = {n: requests(module, root, n, arm == "before") for n in ranks}
            for n, c in counts.items():
                print(f"{arm:6s}  {n:5d}  {c['read']:6d}  {c['list']:8d}  {n * c['read']:20,d}")
            print(
                f"{arm:6s}  S4 = reads at 16 / at 4 = {counts[16]['read']} / {counts[4]['read']} = "
                f"{counts[16]['read'] / counts[4]['read']:.2f} (goal <= 1.2)"
            )
        print(f"command: {sys.executable} -m benchmarks.restore_reads --ranks {' '.join(map(str, ranks))}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
