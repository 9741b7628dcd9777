"""Filesystem operations on the driver, through pyarrow.fs: local paths, file://, s3:// (s3a://), gs://,
abfss://, hdfs://.

pyarrow's filesystems are a well-kept, dependency-free layer over the same stores Spark writes to,
so the driver can move, list and write small files (manifests, locks) without a SparkContext
(which Spark Connect does not have).
"""
from __future__ import annotations

import hashlib
import os
import uuid
from functools import lru_cache
from pathlib import Path

import pyarrow.fs as pafs

from recsys import storage
from recsys.uris import is_local_path, local_path, pyarrow_uri, scheme

S3_SCHEMES = frozenset({"s3", "s3a", "s3n"})


def resolve(uri: str) -> tuple[pafs.FileSystem, str]:
    """(file system, path inside it) for a local path or any URI pyarrow reaches (Hadoop's s3a:// as s3://).

    ``s3://`` paths go to the object store this process installed (``storage.s3``, :func:`recsys.storage.install`):
    the same endpoint, region, path style and credentials as Spark's S3A.
    """
    if is_local_path(uri):
        return pafs.LocalFileSystem(), str(local_path(uri))
    if scheme(uri) in S3_SCHEMES:
        return _s3(storage.installed()), pyarrow_uri(uri).split("://", 1)[1].split("?", 1)[0].rstrip("/")
    return pafs.FileSystem.from_uri(pyarrow_uri(uri))


@lru_cache(maxsize=4)
def _s3(store: storage.ObjectStore) -> pafs.FileSystem:
    return storage.s3_filesystem(store)


def is_object_store(fs: pafs.FileSystem) -> bool:
    """Stores where one PUT is atomic but there is no rename (S3, GCS, Azure Blob)."""
    return fs.type_name in ("s3", "gcs", "abfs")


def join(base: str, *parts: str) -> str:
    return "/".join([base.rstrip("/")] + [p.strip("/") for p in parts])


def exists(fs: pafs.FileSystem, path: str) -> bool:
    return fs.get_file_info(path).type != pafs.FileType.NotFound


def is_dir(fs: pafs.FileSystem, path: str) -> bool:
    return fs.get_file_info(path).type == pafs.FileType.Directory


def read_text(fs: pafs.FileSystem, path: str) -> str:
    with fs.open_input_stream(path) as f:
        return f.read().decode()


def write_text_atomic(fs: pafs.FileSystem, path: str, text: str) -> None:
    """Write under a temporary name in the same directory, then rename: readers see all or nothing.

    On object stores one PUT already is all or nothing (S3 is strongly consistent since 2020), and a
    "rename" would be a copy and a delete: the object is written once, in place. Local files are
    :func:`write_local_atomic`'s (synced before the rename).
    """
    parent = path.rsplit("/", 1)[0]
    if is_object_store(fs):
        with fs.open_output_stream(path) as f:
            f.write(text.encode())
        return
    if fs.type_name == "local":
        write_local_atomic(path, text)
        return
    tmp = f"{parent}/.{uuid.uuid4().hex}.tmp"
    fs.create_dir(parent, recursive=True)
    with fs.open_output_stream(tmp) as f:
        f.write(text.encode())
    fs.move(tmp, path)


def write_local_atomic(path: str | Path, text: str) -> None:
    """Replace a local file's content in one step: the text is written in full and synced under a hidden
    name in the same directory, then renamed over ``path``, so a reader (or a crash) sees the old content
    or the new, never a part. The directory is created if needed."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = _synced_temp(target, text)
    try:
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)   # left only when the rename failed


def create_local_exclusive(path: str | Path, text: str) -> bool:
    """Create a local file holding ``text`` unless ``path`` exists: True if this call created it.

    The file appears complete or not at all (written and synced under a hidden name, then hard-linked,
    which fails if the name exists), so of two processes racing for the name exactly one wins.
    """
    target = Path(path)
    tmp = _synced_temp(target, text)
    try:
        os.link(tmp, target)
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink()


def _synced_temp(target: Path, text: str) -> Path:
    tmp = target.parent / f".{target.name}.{uuid.uuid4().hex}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    return tmp


def delete_dir_if_exists(fs: pafs.FileSystem, path: str) -> None:
    if exists(fs, path):
        fs.delete_dir(path)


def list_dirs(fs: pafs.FileSystem, path: str) -> list[str]:
    if not is_dir(fs, path):
        return []
    infos = fs.get_file_info(pafs.FileSelector(path, recursive=False))
    return sorted(i.path for i in infos if i.type == pafs.FileType.Directory)


DIGEST_CHARS = 16


def files_digest(directory: Path) -> str:
    """Digest of a flat local directory: every regular file's name and bytes, in name order (16 hex chars).

    The one identity of a model's files: the driver ships them under it, the executors check it, and
    the remembered model resolution is bound to it, so files that changed under an unchanged version
    number are never taken for that version.
    """
    h = hashlib.sha256()
    for path in sorted(p for p in Path(directory).iterdir() if p.is_file()):
        h.update(path.name.encode() + b"\0")
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        h.update(b"\0")
    return h.hexdigest()[:DIGEST_CHARS]
