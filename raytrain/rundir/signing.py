"""Signed checkpoints, job files and token stores: nothing read back from storage is
unpickled or `torch.load`ed before its bytes are proven to be the ones raytrain wrote.

The trust boundary is one secret, the signing key: `RAYTRAIN_CHECKPOINT_KEY` in the
environment (on Kubernetes, from the Secret raytrain-secrets), else `~/.raytrain/checkpoint.key`
(generated on first use, mode 0600, beside the local cluster). Whoever can write under
`checkpoint.storage_path` but does not hold the key can delete a checkpoint, never make one
that loads: DCP's `.metadata` is a pickle and DeepSpeed's files are full `torch.load`s, so
a forged file would run code on every worker of the next restart.

Every checkpoint has one signed manifest, `MANIFEST.json`: rank 0 writes it once every rank's
files are complete, listing each rank's files with their sha256 (gathered over the process
group), with an HMAC over the list, the run directory and the checkpoint's name (a valid
manifest copied into another checkpoint or run does not verify). A restore reads that one file
on each rank, whatever the world size (one manifest per rank made it N reads on each of N ranks).
Every signed document names its place so (the job file and the latest-checkpoint record their
run directory, a token store's manifest its key): one copied from another run, even of the same
job, is refused. A checkpoint verifies when its manifest is there and valid and every file in
the folder is listed in it, by exactly one rank, with its hash.
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

from raytrain.errors import JobError
from raytrain.rundir import storage

KEY_ENV = "RAYTRAIN_CHECKPOINT_KEY"
KEY_FILE = "~/.raytrain/checkpoint.key"
MANIFEST = "MANIFEST.json"  # a checkpoint's one signed manifest: every rank's files
OLD_MANIFEST_PREFIX = "MANIFEST.rank-"  # one per rank, before MANIFEST.json: such a checkpoint is refused


def key() -> bytes:
    value = os.environ.get(KEY_ENV) or _read_key_file()
    if not value:
        raise JobError(
            f"no signing key: set {KEY_ENV} (the same value on every node; on Kubernetes the Secret "
            f"raytrain-secrets) or run on the machine that trained it ({KEY_FILE})"
        )
    return value.encode()


def key_id(salt: str = "") -> str | None:
    """Which key this process would sign with: an HMAC of `salt` under the key, never a hash of the
    key itself (the value never leaves the process, and an id cannot be searched for a weak key
    offline without the salt it was made for). The driver gives its workers a fresh salt each job."""
    value = os.environ.get(KEY_ENV) or _read_key_file()
    if not value:
        return None
    return hmac.new(value.encode(), f"raytrain key id:{salt}".encode(), hashlib.sha256).hexdigest()[:16]


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
        raise JobError(
            f"refusing {what}: it is signed for {field} {doc.get(field)!r}, not {expected!r} where it was "
            "read (a signed file copied from another run or store). Nothing in it was used; delete it to "
            "write it again, or use the run it belongs to"
        )


def checkpoint_part(directory: str) -> dict[str, str]:
    """{file: sha256} of what one rank wrote into `directory`, its own part of a checkpoint."""
    folder = Path(directory)
    return {f: file_sha256(folder / f) for f in _files(folder) if f != MANIFEST}


def sign_checkpoint(directory: str, run_dir: str, name: str, parts: list[dict[str, str]] | None = None) -> None:
    """Rank 0: the signed manifest of checkpoint `name` of `run_dir`, into `directory` (its own part).
    `parts[r]` is rank r's `checkpoint_part`, gathered once every rank's files are complete
    (checkpoint.sign); None: one process wrote the whole checkpoint into `directory`."""
    parts = [checkpoint_part(directory)] if parts is None else parts
    payload = {"run_dir": place(run_dir), "checkpoint": name, "world_size": len(parts), "ranks": parts}
    Path(directory, MANIFEST).write_text(json.dumps({**payload, "hmac": mac(payload)}, indent=1))


def _refuse(where: str, what: str) -> JobError:
    return JobError(
        f"refusing checkpoint {where}: {what}. Nothing in it was loaded (a checkpoint's files can run code "
        "when read, so only files signed with this cluster's key are). If this is your checkpoint, check "
        f"that {KEY_ENV} is the key it was written with; else delete the folder to resume from the one before"
    )


def verified_manifest(uri: str, present: set[str], run_dir: str, name: str, where: str | None = None) -> dict[str, str]:
    """{file: sha256} of checkpoint folder `uri` (local or remote; `present`: the files listed there),
    from its manifest, if its HMAC holds: one read whatever the world size. Refuses a wrong run
    directory or checkpoint name, and a file listed by two ranks."""
    where, run_dir = where or uri, place(run_dir)
    if MANIFEST not in present:
        if any(f.startswith(OLD_MANIFEST_PREFIX) for f in present):
            raise JobError(
                f"refusing checkpoint {where}: it was written before raytrain signed one manifest per "
                f"checkpoint (it has {OLD_MANIFEST_PREFIX}*.json, one per rank, and no {MANIFEST}). Nothing "
                "in it was loaded. Start a new run (a new name or checkpoint.storage_path), or finish this "
                "one with the raytrain version that wrote it"
            )
        raise _refuse(where, f"it has no signed manifest ({MANIFEST})")
    try:
        manifest = json.loads(storage.read_text(storage.join(uri, MANIFEST)))
        claimed = manifest.pop("hmac")
    except (ValueError, KeyError, AttributeError, TypeError):
        raise _refuse(where, f"{MANIFEST} is not a manifest raytrain wrote") from None
    if not hmac.compare_digest(str(claimed), mac(manifest)):
        raise _refuse(where, f"{MANIFEST} has a wrong signature (written with another key, or changed)")
    if manifest.get("run_dir") != run_dir or manifest.get("checkpoint") != name:
        raise _refuse(
            where,
            f"{MANIFEST} signs checkpoint {manifest.get('checkpoint')} of run directory "
            f"{manifest.get('run_dir')}, not {name} of {run_dir}",
        )
    listed: dict[str, str] = {}
    for rank, files in enumerate(manifest["ranks"]):
        for file, digest in files.items():
            if file in listed:
                raise _refuse(
                    where, f"{file} is listed by two ranks (two ranks wrote it: one copy overwrote the other)"
                )
            listed[file] = digest
    return listed


class SignedCheckpoint:
    """A checkpoint folder (local or remote) whose manifest verifies, read file by file: a rank
    fetches only the files it needs, straight from storage into a local folder of its own,
    hashing as it copies, and a file whose sha256 is not the signed one is refused before
    anything reads it (the copy, not the storage, is what is then read: nothing can change
    between the check and the use). Restore fetches a rank's shards, not the whole folder."""

    def __init__(self, uri: str, run_dir: str, name: str, where: str | None = None):
        self.uri, self.where = uri, where or uri
        present = set(storage.tree(uri))  # one listing, then one read: the same at any world size
        self.listed = verified_manifest(uri, present, run_dir, name, self.where)
        present.discard(MANIFEST)
        unlisted, missing = sorted(present - self.listed.keys()), sorted(self.listed.keys() - present)
        if unlisted:
            raise _refuse(
                self.where, f"{unlisted[0]} is in no manifest: it was put there after the checkpoint was written"
            )
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
            storage.REQUESTS["read"] += 1
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
            raise _refuse(
                checkpoint.where, f"{file} was changed after it was written (its sha256 is not the signed one)"
            )


# --- small signed documents: the job file, the latest checkpoint, a token store's manifest ---
def sign_document(doc: dict) -> dict:
    return {**doc, "hmac": mac(doc)}


def verify_document(doc: dict, what: str) -> dict:
    """`doc` without its HMAC, if the HMAC holds; a JobError naming `what` otherwise."""
    doc = dict(doc)
    claimed = doc.pop("hmac", None)
    if claimed is None or not hmac.compare_digest(str(claimed), mac(doc)):
        raise JobError(
            f"refusing {what}: its signature is {'missing' if claimed is None else 'wrong'} (written with "
            f"another key, or changed after it was written). Check {KEY_ENV}, or delete it to write it again"
        )
    return doc
