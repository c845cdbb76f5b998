"""A small JSON record in the run directory that changes only by compare-and-swap: the lease
(lease.py) is one. Each read returns the record with its version; a write names the version it
read and fails with `Conflict` if another writer came first. Two writers can never both succeed
from the same version, which is what makes the lease's generation a fencing counter.

How each storage gives that:
- S3 (and S3-compatible stores): conditional writes. `If-None-Match: *` creates only if absent,
  `If-Match: <ETag>` replaces only the version read (HTTP 412 otherwise). The version is the ETag.
- A local or shared file system (NFS included): an exclusive `flock` on `<record>.lock` around
  read, compare and an atomic `rename` of a fully written temporary file. Linux's NFS client turns
  `flock` into an NFS byte-range lock, and the kernel drops it when its holder dies, so a crashed
  writer leaves no stale lock. A reader never sees a half-written record (rename is atomic); the
  version is a counter inside the record. Every read takes a shared lock on the record itself:
  taking a lock makes the NFS client revalidate the file's cached data, so a reader on another
  node never compares against a stale copy. An NFS mount with `nolock` or `local_lock=flock|all`
  keeps locks on one node (two nodes would both hold one): `problems` refuses it at validate.
- S3-compatible stores that accept `If-None-Match`/`If-Match` and ignore them would make every
  write win: `problems` probes the store once at validate (a create-only put on a key that exists
  must fail) and refuses one that ignores them.
- Anything else (gs://, hdfs://, abfs://): no conditional write that raytrain can use, so the
  job spec refuses such a run directory (job/sections.py: `LEASE_SCHEMES`).

A record that exists but cannot be read or parsed raises `Unreadable`: never "no record", so a
torn read or a storage hiccup cannot hand a live job's lease to another driver.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os

from raytrain.rundir import storage


class Conflict(Exception):
    """Another writer changed (or created) the record since the version this write named."""


class Unreadable(OSError):
    """The record exists but could not be read or parsed now: try again, never take it as absent."""


def load(uri: str) -> tuple[dict | None, str | None]:
    """(the record, its version), or (None, None) if there is none."""
    if uri.startswith("s3://"):
        return _S3(uri).load()
    return _Local(uri).load()


def write(uri: str, doc: dict, version: str | None) -> str:
    """Write `doc` if the record is still at `version` (None: only if there is none yet);
    returns the new version, or raises Conflict."""
    if uri.startswith("s3://"):
        return _S3(uri).write(doc, version)
    return _Local(uri).write(doc, version)


def _parse(text: str, uri: str) -> dict:
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise Unreadable(f"{uri} is not a whole JSON record ({exc})") from exc
    if not isinstance(doc, dict):
        raise Unreadable(f"{uri} is not a JSON object")
    return doc


class _Local:
    def __init__(self, uri: str):
        self.path = storage.absolute(uri.removeprefix("file://"))

    @contextlib.contextmanager
    def _locked(self):
        import fcntl

        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        fd = os.open(self.path + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    def _read(self) -> tuple[dict | None, str | None]:
        import fcntl

        try:
            with open(self.path, encoding="utf-8") as f:
                fcntl.flock(f.fileno(), fcntl.LOCK_SH)  # on NFS: the client revalidates what it reads next
                text = f.read()
        except FileNotFoundError:
            return None, None
        except OSError as exc:
            raise Unreadable(f"{self.path} could not be read: {exc}") from exc
        doc = _parse(text, self.path)
        return doc, str(doc.get("_version", 0))

    def load(self) -> tuple[dict | None, str | None]:
        return self._read()  # renames are atomic: no lock needed to read a whole record

    def write(self, doc: dict, version: str | None) -> str:
        with self._locked():
            _, now = self._read()
            if now != version:
                raise Conflict(f"{self.path} is at version {now}, not {version}")
            new = str(int(version or 0) + 1)
            storage.write_whole(self.path, json.dumps({**doc, "_version": int(new)}))
            return new


@functools.lru_cache(maxsize=4)
def _s3_client(endpoint: str | None, region: str):
    """One client a process (boto3's clients are thread-safe): the fence reads every few seconds."""
    import boto3

    return boto3.client("s3", endpoint_url=endpoint, region_name=region)


class _S3:
    def __init__(self, uri: str):
        self.uri = uri
        self.bucket, _, self.key = uri.removeprefix("s3://").partition("/")

    def _client(self):
        return _s3_client(os.environ.get("AWS_ENDPOINT_URL") or None, os.environ.get("AWS_DEFAULT_REGION", "us-east-1"))

    def load(self) -> tuple[dict | None, str | None]:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            got = self._client().get_object(Bucket=self.bucket, Key=self.key)
            text = got["Body"].read().decode()
        except ClientError as exc:
            if exc.response["Error"]["Code"] in ("NoSuchKey", "404"):
                return None, None
            raise Unreadable(f"{self.uri} could not be read: {exc}") from exc
        except (BotoCoreError, OSError) as exc:
            raise Unreadable(f"{self.uri} could not be read: {exc}") from exc
        return _parse(text, self.uri), got["ETag"]

    def delete(self) -> None:
        """Remove the key, if it can be (validate's probe; a leftover one is harmless)."""
        try:
            self._client().delete_object(Bucket=self.bucket, Key=self.key)
        except Exception:  # noqa: BLE001 - see above
            pass

    def write(self, doc: dict, version: str | None) -> str:
        from botocore.exceptions import BotoCoreError, ClientError

        condition = {"IfNoneMatch": "*"} if version is None else {"IfMatch": version}
        try:
            put = self._client().put_object(
                Bucket=self.bucket, Key=self.key, Body=json.dumps(doc).encode(), **condition
            )
        except ClientError as exc:
            if exc.response["Error"]["Code"] in ("PreconditionFailed", "ConditionalRequestConflict", "412", "409"):
                raise Conflict(f"{self.uri} changed since version {version}") from exc
            raise Unreadable(f"{self.uri} could not be written: {exc}") from exc
        except (BotoCoreError, OSError) as exc:
            raise Unreadable(f"{self.uri} could not be written: {exc}") from exc
        return put["ETag"]


# ---------------------------------------------------------------- validate: does this storage keep the swap?
NODE_LOCAL_LOCKS = ("nolock", "local_lock=flock", "local_lock=all")


def node_local_locks(path: str, mounts: str) -> str | None:
    """The NFS mount holding `path` (the text of /proc/mounts) when its locks stay on this node
    (`nolock`, `local_lock=flock` or `all`): "<mount point> (<type>, <option>)", else None."""
    best = None
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 4:
            continue
        point = fields[1].replace("\\040", " ")
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) > len(best[1])):
            best = (fields[0], point, fields[2], fields[3].split(","))
    if best is None or not best[2].startswith("nfs"):
        return None
    option = next((o for o in best[3] if o in NODE_LOCAL_LOCKS), None)
    return f"{best[1]} ({best[2]}, {option})" if option else None


def problems(run_dir: str) -> str | None:
    """validate, once: why the run directory's storage cannot keep the lease's compare-and-swap,
    or None. S3: a create-only put on a key that exists, and a put naming a version that is not
    the key's, must both fail (a store that ignores the conditions lets two drivers both win). A
    file system: not an NFS mount whose locks stay on one node."""
    import uuid

    if not run_dir.startswith("s3://"):
        path = storage.absolute(run_dir.removeprefix("file://"))
        try:
            with open("/proc/mounts", encoding="utf-8") as f:
                mount = node_local_locks(path, f.read())
        except OSError:  # not Linux: nothing to read
            return None
        return (
            f"it is on the NFS mount {mount}, whose locks stay on this node: two drivers on two nodes would both "
            "hold the run directory's lease. Remount without nolock / local_lock, or use an s3:// bucket"
            if mount
            else None
        )
    probe = _S3(storage.join(run_dir, f".raytrain-swap-probe-{uuid.uuid4().hex}.json"))
    try:
        probe.write({"probe": 1}, None)
        for named, what in ((None, "If-None-Match: *"), ('"not-its-etag"', "If-Match")):
            try:
                probe.write({"probe": 2}, named)
            except Conflict:
                continue
            return (
                f"this S3-compatible store ignores {what} (a conditional put that must fail succeeded): the run "
                "directory's lease would let two drivers both write it. Use a store with S3's conditional writes "
                "(AWS S3, MinIO, Ceph RGW >= 19, ...), or a shared file system"
            )
        return None
    except Unreadable as exc:
        return f"a conditional write to it failed ({exc}); the run directory's lease needs S3's conditional writes"
    finally:
        probe.delete()
