"""Signed checkpoints, job files and token stores: nothing read back from storage is
unpickled or `torch.load`ed before its bytes are proven to be the ones raytrain wrote.

The trust boundary is one secret, the signing key: `RAYTRAIN_CHECKPOINT_KEY` in the
environment (on Kubernetes, from the Secret raytrain-secrets), else `~/.raytrain/checkpoint.key`
(generated on first use, mode 0600, beside the local cluster). Whoever can write under
`checkpoint.storage_path` but does not hold the key can delete a checkpoint, never make one
that loads: DCP's `.metadata` is a pickle and DeepSpeed's files are full `torch.load`s, so
a forged file would run code on every worker of the next restart.

Every rank signs what it wrote: `MANIFEST.rank-<r>.json` lists each of its files with its
sha256 and carries an HMAC over the manifest, the run directory and the checkpoint's name (a
valid manifest copied into another checkpoint or run does not verify). Every signed document
names its place so (the job file and the latest-checkpoint record their run directory, a token
store's manifest its key): one copied from another run, even of the same job, is refused. A checkpoint verifies when
the manifests of ranks 0..N-1 are all there and valid and every file in the folder is listed
in exactly one of them with its hash.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import shutil
import tempfile
from pathlib import Path

from . import storage
from .errors import JobError

KEY_ENV = "RAYTRAIN_CHECKPOINT_KEY"
KEY_FILE = "~/.raytrain/checkpoint.key"
MANIFEST_PREFIX = "MANIFEST.rank-"


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
def place(uri: str) -> str:
    """A run directory as signed documents name it: absolute, no trailing slash."""
    return storage.absolute(uri).rstrip("/")


def require_place(doc: dict, field: str, expected: str, what: str) -> None:
    """A verified document signed for another place (a run directory, a store key) is refused."""
    if doc.get(field) != expected:
        raise JobError(f"refusing {what}: it is signed for {field} {doc.get(field)!r}, not {expected!r} where it was "
                       "read (a signed file copied from another run or store). Nothing in it was used; delete it to "
                       "write it again, or use the run it belongs to")


def sign_checkpoint(directory: str, run_dir: str, name: str, rank: int, world_size: int) -> None:
    """Rank `rank`'s manifest of the files it wrote into `directory` (its own part of checkpoint `name` of `run_dir`)."""
    folder = Path(directory)
    files = {f: file_sha256(folder / f) for f in _files(folder) if not f.startswith(MANIFEST_PREFIX)}
    payload = {"run_dir": place(run_dir), "checkpoint": name, "rank": rank, "world_size": world_size, "files": files}
    (folder / f"{MANIFEST_PREFIX}{rank:05d}.json").write_text(json.dumps({**payload, "hmac": mac(payload)}, indent=1))


def _refuse(where: str, what: str) -> JobError:
    return JobError(f"refusing checkpoint {where}: {what}. Nothing in it was loaded (a checkpoint's files can run code "
                    "when read, so only files signed with this cluster's key are). If this is your checkpoint, check "
                    f"that {KEY_ENV} is the key it was written with; else delete the folder to resume from the one before")


def verified_manifests(uri: str, run_dir: str, name: str, where: str | None = None) -> dict[str, str]:
    """{file: sha256} of checkpoint folder `uri` (local or remote), from manifests whose HMACs
    hold; refuses a missing rank, a wrong run directory or checkpoint name, and a file listed twice."""
    where, run_dir = where or uri, place(run_dir)
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
        if manifest.get("run_dir") != run_dir or manifest["checkpoint"] != name:
            raise _refuse(where, f"{manifest_name} signs checkpoint {manifest['checkpoint']} of run directory "
                                 f"{manifest.get('run_dir')}, not {name} of {run_dir}")
        world_sizes.add(manifest["world_size"])
        ranks.add(manifest["rank"])
        for file, digest in manifest["files"].items():
            if file in listed:
                raise _refuse(where, f"{file} is listed by two ranks' manifests")
            listed[file] = digest
    if len(world_sizes) != 1 or ranks != set(range(next(iter(world_sizes)))):
        raise _refuse(where, f"its manifests are ranks {sorted(ranks)} of world sizes {sorted(world_sizes)}: one is missing")
    return listed


class SignedCheckpoint:
    """A checkpoint folder (local or remote) whose manifests verify, read file by file: a rank
    fetches only the files it needs, straight from storage into a local folder of its own,
    hashing as it copies, and a file whose sha256 is not the signed one is refused before
    anything reads it (the copy, not the storage, is what is then read: nothing can change
    between the check and the use). Restore fetches a rank's shards, not the whole folder."""

    def __init__(self, uri: str, run_dir: str, name: str, where: str | None = None):
        self.uri, self.where = uri, where or uri
        self.listed = verified_manifests(uri, run_dir, name, self.where)
        present = {f for f in storage.tree(uri) if not f.startswith(MANIFEST_PREFIX)}
        unlisted, missing = sorted(present - self.listed.keys()), sorted(self.listed.keys() - present)
        if unlisted:
            raise _refuse(self.where, f"{unlisted[0]} is in no manifest: it was put there after the checkpoint was written")
        if missing:
            raise _refuse(self.where, f"{missing[0]} is missing")
        self.bytes_read = 0  # from storage, by this process (benchmarks/memory.py's M4)
        self._local: str | None = None

    @property
    def names(self) -> list[str]:
        return sorted(self.listed)

    def fetch(self, *files: str) -> str:
        """Copy `files` (verified) into this process's local folder, once each; returns the folder."""
        if self._local is None:
            self._local = tempfile.mkdtemp(prefix="raytrain-restore-")
        for file in files:
            target = Path(self._local, file)
            if target.exists():
                continue
            if file not in self.listed:
                raise _refuse(self.where, f"{file} is in no manifest")
            target.parent.mkdir(parents=True, exist_ok=True)
            fs, path = storage.filesystem(storage.join(self.uri, file))
            digest, partial = hashlib.sha256(), target.with_name(target.name + ".partial")
            with fs.open_input_stream(path) as source, open(partial, "wb") as out:
                while chunk := source.read(1 << 22):
                    digest.update(chunk)
                    out.write(chunk)
                    self.bytes_read += len(chunk)
            if digest.hexdigest() != self.listed[file]:
                partial.unlink()
                raise _refuse(self.where, f"{file} was changed after it was written (its sha256 is not the signed one)")
            partial.rename(target)
        return self._local

    def read_bytes(self, file: str) -> bytes:
        return Path(self.fetch(file), file).read_bytes()

    def close(self) -> None:
        if self._local is not None:
            shutil.rmtree(self._local, ignore_errors=True)
            self._local = None

    def __enter__(self) -> "SignedCheckpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def verify_checkpoint(directory: str, run_dir: str, name: str, where: str | None = None) -> None:
    """Every file of a local folder signed, present and unchanged; else a JobError naming the file."""
    checkpoint = SignedCheckpoint(directory, run_dir, name, where)
    for file, digest in sorted(checkpoint.listed.items()):
        if file_sha256(Path(directory, file)) != digest:
            raise _refuse(checkpoint.where, f"{file} was changed after it was written (its sha256 is not the signed one)")


def verified_read(uri: str, run_dir: str, name: str, file: str) -> bytes:
    """One small file of a checkpoint (local or remote), checked against its signed manifest
    without reading the rest (the driver reads train_state.json so)."""
    with SignedCheckpoint(uri, run_dir, name) as checkpoint:
        return checkpoint.read_bytes(file)


# --- small signed documents: the job file, the latest checkpoint, a token store's manifest ---
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
