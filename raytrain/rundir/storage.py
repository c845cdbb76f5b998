"""Local paths and remote URIs (s3://, gs://, ...) through one pyarrow filesystem view.

Nothing here assumes a local disk: a run directory may live on S3 and the same code
writes, lists and uploads there.
"""

from __future__ import annotations

import os
import uuid
from collections import Counter
from pathlib import Path

import pyarrow.fs as pafs

REMOTE_SCHEMES = ("s3://", "gs://", "gcs://", "hdfs://", "abfs://", "abfss://")
# Requests this process made through this module, by kind ("read", "list", "stat"): what a
# path costs at scale is its request count (benchmarks/restore_reads.py counts a restore's).
REQUESTS: Counter[str] = Counter()


def is_remote(uri: str) -> bool:
    return uri.startswith(REMOTE_SCHEMES)


def absolute(uri: str, base: str | os.PathLike | None = None) -> str:
    """A local path made absolute (workers run in another cwd); a URI is returned as is."""
    if is_remote(uri) or uri.startswith("file://"):
        return uri
    return str((Path(base or os.getcwd()) / os.path.expanduser(uri)).resolve())


def filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    """(filesystem, path inside it). S3 endpoints come from AWS_ENDPOINT_URL like boto's."""
    if uri.startswith("s3://") and os.environ.get("AWS_ENDPOINT_URL"):
        endpoint = os.environ["AWS_ENDPOINT_URL"]
        fs = pafs.S3FileSystem(
            endpoint_override=endpoint,
            scheme="https" if endpoint.startswith("https") else "http",
            region=os.environ.get("AWS_DEFAULT_REGION", "us-east-1"),
        )
        return fs, uri[len("s3://") :]
    if not is_remote(uri):
        return pafs.LocalFileSystem(), str(Path(uri.removeprefix("file://")).resolve())
    return pafs.FileSystem.from_uri(uri)


def upload_dir(local_dir: str, uri: str) -> None:
    """Copy a local folder to a local path or URI."""
    fs, path = filesystem(uri)
    fs.create_dir(path, recursive=True)
    pafs.copy_files(local_dir, path, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=fs)


def download_dir(uri: str, local_dir: str) -> None:
    """Copy a folder at a local path or URI into a local folder."""
    fs, path = filesystem(uri)
    os.makedirs(local_dir, exist_ok=True)
    pafs.copy_files(path, local_dir, source_filesystem=fs, destination_filesystem=pafs.LocalFileSystem())


def read_text(uri: str) -> str:
    REQUESTS["read"] += 1
    fs, path = filesystem(uri)
    with fs.open_input_stream(path) as f:
        return f.read().decode()


def write_text(uri: str, text: str) -> None:
    fs, path = filesystem(uri)
    with fs.open_output_stream(path) as f:
        f.write(text.encode())


def write_whole(uri: str, text: str) -> None:
    """Write a file that a reader sees complete or not at all: an object store's put is whole or
    absent; on a file system (local, NFS) a temporary file, flushed to disk, is renamed over it."""
    if is_remote(uri):
        write_text(uri, text)
        return
    os.makedirs(os.path.dirname(uri) or ".", exist_ok=True)
    tmp = f"{uri}.{uuid.uuid4().hex}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, uri)


def read_bytes(uri: str) -> bytes:
    REQUESTS["read"] += 1
    fs, path = filesystem(uri)
    with fs.open_input_stream(path) as f:
        return f.read()


def delete(uri: str) -> None:
    """Delete one file at a local path or URI; nothing if it is not there."""
    fs, path = filesystem(uri)
    try:
        fs.delete_file(path)
    except FileNotFoundError:
        pass


def files(uri: str) -> list[str]:
    """The files directly under a local path or URI, as names."""
    REQUESTS["list"] += 1
    fs, path = filesystem(uri)
    entries = fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))
    return [e.base_name for e in entries if e.type == pafs.FileType.File]


def tree(uri: str) -> list[str]:
    """Every file under a local path or URI, as paths relative to it."""
    REQUESTS["list"] += 1
    fs, path = filesystem(uri)
    entries = fs.get_file_info(pafs.FileSelector(path, recursive=True, allow_not_found=True))
    return sorted(e.path[len(path) :].lstrip("/") for e in entries if e.type == pafs.FileType.File)


def join(uri: str, *parts: str) -> str:
    return "/".join([uri.rstrip("/"), *parts])


def subfolders(uri: str) -> list[str]:
    """The folders directly under a local path or URI, as names."""
    REQUESTS["list"] += 1
    fs, path = filesystem(uri)
    try:
        entries = fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))
    except (FileNotFoundError, NotADirectoryError):
        return []
    return [e.base_name for e in entries if e.type == pafs.FileType.Directory]


def exists(uri: str) -> bool:
    REQUESTS["stat"] += 1
    fs, path = filesystem(uri)
    return fs.get_file_info(path).type != pafs.FileType.NotFound


def probe_writable(uri: str) -> str | None:
    """Write and delete a small file under `uri`; None if that worked, else why not."""
    try:
        fs, path = filesystem(uri)
        fs.create_dir(path, recursive=True)
        probe = f"{path}/.raytrain-probe-{uuid.uuid4().hex}"
        with fs.open_output_stream(probe) as out:
            out.write(b"ok")
        fs.delete_file(probe)
        return None
    except Exception as exc:  # every filesystem error becomes a message, not a traceback
        return f"{type(exc).__name__}: {exc}".splitlines()[0]
