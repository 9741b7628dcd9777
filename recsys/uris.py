"""URIs and paths: validation, local versus remote, the scheme pyarrow spells.

A base module (no Spark, no config objects): the config validates ``paths.*`` with it, the file-system
layer (:mod:`recsys.fs`) resolves through it. Redaction lives in :mod:`recsys.redaction`.
"""
from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import urlsplit


_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")


def validate_path(value: str) -> str:
    """Reject paths that cannot be what the user meant, before any data is read or written."""
    if not isinstance(value, str) or not value.strip():
        raise ValueError("path must be a non-empty string")
    if "\x00" in value or "\n" in value:
        raise ValueError(f"path {value!r} holds a control character")
    if _SCHEME.match(value):
        return value
    if ".." in Path(value).parts:
        raise ValueError(f"path {value!r} must not contain '..'; give it relative to the working directory or absolute")
    if Path(value).resolve() == Path("/"):
        raise ValueError("path must not be the filesystem root")
    return value


def is_local_path(path: str) -> bool:
    return not _SCHEME.match(path) or path.startswith("file://")


# Hadoop's names for stores that pyarrow knows under another scheme (same bucket and key layout).
_PYARROW_SCHEMES = {"s3a": "s3", "s3n": "s3"}


def scheme(uri: str) -> str:
    """The URI's scheme in lower case; "" for a plain local path."""
    return urlsplit(uri).scheme.lower() if _SCHEME.match(uri) else ""


def pyarrow_uri(uri: str) -> str:
    """The same location as pyarrow.fs spells it: Spark writes ``s3a://``, pyarrow reads ``s3://``."""
    found = scheme(uri)
    if found in _PYARROW_SCHEMES:
        return _PYARROW_SCHEMES[found] + uri[len(found):]
    return uri


def local_path(path: str) -> Path:
    """Absolute local path for a local path or file:// URI."""
    if path.startswith("file://"):
        return Path(urlsplit(path).path)
    return Path(path).resolve()
