"""The model travels to the executors through Spark, never through a driver path.

On a cluster the executors share nothing with the driver but the data stores: they cannot read the
directory the driver downloaded the model into, and they do not talk to MLflow. So the driver
resolves and downloads the model once, then hands its files to Spark's own distribution:
``SparkContext.addFile`` on a classic session, ``SparkSession.addArtifacts(..., file=True)`` over
Spark Connect (which has no SparkContext). :func:`ship_model` hides that difference. Each file is
added under a name that starts with the digest of the model's files, so two model versions never
collide in Spark's flat file namespace, and the same version added twice (a backfill) is one file.

On the worker, :func:`fetch_model` finds the files with ``SparkFiles.get`` (the executor fetched them
from the driver before running the task), checks their digest against the one the driver minted,
and lays them out as a model directory under the executor's own file root. The worker cache is keyed
by model version plus that digest (:attr:`ShippedModel.cache_key`), so new files under an old version
number can never be served from the cache.
"""
from __future__ import annotations

import logging
import os
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path

from recsys.fs import files_digest

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShippedModel:
    """What a task needs to find the model files Spark delivered: small, so it rides in the closure."""

    name: str                          # registered model name, for messages
    version: str
    digest: str                        # sha256 over the files' names and bytes (first 16 hex chars)
    files: tuple[tuple[str, str], ...]  # (name Spark knows the file by, name inside the model directory)

    @property
    def cache_key(self) -> str:
        """The worker cache key: version plus digest of the files, never a path."""
        return f"{self.name}/{self.version}#{self.digest}"


def model_files_digest(directory: Path) -> str:
    """Digest of a flat model directory: every regular file's name and bytes, in name order."""
    return files_digest(directory)


def ship_model(spark, model_dir: Path, *, name: str, version: str, scratch: Path) -> ShippedModel:
    """Hand the files of ``model_dir`` (a driver-local directory) to Spark for every executor.

    The files are first linked (or copied) into ``scratch/ship/<digest>/`` under digest-prefixed names:
    Spark identifies an added file by its base name, and refuses a second file of the same name.
    """
    model_dir = Path(model_dir)
    digest = model_files_digest(model_dir)
    outbox = Path(scratch) / "ship" / digest
    outbox.mkdir(parents=True, exist_ok=True)
    files = []
    for path in sorted(p for p in model_dir.iterdir() if p.is_file()):
        shipped = outbox / f"recsys-model-{digest}-{path.name}"
        if not shipped.exists():
            _link_or_copy(path, shipped)
        files.append((shipped.name, path.name))
    add_files(spark, [outbox / shipped for shipped, _ in files])
    return ShippedModel(name=name, version=version, digest=digest, files=tuple(files))


_added: dict[int, set[str]] = {}
_added_lock = threading.Lock()


def add_files(spark, paths: list[Path]) -> None:
    """Distribute driver-local files to every executor: ``addFile`` (classic) or ``addArtifacts`` (Connect).

    Spark knows an added file by its base name only; a name already added to this session is skipped
    (the names carry the content's digest, so the same name is the same bytes): Spark Connect refuses
    to add an artifact twice, and a cluster's file server refuses one name from two paths.
    """
    from recsys.spark.session import is_connect

    connect = is_connect(spark)
    with _added_lock:
        done = _added.setdefault(id(spark), set())
        todo = [Path(p) for p in paths if Path(p).name not in done]
        if not todo:
            return
        if connect:
            spark.addArtifacts(*(str(p) for p in todo), file=True)
        else:
            for path in todo:
                spark.sparkContext.addFile(str(path))
        done.update(p.name for p in todo)


def fetch_model(model: ShippedModel) -> Path:
    """On a worker: the shipped files as a model directory, checked against the driver's digest.

    Raises RuntimeError naming the model and both digests if the files Spark delivered differ from
    what the driver shipped (a corrupted transfer, or a stale file under the same name).
    """
    from pyspark import SparkFiles

    root = Path(SparkFiles.getRootDirectory())
    target = root / f"recsys-model-{model.digest}"
    if target.is_dir():
        return target
    staging = root / f".recsys-model-{model.digest}-{os.getpid()}-{threading.get_ident()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for shipped, original in model.files:
        source = Path(SparkFiles.get(shipped))
        if not source.is_file():
            raise RuntimeError(f"model file {shipped!r} of {model.cache_key} was not delivered to this executor "
                               f"(looked in {root}); the driver must ship it with recsys.scoring.shipping.ship_model")
        _link_or_copy(source, staging / original)
    found = model_files_digest(staging)
    if found != model.digest:
        shutil.rmtree(staging, ignore_errors=True)
        raise RuntimeError(f"the model files of {model.cache_key} arrived with digest {found}, expected "
                           f"{model.digest}; rerun the job (the transfer was corrupted or a stale file was served)")
    try:
        staging.rename(target)
    except OSError:          # another Python worker of this executor got there first: same files
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _link_or_copy(source: Path, target: Path) -> None:
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)
