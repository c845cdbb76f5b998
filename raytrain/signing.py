"""Signed checkpoints, job files and token stores: nothing read back from storage is
unpickled or `torch.load`ed before its bytes are proven to be the ones raytrain wrote.

The trust boundary is one secret, the signing key: `RAYTRAIN_CHECKPOINT_KEY` in the
environment (on Kubernetes, from the Secret raytrain-secrets), else `~/.raytrain/checkpoint.key`
(generated on first use, mode 0600, beside the local cluster). Whoever can write under
`checkpoint.storage_path` but does not hold the key can delete a checkpoint, never make one
that loads: DCP's `.metadata` is a pickle and DeepSpeed's files are full `torch.load`s, so
a forged file would run code on every worker of the next restart.

Every rank signs what it wrote: `MANIFEST.rank-<r>.json` lists each of its files with its
sha256 and carries an HMAC over the manifest, the run and the checkpoint's name (a valid
manifest copied into another checkpoint or run does not verify). A checkpoint verifies when
the manifests of ranks 0..N-1 are all there and valid and every file in the folder is listed
in exactly one of them with its hash.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from pathlib import Path

from . import storage
from .errors import JobError

KEY_ENV = "RAYTRAIN_CHECKPOINT_KEY"
KEY_FILE = "~/.raytrain/checkpoint.key"
MANIFEST_PREFIX = "MANIFEST.rank-"
UNSIGNED = ("COMMITTED",)  # written after the commit (Ray's registration), holds no data


def key() -> bytes:
    value = os.environ.get(KEY_ENV) or _read_key_file()
    if not value:
        raise JobError(f"no signing key: set {KEY_ENV} (the same value on every node; on Kubernetes the Secret "
                       f"raytrain-secrets) or run on the machine that trained it ({KEY_FILE})")
    return value.encode()


def key_id() -> str | None:
    """Which key this process would sign with (a hash: the value never leaves the process)."""
    value = os.environ.get(KEY_ENV) or _read_key_file()
    return hashlib.sha256(value.encode()).hexdigest()[:16] if value else None


def ensure_key() -> None:
    """The driver's side: a key in the environment or the key file, generated if there is none."""
    if os.environ.get(KEY_ENV) or _read_key_file():
        return
    path = Path(KEY_FILE).expanduser()
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another driver made it first
        return
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))


def _read_key_file() -> str | None:
    path = Path(KEY_FILE).expanduser()
    return path.read_text().strip() if path.is_file() else None


def mac(payload: dict) -> str:
    return hmac.new(key(), json.dumps(payload, sort_keys=True).encode(), hashlib.sha256).hexdigest()


def file_sha256(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _files(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())


# --- checkpoints ---
def sign_checkpoint(directory: str, run: str, name: str, rank: int, world_size: int) -> None:
    """Rank `rank`'s manifest of the files it wrote into `directory` (its own part of checkpoint `name`)."""
    folder = Path(directory)
    files = {f: file_sha256(folder / f) for f in _files(folder) if not f.startswith(MANIFEST_PREFIX) and f not in UNSIGNED}
    payload = {"run": run, "checkpoint": name, "rank": rank, "world_size": world_size, "files": files}
    (folder / f"{MANIFEST_PREFIX}{rank:05d}.json").write_text(json.dumps({**payload, "hmac": mac(payload)}, indent=1))


def _refuse(where: str, what: str) -> JobError:
    return JobError(f"refusing checkpoint {where}: {what}. Nothing in it was loaded (a checkpoint's files can run code "
                    "when read, so only files signed with this cluster's key are). If this is your checkpoint, check "
                    f"that {KEY_ENV} is the key it was written with; else delete the folder to resume from the one before")


def verified_manifests(uri: str, run: str, name: str, where: str | None = None) -> dict[str, str]:
    """{file: sha256} of checkpoint folder `uri` (local or remote), from manifests whose HMACs
    hold; refuses a missing rank, a wrong run or checkpoint name, and a file listed twice."""
    where = where or uri
    names = sorted(n for n in storage.files(uri) if n.startswith(MANIFEST_PREFIX) and n.endswith(".json"))
    if not names:
        raise _refuse(where, f"it has no signed manifest ({MANIFEST_PREFIX}*.json)")
    listed: dict[str, str] = {}
    world_sizes, ranks = set(), set()
    for manifest_name in names:
        try:
            manifest = json.loads(storage.read_text(storage.join(uri, manifest_name)))
            claimed = manifest.pop("hmac")
        except (ValueError, KeyError, AttributeError):
            raise _refuse(where, f"{manifest_name} is not a manifest raytrain wrote") from None
        if not hmac.compare_digest(str(claimed), mac(manifest)):
            raise _refuse(where, f"{manifest_name} has a wrong signature (written with another key, or changed)")
        if manifest["run"] != run or manifest["checkpoint"] != name:
            raise _refuse(where, f"{manifest_name} signs checkpoint {manifest['checkpoint']} of run {manifest['run']}, "
                                 f"not {name} of {run}")
        world_sizes.add(manifest["world_size"])
        ranks.add(manifest["rank"])
        for file, digest in manifest["files"].items():
            if file in listed:
                raise _refuse(where, f"{file} is listed by two ranks' manifests")
            listed[file] = digest
    if len(world_sizes) != 1 or ranks != set(range(next(iter(world_sizes)))):
        raise _refuse(where, f"its manifests are ranks {sorted(ranks)} of world sizes {sorted(world_sizes)}: one is missing")
    return listed


def verify_checkpoint(directory: str, run: str, name: str, where: str | None = None) -> None:
    """Every file of the folder signed, present and unchanged; else a JobError naming the file."""
    where = where or directory
    listed = verified_manifests(directory, run, name, where)
    present = {f for f in _files(Path(directory)) if not f.startswith(MANIFEST_PREFIX) and f not in UNSIGNED}
    unlisted = sorted(present - listed.keys())
    if unlisted:
        raise _refuse(where, f"{unlisted[0]} is in no manifest: it was put there after the checkpoint was written")
    for file, digest in sorted(listed.items()):
        if file not in present:
            raise _refuse(where, f"{file} is missing")
        if file_sha256(Path(directory, file)) != digest:
            raise _refuse(where, f"{file} was changed after it was written (its sha256 is not the signed one)")


def verified_read(uri: str, run: str, name: str, file: str) -> bytes:
    """One small file of a checkpoint (local or remote), checked against its signed manifest
    without reading the rest (the driver reads train_state.json so)."""
    listed = verified_manifests(uri, run, name)
    data = storage.read_bytes(storage.join(uri, file))
    if file not in listed or hashlib.sha256(data).hexdigest() != listed[file]:
        raise _refuse(uri, f"{file} is not the file that was signed")
    return data


# --- small signed documents: the job file, a token store's manifest ---
def sign_document(doc: dict) -> dict:
    return {**doc, "hmac": mac(doc)}


def verify_document(doc: dict, what: str) -> dict:
    """`doc` without its HMAC, if the HMAC holds; a JobError naming `what` otherwise."""
    doc = dict(doc)
    claimed = doc.pop("hmac", None)
    if claimed is None or not hmac.compare_digest(str(claimed), mac(doc)):
        raise JobError(f"refusing {what}: its signature is {'missing' if claimed is None else 'wrong'} (written with "
                       f"another key, or changed after it was written). Check {KEY_ENV}, or delete it to write it again")
    return doc
