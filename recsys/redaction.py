"""Credentials kept out of every text that leaves the process: by pattern, and by value.

By pattern: ``user:password@`` after a scheme, and secret-looking query or path parameters
(``token=``, ``password=``, ``;token=`` of Spark Connect). Libraries do not always quote a URI whole,
though: pyarrow strips the scheme before it complains about a path, a JDBC driver quotes its
properties, a client echoes one header. So the secrets themselves are collected once, when the
configuration is read (:func:`collect` over the raw settings and the environment), and every text
that :func:`redact_text` cleans has each of them masked, wherever and however it appears.

Process state: the secrets collected so far (:func:`register`), one immutable set replaced whole when a
configuration is read. It is the one piece of state besides the scoring workers' model cache
(docs/architecture.md), and for the same reason: every log record, tag and error body of the process
must be cleaned, and threading a redactor through every library's logging is not possible.
"""
from __future__ import annotations

import re
import threading
from typing import Any, Iterable, Iterator, Mapping
from urllib.parse import quote, unquote, urlsplit, urlunsplit

MASK = "***"

_CREDENTIALS_IN_URL = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)([^/\s@'\"]+)@")
# parameters whose value is a secret: ?token=, &password=, ;token= (Spark Connect), &access_key=, &api_key=,
# &sig= (Azure SAS), &X-Amz-Security-Token= (presigned URLs)
_SECRET_PARAM = re.compile(r"(?i)([?&;](?:[a-z0-9.-]*[_-])?(?:token|password|passwd|pwd|secret|key|sig|signature)=)"
                           r"([^&;\s'\"]*)")

# Schemes whose user-info is a container's name (abfss://container@account.dfs.core.windows.net/...).
_CONTAINER_AT_ACCOUNT = frozenset({"abfs", "abfss", "wasb", "wasbs"})

# Environment variables that hold a credential by name, and the shape of names that usually do.
SECRET_ENV_NAMES = frozenset({
    "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "MLFLOW_TRACKING_PASSWORD",
    "MLFLOW_TRACKING_TOKEN", "DATABRICKS_TOKEN", "REDIS_PASSWORD", "AZURE_STORAGE_KEY", "AZURE_CLIENT_SECRET",
    "GOOGLE_API_KEY", "SPARK_CONNECT_AUTHENTICATE_TOKEN", "HF_TOKEN",
})
_SECRET_ENV_NAME = re.compile(r"(?i)(secret|token|password|passwd|credential|api_?key|access_?key)")

# A value shorter than this is not masked by value (masking "pw" would garble every log line); the
# patterns above still catch it where it stands in a URI.
MIN_SECRET_LENGTH = 4
# Values taken only because of an environment variable's name must be longer: such names are a guess.
MIN_GUESSED_SECRET_LENGTH = 8

_lock = threading.Lock()
_known: frozenset[str] = frozenset()
_pattern: re.Pattern[str] | None = None


def register(secrets: Iterable[str]) -> None:
    """Mask these values (and their percent-encoded and decoded spellings) in every text from now on."""
    global _known, _pattern
    spelled = set()
    for secret in secrets:
        if isinstance(secret, str) and len(secret) >= MIN_SECRET_LENGTH:
            spelled.update({secret, unquote(secret), quote(secret, safe="")})
    with _lock:
        if spelled <= _known:
            return
        _known = _known | frozenset(s for s in spelled if len(s) >= MIN_SECRET_LENGTH)
        # longest first, so that a secret containing another is masked whole
        _pattern = re.compile("|".join(re.escape(s) for s in sorted(_known, key=len, reverse=True)))


def registered() -> frozenset[str]:
    """The values masked by value (for tests and for a check at start-up)."""
    return _known


def mask_known(text: str) -> str:
    """``text`` with every registered secret replaced by ``***``."""
    pattern = _pattern
    return pattern.sub(MASK, text) if pattern is not None and text else text


def secrets_in_text(text: str) -> Iterator[str]:
    """The credentials that :func:`redact_text`'s patterns find in ``text``: a URI's password (its whole
    user-info when the user part could be a key or a token), and secret parameters' values."""
    for match in _CREDENTIALS_IN_URL.finditer(text):
        userinfo = match.group(2)
        user, sep, password = userinfo.partition(":")
        if not sep and match.group(1).lower().rstrip(":/") in _CONTAINER_AT_ACCOUNT:
            continue   # abfss://container@account...: a container's name, not a credential
        yield userinfo
        if sep:
            yield password
        # an access key id or token standing as the user part (s3://KEY:SECRET@..., https://TOKEN@host)
        if not sep or len(user) >= 12:
            yield user
    for match in _SECRET_PARAM.finditer(text):
        if match.group(2):
            yield match.group(2)


def collect(settings: Any, environ: Mapping[str, str]) -> set[str]:
    """Every secret the raw settings (any JSON-like value, before validation) and the environment hold.

    Settings: the credentials in every string (URIs' user-info, token and password parameters).
    Environment: the variables named in :data:`SECRET_ENV_NAMES`, those whose names look like a
    credential's (values of :data:`MIN_GUESSED_SECRET_LENGTH` characters or more), and credentials in
    any variable's URI (``SPARK_REMOTE``, ``MLFLOW_TRACKING_URI``, ...).
    """
    found = set()
    for text in _strings(settings):
        found.update(secrets_in_text(text))
    for name, value in environ.items():
        if not value:
            continue
        if name in SECRET_ENV_NAMES:
            found.add(value)
        elif _SECRET_ENV_NAME.search(name) and len(value) >= MIN_GUESSED_SECRET_LENGTH and not _harmless(value):
            found.add(value)
        found.update(secrets_in_text(value))
    return {s for s in found if len(s) >= MIN_SECRET_LENGTH}


def _harmless(value: str) -> bool:
    """Values a credential-looking variable may hold that are settings, not secrets (a path, a flag)."""
    return value.startswith(("/", "./", "~")) or value.lower() in ("true", "false", "none", "default")


def _strings(data: Any) -> Iterator[str]:
    if isinstance(data, str):
        yield data
    elif isinstance(data, Mapping):
        for key, value in data.items():
            yield from _strings(key)
            yield from _strings(value)
    elif isinstance(data, (list, tuple, set, frozenset)):
        for value in data:
            yield from _strings(value)


def has_credentials(uri: str) -> bool:
    """Whether a URI carries credentials of its own (user-info, or a secret parameter)."""
    return next(secrets_in_text(uri), None) is not None


def redact_text(text: str) -> str:
    """Redact credentials in free text (error messages, log lines): every URI's, and every registered secret.

    Client libraries quote the URL they failed to reach in their errors, credentials included;
    those messages reach the job's log, so they are cleaned as a whole, not parsed as one URI.
    """
    return mask_known(_SECRET_PARAM.sub(rf"\1{MASK}", _CREDENTIALS_IN_URL.sub(rf"\1{MASK}@", text)))


def redact_uri(uri: str) -> str:
    """Drop user:password@ and secret-looking query values from a URI before it is logged."""
    try:
        parts = urlsplit(uri)
    except ValueError:
        return "<unparseable uri>"
    netloc = parts.netloc
    if "@" in netloc:
        netloc = f"{MASK}@" + netloc.rsplit("@", 1)[1]
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
