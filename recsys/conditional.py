"""Compare-and-set on object stores: writes that succeed only if the object is absent, or unchanged.

Two small objects decide who may publish a date: its lock and its pointer (:mod:`recsys.publish.lock`,
:mod:`recsys.publish.published`). On a local disk an exclusive create (``link``) and a rename settle every
race. An object store has neither, but S3 (and MinIO, R2 and moto's server) honours conditional writes:
``PutObject`` with ``If-None-Match: *`` creates an object only while the key is absent, with
``If-Match: <etag>`` replaces it only while it still has the ETag read, and ``DeleteObject`` with
``If-Match: <etag>`` deletes it only while unchanged. Of several writers racing on one object, exactly
one such write succeeds; the others get ``412 Precondition Failed``.

pyarrow's S3 file system cannot send these headers, so these objects go through boto3
(:func:`recsys.storage.s3_client`, the same endpoint, region, path style and credentials).

Whether a store honours them is found out once per process and bucket (:func:`support`), by a probe
that writes and deletes one small object next to the object that needs it: a store that ignores the
headers would otherwise silently turn every conditional write into a plain one. A store without them
(or a process without boto3, or a store pyarrow reaches by another protocol: ``gs://``, ``abfs://``,
``hdfs://``) is named in one warning line, and its callers fall back to what they did before
(best effort). The probe's verdicts are kept for the process, as :mod:`recsys.fs` keeps its S3 file
systems: the store does not change its protocol under a running job.

Every text written through here must be unique per write (the lock's carries its token and a
counter, the pointer's its history): a write whose answer was lost is retried by the client, finds
its own earlier success as a precondition failure, and is recognised as won by reading the object back.
"""
from __future__ import annotations

import logging
import threading
import uuid
from dataclasses import dataclass
from typing import Any

from recsys import storage
from recsys.uris import is_local_path, pyarrow_uri, scheme
from recsys.redaction import redact_text, redact_uri

log = logging.getLogger(__name__)

S3_SCHEMES = frozenset({"s3", "s3a", "s3n"})
_CONFLICT_TRIES = 3   # S3 answers 409 when two conditional writes to one key overlap; the loser may retry


@dataclass(frozen=True)
class Support:
    """Whether a store honours conditional writes, and in words why not."""

    conditional_writes: bool
    conditional_delete: bool = False
    why: str = ""


@dataclass(frozen=True)
class Versioned:
    """An object's text as read, with the ETag a conditional write must name and the store's modification time."""

    text: str
    etag: str
    modified: float   # Last-Modified, seconds since the epoch (the store's clock, to the second)


class ConditionalObject:
    """One object on a store that honours conditional writes: read it, create it, replace it, delete it."""

    def __init__(self, uri: str, client: Any, bucket: str, key: str, support: Support):
        self.uri = uri
        self.bucket = bucket
        self.key = key
        self.conditional_delete = support.conditional_delete
        self._client = client

    def read(self) -> Versioned | None:
        """The object's text, ETag and modification time in one request; None when it is absent."""
        try:
            answer = self._client.get_object(Bucket=self.bucket, Key=self.key)
        except Exception as exc:
            if _code(exc) in ("NoSuchKey", "404"):
                return None
            raise _os_error(exc, f"cannot read {redact_uri(self.uri)}") from None
        body = answer["Body"].read().decode()
        return Versioned(body, answer["ETag"], answer["LastModified"].timestamp())

    def create(self, text: str) -> str | None:
        """Write ``text`` if the object is absent (``If-None-Match: *``): its ETag, or None when it exists."""
        return self._put(text, {"IfNoneMatch": "*"}, expect=None)

    def replace(self, text: str, etag: str) -> str | None:
        """Write ``text`` if the object still has ``etag`` (``If-Match``): the new ETag, or None when it changed
        or is gone."""
        return self._put(text, {"IfMatch": etag}, expect=etag)

    def delete(self, etag: str) -> bool:
        """Delete the object if it still has ``etag``; False when it changed or is gone.

        Only on stores whose probe showed a conditional delete (``conditional_delete``): elsewhere the
        header may be ignored, and the caller must not delete at all.
        """
        if not self.conditional_delete:
            raise RuntimeError(f"{redact_uri(self.uri)}: the store does not honour conditional deletes")
        try:
            self._client.delete_object(Bucket=self.bucket, Key=self.key, IfMatch=etag)
            return True
        except Exception as exc:
            if _code(exc) in ("PreconditionFailed", "412", "NoSuchKey", "404", "ConditionalRequestConflict", "409"):
                return False
            raise _os_error(exc, f"cannot delete {redact_uri(self.uri)}") from None

    def _put(self, text: str, condition: dict[str, str], expect: str | None) -> str | None:
        body = text.encode()
        for _ in range(_CONFLICT_TRIES):
            try:
                answer = self._client.put_object(Bucket=self.bucket, Key=self.key, Body=body,
                                                 ContentType="application/json", **condition)
                return answer["ETag"]
            except Exception as exc:
                code = _code(exc)
                if code not in ("PreconditionFailed", "412", "NoSuchKey", "404", "ConditionalRequestConflict", "409"):
                    raise _os_error(exc, f"cannot write {redact_uri(self.uri)}") from None
            current = self.read()
            if current is not None and current.text == text:
                return current.etag       # our own write, answered late (a retried request found it done)
            still = current is None if expect is None else (current is not None and current.etag == expect)
            if not still or code not in ("ConditionalRequestConflict", "409"):
                return None               # another writer's object is there: the precondition failed for good
        return None


def open_object(uri: str, *, probe: bool = True) -> ConditionalObject | None:
    """The object at ``uri`` for conditional writes, or None where there are none to use.

    None for local paths (exclusive create and rename serve there) and for stores that do not honour
    them (:func:`support` logged that once): callers then do what they can without. ``probe=False``:
    only if this process already knows the store honours them (a reader, which must not need to write
    the probe: readers of published nights may hold read-only credentials).
    """
    found = support(uri) if probe else _known(uri)
    if found is None or not found.conditional_writes:
        return None
    bucket, key = _bucket_key(uri)
    return ConditionalObject(uri, _client(storage.installed()), bucket, key, found)


_verdicts: dict[tuple[storage.ObjectStore, str], Support] = {}
_clients: dict[storage.ObjectStore, Any] = {}
_guard = threading.Lock()


def support(uri: str) -> Support:
    """Whether the store of ``uri`` honours conditional writes: probed once per process and bucket, and said once."""
    if is_local_path(uri):
        return Support(False, why="a local file system (exclusive create and rename serve there)")
    found = scheme(uri)
    if found not in S3_SCHEMES:
        why = f"{found}:// is reached through pyarrow, which sends no conditional writes"
        return _once(storage.ObjectStore(), f"{found}://{_bucket_key(uri)[0]}", lambda: Support(False, why=why))
    store = storage.installed()
    bucket, key = _bucket_key(uri)
    probe_at = key.rsplit("/", 1)[0] if "/" in key else ""
    return _once(store, bucket, lambda: _probe(store, bucket, probe_at))


def _known(uri: str) -> Support | None:
    if is_local_path(uri) or scheme(uri) not in S3_SCHEMES:
        return None
    with _guard:
        return _verdicts.get((storage.installed(), _bucket_key(uri)[0]))


def forget() -> None:
    """Drop what this process found out (tests that restart a store under the same name)."""
    with _guard:
        _verdicts.clear()
        _clients.clear()


def _once(store: storage.ObjectStore, bucket: str, probe) -> Support:
    with _guard:
        known = _verdicts.get((store, bucket))
        if known is None:
            known = _verdicts[(store, bucket)] = probe()
            where = bucket if "://" in bucket else f"s3://{bucket}"
            endpoint = f" at {redact_uri(store.endpoint)}" if store.endpoint and "://" not in bucket else ""
            if known.conditional_writes:
                log.info("%s%s honours conditional writes: date locks and pointers there are compare-and-set%s",
                         where, endpoint, "" if known.conditional_delete else " (no conditional delete: released "
                                                                               "locks stay as markers)")
            else:
                log.warning("%s%s: no conditional writes (%s); the date lock there is best effort: keep runs of one "
                            "date from overlapping (docs/operations.md)", where, endpoint, known.why)
        return known


def _client(store: storage.ObjectStore) -> Any:
    with _guard:
        if store not in _clients:
            _clients[store] = storage.s3_client(store)
        return _clients[store]


def _probe(store: storage.ObjectStore, bucket: str, prefix: str) -> Support:
    """Write, overwrite and delete one probe object under conditions that must fail, and see whether they do."""
    try:
        client = storage.s3_client(store)
    except ImportError:
        return Support(False, why="boto3 is not installed: pip install 'recsys[s3]'")
    members = client.meta.service_model.operation_model("PutObject").input_shape.members
    if "IfNoneMatch" not in members or "IfMatch" not in members:
        import botocore

        return Support(False, why=f"botocore {botocore.__version__} cannot send them: pip install -U 'recsys[s3]'")
    key = f"{prefix}/.conditional-writes-probe-{uuid.uuid4().hex}".lstrip("/")
    never = '"00000000000000000000000000000000"'
    try:
        try:
            client.put_object(Bucket=bucket, Key=key, Body=b"1", IfNoneMatch="*")
        except Exception as exc:
            if _refused(exc):
                return Support(False, why=f"If-None-Match refused: {_code(exc)}")
            raise _os_error(exc, f"cannot write to s3://{bucket}/{prefix}") from None
        for condition, name in (({"IfNoneMatch": "*"}, "If-None-Match"), ({"IfMatch": never}, "If-Match")):
            try:
                client.put_object(Bucket=bucket, Key=key, Body=b"2", **condition)
                return Support(False, why=f"{name} ignored: a write that had to fail succeeded")
            except Exception as exc:
                if _code(exc) not in ("PreconditionFailed", "412"):
                    if _refused(exc):
                        return Support(False, why=f"{name} refused: {_code(exc)}")
                    raise _os_error(exc, f"cannot write to s3://{bucket}/{prefix}") from None
        conditional_delete = _deletes_conditionally(client, bucket, key, never)
        return Support(True, conditional_delete)
    finally:
        try:
            client.delete_object(Bucket=bucket, Key=key)
        except Exception:
            pass


def _deletes_conditionally(client: Any, bucket: str, key: str, never: str) -> bool:
    try:
        client.delete_object(Bucket=bucket, Key=key, IfMatch=never)
    except Exception as exc:
        return _code(exc) in ("PreconditionFailed", "412")
    return False    # deleted (or silently kept) despite the wrong ETag: the header is not honoured


def _refused(exc: Exception) -> bool:
    """A store's way of saying it does not implement a header (as opposed to an outage or a permission)."""
    return _code(exc) in ("NotImplemented", "501", "InvalidArgument", "InvalidRequest", "400", "ParamValidationError")


def _code(exc: Exception) -> str:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        error, meta = response.get("Error") or {}, response.get("ResponseMetadata") or {}
        return str(error.get("Code") or meta.get("HTTPStatusCode"))
    return type(exc).__name__


def _os_error(exc: Exception, what: str) -> OSError:
    return OSError(f"{what}: {_code(exc)}: {redact_text(str(exc))}")


def _bucket_key(uri: str) -> tuple[str, str]:
    rest = pyarrow_uri(uri).split("://", 1)[1].split("?", 1)[0]
    bucket, _, key = rest.partition("/")
    return bucket.rsplit("@", 1)[-1], key.strip("/")
