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
  version is a counter inside the record.
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
        try:
            with open(self.path, encoding="utf-8") as f:
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
