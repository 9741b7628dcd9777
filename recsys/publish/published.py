"""Which run of a date is published and where its files are: the one place that answers it.

Layout under ``paths.output`` (names starting with ``_`` are skipped by Spark, Hive and pyarrow readers)::

    _runs/dt=YYYY-MM-DD/run=<key>/        one run's files: part-*.parquet, _SUCCESS, _manifest.json;
                                          never changed once published (a table partition may point here)
    _runs/dt=YYYY-MM-DD/_published.json   the date's pointer: the published run, and every run published
                                          for the date before it (rollback targets, what retention keeps)
    dt=YYYY-MM-DD/                        the path view for readers of paths: the published run's files
                                          (hard links on a local disk, a copy elsewhere), _SUCCESS, _manifest.json

A date is published when its commit point names a run: with ``output.table`` the table's partition
``dt=D`` (one metastore operation, :mod:`recsys.publish.table`), without one the pointer file (one
atomic write: a rename on file systems, a single PUT on object stores). On object stores that honour
conditional writes (:mod:`recsys.conditional`) that PUT names the ETag the writer read (``If-Match``; or
``If-None-Match: *`` for a first pointer), so of two runs that read the same pointer and race to switch
it, exactly one does; the other fails with LockHeld (its lock must have been taken over: every writer
of a pointer holds the date's lock). The pointer and the path view
follow the commit point; a run killed between the steps leaves them behind it, and the next run of
the date brings them in line before anything else (:func:`recsys.publish.publisher.recover`).

Readers that need the night of a date (the guard, the export, the lookups, ``recsys rollback``) ask
:func:`find_published` or :func:`latest_published` and read ``PublishedPartition.path``: the run directory the
table or the pointer names, which never changes under them.
"""
from __future__ import annotations

import datetime as dt
import json
import logging
import re
import uuid
from dataclasses import dataclass, field
from typing import Protocol

from recsys import conditional
from recsys import fs as rfs
from recsys.data.contracts import SOURCE_MODEL, SUCCESS_MARKER, partition_name
from recsys.errors import LockHeld
from recsys.publish import manifest as manifest_file
from recsys.publish.manifest import FallbackList, Manifest

log = logging.getLogger(__name__)

RUNS_DIR = "_runs"
POINTER_NAME = "_published.json"
POINTER_FORMAT = 1
_RUN_DIR = re.compile(r"^run=(.+)$")
_DT_DIR = re.compile(r"^dt=(\d{4}-\d{2}-\d{2})$")


class TableView(Protocol):
    """What this module needs of the catalog table (:class:`recsys.publish.table.OutputTable`)."""

    def location(self, date: dt.date) -> str | None: ...

    def dates(self) -> list[dt.date]: ...


def runs_root(output_root: str, date: dt.date) -> str:
    """Where every run directory of ``date`` lives (and its pointer)."""
    return rfs.join(output_root, RUNS_DIR, partition_name(date))


def run_dir(output_root: str, date: dt.date, run: str) -> str:
    return rfs.join(runs_root(output_root, date), f"run={run}")


def view_dir(output_root: str, date: dt.date) -> str:
    """The path view ``dt=D/`` that readers of paths read."""
    return rfs.join(output_root, partition_name(date))


def new_run_key(kind: str | None = None) -> str:
    """A key of its own for one attempt at a date: ``<UTC start time>[-<kind>]-<8 random hex digits>``, e.g.
    ``20240508T021500Z-1a2b3c4d`` (a nightly run) or ``20240508T021500Z-rollback-1a2b3c4d``.

    Minted before anything is written: it names the run's directory (``run=<key>``), holds the date's lock
    and tags the MLflow run (``recsys.job_run``). The time comes first, so keys sort in the order the
    attempts started; ``kind`` says what other than a nightly run holds a date (``rollback``, ``export``).
    """
    started = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return "-".join([started, *([kind] if kind else []), uuid.uuid4().hex[:8]])


def run_of(location: str) -> str | None:
    """The run key of a run directory's path or URI (``.../run=<key>``), None for any other directory."""
    match = _RUN_DIR.match(location.rstrip("/").rsplit("/", 1)[-1])
    return match.group(1) if match else None


# ------------------------------------------------------------------------------------------------
# the pointer


@dataclass(frozen=True)
class Publication:
    run: str
    at: str
    how: str     # publish | rollback | recovered (brought in line with the table) | adopted (an old path view)


@dataclass(frozen=True)
class Pointer:
    date: dt.date
    run: str | None                               # the published run; None once the date was retired
    history: tuple[Publication, ...] = field(default_factory=tuple)   # oldest first, the current one last
    version: str | None = field(default=None, compare=False)   # the ETag read, where writes are conditional

    def published_runs(self) -> list[str]:
        """Every run ever published for the date, newest first, each once (the current one first)."""
        seen: list[str] = []
        for entry in reversed(self.history):
            if entry.run not in seen:
                seen.append(entry.run)
        if self.run and self.run in seen:
            seen.remove(self.run)
        return ([self.run] if self.run else []) + seen


def pointer_path(output_root: str, date: dt.date) -> str:
    return rfs.join(runs_root(output_root, date), POINTER_NAME)


def read_pointer(output_root: str, date: dt.date) -> Pointer | None:
    """The date's pointer, or None when there is none (never published, or published before run directories).

    Where the store honours conditional writes, the pointer carries the ETag read (``version``), which
    :func:`write_pointer` and :func:`remove_pointer` name: they then change exactly what was read. That
    is known once the date's lock was set up in this process (every writer of a pointer holds it); a
    reader that never took a lock reads through pyarrow and writes nothing, not even a probe.
    """
    uri = pointer_path(output_root, date)
    target = conditional.open_object(uri, probe=False)
    if target is not None:
        found = target.read()
        if found is None:
            return None
        text, version = found.text, found.etag
    else:
        fs, path = rfs.resolve(uri)
        if not rfs.exists(fs, path):
            return None
        text, version = rfs.read_text(fs, path), None
    try:
        data = json.loads(text)
        history = tuple(Publication(str(e["run"]), str(e.get("at", "?")), str(e.get("how", "publish")))
                        for e in data.get("history", []))
        return Pointer(date, data.get("run") or None, history, version)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise RuntimeError(f"the pointer {uri} is not readable ({exc}); restore it "
                           f"from the table (recsys rollback --date {date} --to RUN) or remove it") from None


def write_pointer(output_root: str, date: dt.date, run: str, how: str, previous: Pointer | None) -> Pointer:
    """Point the date at ``run`` in one atomic write, keeping the history; returns the new pointer.

    ``previous``: the pointer as this run read it (None: there was none). Where writes are conditional,
    the write succeeds only if the pointer is still exactly that; otherwise LockHeld, nothing written.
    """
    now = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    history = (previous.history if previous else ()) + (Publication(run, now, how),)
    text = json.dumps({"format_version": POINTER_FORMAT, "date": str(date), "run": run,
                       "location": run_dir(output_root, date, run),
                       "history": [e.__dict__ for e in history]}, indent=2)
    uri = pointer_path(output_root, date)
    target = conditional.open_object(uri)
    if target is None:
        fs, path = rfs.resolve(uri)
        rfs.write_text_atomic(fs, path, text)
        return Pointer(date, run, history)
    if previous is None:
        version = target.create(text)
    elif previous.version is not None:
        version = target.replace(text, previous.version)
    else:   # read before this process knew the store's conditional writes: nothing to compare with
        fs, path = rfs.resolve(uri)
        rfs.write_text_atomic(fs, path, text)
        return Pointer(date, run, history)
    if version is None:
        raise _moved(output_root, date, f"point it at run {run}")
    return Pointer(date, run, history, version)


def remove_pointer(output_root: str, date: dt.date, pointer: Pointer) -> None:
    """Delete the date's pointer (retiring the date), only if it is still ``pointer`` where deletes are conditional."""
    uri = pointer_path(output_root, date)
    target = conditional.open_object(uri)
    if target is not None and target.conditional_delete and pointer.version is not None:
        if not target.delete(pointer.version) and target.read() is not None:
            raise _moved(output_root, date, "remove it")
        return
    fs, path = rfs.resolve(uri)
    if rfs.exists(fs, path):
        fs.delete_file(path)


def _moved(output_root: str, date: dt.date, what: str) -> LockHeld:
    try:
        now = read_pointer(output_root, date)
        names = f"it now names run {now.run}" if now is not None else "it is gone"
    except (OSError, RuntimeError):
        names = "it cannot be read back"
    return LockHeld(f"the pointer of {partition_name(date)} changed since this run read it ({names}): another run "
                    f"of the date took its lock over; this run did not {what} ({pointer_path(output_root, date)})")


# ------------------------------------------------------------------------------------------------
# where the night of a date is


@dataclass(frozen=True)
class PublishedPartition:
    """A date's published night as its readers need it: read ``path`` (Parquet, one row per user)."""

    date: dt.date
    path: str                 # the directory holding the night's files (the run directory), spelled like paths.output
    manifest: Manifest
    source: str = "pointer"   # "table", "pointer", or "path view" (a date published before run directories)

    @property
    def location(self) -> str:
        return self.path

    @property
    def view(self) -> str:
        """The path view ``dt=D/`` holding the same files for readers of paths."""
        return view_dir(_root_of(self.path, self.date), self.date)

    @property
    def run(self) -> str:
        """The attempt that published it (``job_run``): unique per run, also when MLflow was down."""
        return run_of(self.path) or self.manifest.run

    @property
    def run_id(self) -> str | None:
        """Its MLflow run, if it was recorded."""
        return self.manifest.run_id

    @property
    def model_version(self) -> str:
        return self.manifest.model.version or ""

    @property
    def rows(self) -> int | None:
        return self.manifest.counts.rows

    @property
    def catalog_snapshot(self) -> str:
        return str(self.manifest.catalog_snapshot or "")

    @property
    def fallback(self) -> FallbackList | None:
        """The list users the model could not score got (None in manifests written before it was recorded there)."""
        return self.manifest.fallback

    @property
    def sources(self) -> list[str]:
        """The values the rows' ``source`` column can hold: ``model``, then the fallback's name."""
        fallback = (self.fallback.name if self.fallback else None) or "popularity"
        return [SOURCE_MODEL, fallback] if fallback != SOURCE_MODEL else [SOURCE_MODEL]

    def refusal(self) -> str | None:
        """Why this night must not be served (None: it may): its manifest records failed checks."""
        failed = {k: v for k, v in self.manifest.validation.items() if v}
        if failed:
            return (f"the partition for {self.date} records failed validation checks {failed} in its manifest; "
                    f"rerun `recsys recommend --date {self.date} --force` once the input is fixed")
        return None

    def files(self) -> list[str]:
        """Its data files (``part-*``), as URIs spelled like ``paths.output``, sorted: what an executor opens."""
        from recsys.data.partitions import Partition, with_files

        fs, base = rfs.resolve(self.path)
        found = with_files(fs, Partition(self.date, self.path, [])).files
        return [rfs.join(self.path, f[len(base):].lstrip("/")) for f in found]


def find_published(output_root: str, date: dt.date, table: TableView | None = None) -> PublishedPartition | None:
    """The published night of ``date``, or None when nothing complete is published for it.

    With a table, its partition decides (what readers of the table see); without one, the date's
    pointer, or for a date published before run directories existed, its complete path view.
    A directory without ``_SUCCESS`` or with an unreadable manifest counts as not published (logged).
    """
    if table is not None:
        location = table.location(date)
        if location is None:
            return None
        location = _spelled_like(output_root, location)
        return _complete(date, location, "table")
    pointer = read_pointer(output_root, date)
    if pointer is not None:
        return _complete(date, run_dir(output_root, date, pointer.run), "pointer") if pointer.run else None
    return _complete(date, view_dir(output_root, date), "path view")


published = find_published


def latest_published(output_root: str, before: dt.date | None = None,
                     table: TableView | None = None) -> PublishedPartition | None:
    """The newest date (strictly before ``before``, if given: the previous night) with a published night."""
    found = recent_published(output_root, 1, before, table)
    return found[0] if found else None


def recent_published(output_root: str, limit: int, before: dt.date | None = None,
                     table: TableView | None = None) -> list[PublishedPartition]:
    """The newest ``limit`` published nights (strictly before ``before``, if given), newest first.

    What the guard's trend reads: the nights the job's readers would see, so a date whose run
    directory or table partition is incomplete is passed over as :func:`find_published` does.
    """
    candidates = table.dates() if table is not None else published_dates(output_root)
    nights: list[PublishedPartition] = []
    for date in sorted((d for d in candidates if before is None or d < before), reverse=True):
        if len(nights) >= limit:
            break
        found = find_published(output_root, date, table)
        if found is not None:
            nights.append(found)
    return nights


def published_dates(output_root: str) -> list[dt.date]:
    """Dates with a pointer or a path view under ``output_root``, oldest first (complete or not)."""
    try:
        fs, root = rfs.resolve(output_root)
    except OSError:
        return []
    dates: set[dt.date] = set()
    for base in (root, rfs.join(root, RUNS_DIR)):
        for path in rfs.list_dirs(fs, base):
            match = _DT_DIR.match(path.rsplit("/", 1)[-1])
            if match:
                try:
                    dates.add(dt.date.fromisoformat(match.group(1)))
                except ValueError:
                    log.warning("ignoring %s: not a date", path)
    return sorted(dates)


def kept_runs(output_root: str, date: dt.date) -> list[str]:
    """Run directories of ``date`` that exist, by run key, oldest first (their keys start with the UTC start time)."""
    fs, root = rfs.resolve(runs_root(output_root, date))
    return sorted(r for r in (run_of(p) for p in rfs.list_dirs(fs, root)) if r)


def is_complete(location: str) -> bool:
    fs, path = rfs.resolve(location)
    return rfs.exists(fs, rfs.join(path, SUCCESS_MARKER)) and rfs.exists(fs, manifest_file.path_in(path))


def _complete(date: dt.date, location: str, source: str) -> PublishedPartition | None:
    manifest = manifest_file.read_at(location)
    return PublishedPartition(date, location, manifest, source) if manifest is not None else None


def _spelled_like(output_root: str, location: str) -> str:
    """A metastore location (``file:/x``, ``s3a://b/k``) spelled like ``paths.output`` spells its root."""
    if location.startswith("file:") and not output_root.startswith("file:"):
        return "/" + location[len("file:"):].lstrip("/")
    return location


def _root_of(location: str, date: dt.date) -> str:
    marker = f"/{RUNS_DIR}/{partition_name(date)}/"
    if marker in location:
        return location.split(marker, 1)[0]
    return location.rstrip("/").rsplit("/", 1)[0]
