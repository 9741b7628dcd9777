"""The ``dt=YYYY-MM-DD`` partitions of an input, listed on the driver through pyarrow.

No Spark here: the readers list what a run will read before Spark reads it, and the run's record
(:mod:`recsys.tracking.run_notes`) lists the same partitions to describe its inputs.
"""
from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass

import pyarrow.fs as pafs

from recsys import fs as rfs
from recsys.data.contracts import PARTITION_COLUMN
from recsys.errors import InputDataError
from recsys.redaction import redact_uri

_DT_DIR = re.compile(rf"^{PARTITION_COLUMN}=(\d{{4}}-\d{{2}}-\d{{2}})$")


@dataclass(frozen=True)
class Partition:
    date: dt.date
    path: str          # the partition directory, spelled like the configured root (what Spark reads)
    files: list[str]   # its data files, as paths of the filesystem that listed them
    bytes: int = 0     # their total size, as listed (0 until :func:`with_files` lists them)


def list_partitions(root: str, name: str) -> tuple[pafs.FileSystem, list[Partition]]:
    """The ``dt=YYYY-MM-DD`` partitions under ``root``, oldest first, without their files (listed lazily)."""
    fs, base = rfs.resolve(root)
    info = fs.get_file_info(base)
    if info.type == pafs.FileType.NotFound:
        raise InputDataError(f"{name} path {redact_uri(root)!r} does not exist; check paths.{name} in the configuration")
    if info.type != pafs.FileType.Directory:
        raise InputDataError(f"{name} path {redact_uri(root)!r} is not a directory; expected {name}/dt=YYYY-MM-DD/*.parquet")
    parts = []
    for entry in fs.get_file_info(pafs.FileSelector(base)):
        match = _DT_DIR.match(entry.base_name)
        if entry.type == pafs.FileType.Directory and match:
            try:
                date = dt.date.fromisoformat(match.group(1))
            except ValueError:
                raise InputDataError(f"{name} partition {entry.path!r} is not a valid date; rename or remove it") from None
            parts.append(Partition(date, rfs.join(root, entry.base_name), []))
    return fs, sorted(parts, key=lambda p: p.date)


def with_files(fs: pafs.FileSystem, part: Partition) -> Partition:
    """The partition with its data files and their total size (names starting with ``_`` or ``.`` are markers,
    not data)."""
    _, base = rfs.resolve(part.path)
    infos = [i for i in fs.get_file_info(pafs.FileSelector(base, recursive=True))
             if i.type == pafs.FileType.File and not _hidden(i.path, base)]
    return Partition(part.date, part.path, sorted(i.path for i in infos), sum(i.size or 0 for i in infos))


def _hidden(path: str, base: str) -> bool:
    return any(p.startswith(("_", ".")) for p in path[len(base):].split("/") if p)
