"""Putting a complete directory in place of another, as close to one step as each store allows.

Readers of ``recommendations/dt=D/`` must see the old partition or the new one, never a mix and
never neither. What a store can promise differs, so the method is chosen per store and recorded
in the manifest:

``exchange`` (local filesystem on Linux)
    ``renameat2(RENAME_EXCHANGE)`` swaps the staged and the published directory in one system
    call: at every instant the name ``dt=D`` points at a complete partition. The old partition
    ends up at the staging path (under ``_staging/``, which readers skip) and is deleted there.
    A first publish uses ``renameat2(RENAME_NOREPLACE)``. Needs glibc >= 2.28 and a filesystem
    that supports the flags (ext4, xfs, btrfs, tmpfs, overlayfs do; NFS does not).
``rename`` (HDFS; a local filesystem without renameat2)
    Two renames: the old partition to ``_trash/``, then staging into place. Each rename is
    atomic, but between the two the date has no partition (microseconds locally, a NameNode
    round trip on HDFS). A run killed in that gap leaves the old partition in ``_trash/``;
    :func:`recsys.publish.publisher.recover` puts it back before the next run does anything.
``copy`` (object stores: s3, gs, abfs)
    There is no directory rename: the old partition's objects are deleted, the new data objects
    copied in, and ``_manifest.json`` then ``_SUCCESS`` written last. The partition is complete
    exactly when ``_SUCCESS`` is present, so consumers on object stores must wait for it (most
    loaders do); a run killed midway leaves a partition without ``_SUCCESS`` that the next run
    replaces. This is not atomic for readers that ignore ``_SUCCESS``; only a table format or a
    metastore partition-location swap gives that on object stores, and the job provides neither.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import sys
from functools import lru_cache
from typing import Literal
from urllib.parse import urlsplit

from recsys.uris import is_local_path

Method = Literal["exchange", "rename", "copy"]

OBJECT_STORE_SCHEMES = frozenset({"s3", "s3a", "s3n", "gs", "gcs", "abfs", "abfss", "wasb", "wasbs", "oss", "cos"})

_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2


def method_for(uri: str) -> Method:
    """How a partition under ``uri`` is replaced (see the module docstring)."""
    if is_local_path(uri):
        return "exchange" if _renameat2() is not None else "rename"
    scheme = urlsplit(uri).scheme.lower()
    return "copy" if scheme in OBJECT_STORE_SCHEMES else "rename"


def exchange(a: str, b: str) -> None:
    """Atomically swap two existing local directories (``renameat2(RENAME_EXCHANGE)``)."""
    _call_renameat2(a, b, _RENAME_EXCHANGE)


def rename_noreplace(src: str, dst: str) -> None:
    """Rename a local directory, failing with FileExistsError instead of replacing ``dst``."""
    _call_renameat2(src, dst, _RENAME_NOREPLACE)


def exchange_supported(directory: str) -> bool:
    """Whether the filesystem holding ``directory`` (which must exist) supports the swap.

    Probed with two empty directories, because support depends on the filesystem, not the kernel.
    """
    if _renameat2() is None:
        return False
    import tempfile

    probe = tempfile.mkdtemp(prefix=".swap-probe-", dir=directory)
    try:
        os.mkdir(os.path.join(probe, "a"))
        os.mkdir(os.path.join(probe, "b"))
        exchange(os.path.join(probe, "a"), os.path.join(probe, "b"))
        return True
    except OSError:
        return False
    finally:
        for name in ("a", "b"):
            try:
                os.rmdir(os.path.join(probe, name))
            except OSError:
                pass
        os.rmdir(probe)


def _call_renameat2(src: str, dst: str, flags: int) -> None:
    fn = _renameat2()
    if fn is None:
        raise OSError(errno.ENOSYS, "renameat2 is not available on this platform", src)
    if fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), src, None, dst)


@lru_cache(maxsize=1)
def _renameat2():
    """glibc's renameat2 (2.28+), or None where it does not exist (macOS, musl before 1.2.4, old glibc)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn
