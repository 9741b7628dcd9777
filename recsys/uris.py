"""URIs and paths: validation, local-versus-remote, and credential redaction.

A base module (no Spark, no config objects): the config validates ``paths.*`` with it, the file-system
layer (:mod:`recsys.fs`) resolves through it, and every log line, MLflow tag and manifest field that
quotes a URI is cleaned by :func:`redact_uri` / :func:`redact_text` first.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Mapping
from urllib.parse import urlsplit, urlunsplit

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


_CREDENTIALS_IN_URL = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/\s@'\"]+@")
_SECRET_QUERY_VALUE = re.compile(r"(?i)((?:token|password|secret|key|sig|signature)=)[^&;\s'\"]*")


def redact_text(text: str) -> str:
    """Redact credentials in every URI inside free text (error messages, log lines).

    Client libraries quote the URL they failed to reach in their errors, credentials included;
    those messages reach the job's log, so they are cleaned as a whole, not parsed as one URI.
    """
    return _SECRET_QUERY_VALUE.sub(r"\1***", _CREDENTIALS_IN_URL.sub(r"\1***@", text))


def redact_uri(uri: str) -> str:
    """Drop user:password@ and secret-looking query values from a URI before it is logged."""
    try:
        parts = urlsplit(uri)
    except ValueError:
        return "<unparseable uri>"
    netloc = parts.netloc
    if "@" in netloc:
        netloc = "***@" + netloc.rsplit("@", 1)[1]
        uri = urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
    # Rebuilt only when credentials were cut: urlunsplit is lossy for URIs whose scheme it does not
    # know, e.g. sqlite:////abs/path came back as sqlite://abs/path.
    # Secrets also hide in path parameters, e.g. Spark Connect's sc://host:15002/;token=...
    return redact_text(uri)


def redact_values(data: Any) -> Any:
    """``data`` (JSON-like) with credentials removed from every string in it, keys included."""
    if isinstance(data, str):
        return redact_text(data)
    if isinstance(data, Mapping):
        return {redact_values(k): redact_values(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [redact_values(v) for v in data]
    return data
