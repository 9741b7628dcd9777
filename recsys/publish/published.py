"""What is published: the one lookup of a date's published partition, its data files and its manifest.

Every reader of the published lists asks here (``recsys export``, the embedded index of ``recsys serve``),
so that where a date's published data lives (today ``paths.output/dt=D/``, with ``_SUCCESS`` and
``_manifest.json``) is decided in one place. A partition counts as published exactly when
:func:`recsys.publish.manifest.read` says so (complete: ``_SUCCESS`` and a readable manifest).
"""
from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

from recsys import fs as rfs
from recsys.data.contracts import SOURCE_MODEL, partition_name
from recsys.data.partitions import Partition, list_partitions, with_files
from recsys.errors import InputDataError
from recsys.publish import manifest as manifest_file


@dataclass(frozen=True)
class PublishedPartition:
    """A date's published partition as its readers need it."""

    date: dt.date
    path: str                         # the partition directory, spelled like paths.output
    manifest: dict[str, Any]

    @property
    def run(self) -> str:
        """The attempt that published it (``job_run``): unique per run, also when MLflow was down."""
        return str(self.manifest.get("job_run") or self.manifest.get("run_id") or "")

    @property
    def run_id(self) -> str | None:
        """Its MLflow run, if it was recorded."""
        return self.manifest.get("run_id")

    @property
    def model_version(self) -> str:
        return str((self.manifest.get("model") or {}).get("version", ""))

    @property
    def rows(self) -> int | None:
        rows = (self.manifest.get("counts") or {}).get("rows")
        return int(rows) if rows is not None else None

    @property
    def catalog_snapshot(self) -> str:
        return str(self.manifest.get("catalog_snapshot", ""))

    @property
    def fallback(self) -> dict[str, Any] | None:
        """``{"name", "item_ids", "scores"}``: the list users the model could not score got (None in manifests
        written before it was recorded there)."""
        return self.manifest.get("fallback")

    @property
    def sources(self) -> list[str]:
        """The values the rows' ``source`` column can hold: ``model``, then the fallback's name."""
        fallback = (self.fallback or {}).get("name") or "popularity"
        return [SOURCE_MODEL, fallback] if fallback != SOURCE_MODEL else [SOURCE_MODEL]

    def refusal(self) -> str | None:
        """Why this partition must not be served (None: it may): its manifest records failed checks."""
        failed = {k: v for k, v in (self.manifest.get("validation") or {}).items() if v}
        if failed:
            return (f"the partition for {self.date} records failed validation checks {failed} in its manifest; "
                    f"rerun `recsys recommend --date {self.date} --force` once the input is fixed")
        return None

    def files(self) -> list[str]:
        """Its data files (``part-*``), as URIs spelled like ``paths.output``, sorted: what an executor opens."""
        fs, base = rfs.resolve(self.path)
        found = with_files(fs, Partition(self.date, self.path, [])).files
        return [rfs.join(self.path, f[len(base):].lstrip("/")) for f in found]


def find_published(output_root: str, date: dt.date) -> PublishedPartition | None:
    """The published partition of ``date`` under ``output_root``, or None if nothing complete is published."""
    manifest = manifest_file.read(output_root, date)
    if manifest is None:
        return None
    return PublishedPartition(date, rfs.join(output_root, partition_name(date)), manifest)


def latest_published(output_root: str) -> PublishedPartition | None:
    """The newest date with a complete published partition, or None (also when ``output_root`` does not exist)."""
    try:
        _, parts = list_partitions(output_root, "output")
    except InputDataError:
        return None
    for part in reversed(parts):
        found = find_published(output_root, part.date)
        if found is not None:
            return found
    return None

