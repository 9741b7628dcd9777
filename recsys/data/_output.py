"""Where the generators and importers write, and the one rule they share about existing data.

A dataset directory that already holds date partitions is refused unless the caller asks to
overwrite it: writing a new dataset over an old one replaces only the dates both have in common,
and the leftover partitions (another seed, another source) would silently mix into every later
read. Overwriting removes only ``dt=*`` partition directories under ``events/`` and ``catalog/``,
never anything else the user keeps there.
"""
from __future__ import annotations

import shutil
from pathlib import Path

from recsys.data.contracts import PARTITION_COLUMN
from recsys.errors import InputDataError

EVENTS_DIRNAME = "events"
CATALOG_DIRNAME = "catalog"


def check_dataset_dirs(out: Path, *, overwrite: bool) -> list[Path]:
    """The date partitions under ``out`` that writing would replace; raises unless ``overwrite`` allows it.

    An importer that reads for minutes calls this first, so that a refusal costs nothing, and
    :func:`prepare_dataset_dirs` again when it has everything to write.
    """
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise InputDataError(f"output {out} is a file, not a directory: pass a directory path")
    dirs = (out / EVENTS_DIRNAME, out / CATALOG_DIRNAME)
    existing = [p for d in dirs if d.is_dir() for p in sorted(d.glob(f"{PARTITION_COLUMN}=*"))]
    if existing and not overwrite:
        raise InputDataError(
            f"output {out} already holds {len(existing)} date partitions (e.g. {existing[0]}): "
            "choose an empty directory, or overwrite to replace them"
        )
    return existing


def prepare_dataset_dirs(out: Path, *, overwrite: bool) -> tuple[Path, Path]:
    """Return ``(out/events, out/catalog)``, created and free of partitions from earlier runs."""
    out = Path(out)
    existing = check_dataset_dirs(out, overwrite=overwrite)
    dirs = (out / EVENTS_DIRNAME, out / CATALOG_DIRNAME)
    for part in existing:
        shutil.rmtree(part) if part.is_dir() else part.unlink()
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
    return dirs
