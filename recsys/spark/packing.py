"""The Python environment travels with the job: a relocatable archive of this virtualenv, built once.

On a cluster the executors do not have the driver's Python environment (torch, pyarrow, numpy,
pyspark ...). ``./spark-submit.sh --pack`` ships this project's virtualenv as an archive with
``--archives ARCHIVE#environment`` and runs the executors' Python workers with
``./environment/bin/python`` (see docs/cluster.md). The archive is built with ``venv-pack``
(docs/cluster.md says why it and not conda-pack or PEX) and cached under a name keyed by a digest of
what the archive holds: the interpreter it links to and every installed distribution with its version
and the hashes of its files (from the distribution's ``RECORD``), so a rebuilt, upgraded or patched
environment gets a new archive and an unchanged one is never packed twice. Nothing in the digest
depends on where the virtualenv lives, so the cache (``~/.cache/recsys/pack`` by default) serves
every checkout of the project on the machine: a fresh clone with the same environment reuses it.

What is left out, on purpose: the ``recsys`` package itself (it travels with ``--py-files``, so a
code change needs no repacking, and an editable install cannot be packed), ``pyspark/jars`` (the
executors' JVM runs the cluster's own Spark; the Python workers need only pyspark's Python code),
torch's C++ headers and the packages' own ``tests`` directories; and every distribution the executors
never import (:func:`executor_distributions`): the project's requirements but ``DRIVER_ONLY`` (MLflow
and matplotlib: tracking, registry and plots happen on the driver) and what they require, and whatever
else the virtualenv holds for the driver, the service or the tests (boto3, fastapi, moto, pytest ...).
Every executor (and, in client mode, the driver) unpacks the archive on every submit, so what is left
out is time saved every night (docs/cluster.md has the sizes). A driver that runs from the archive too
(``--deploy-mode cluster`` on YARN or Kubernetes) needs MLflow and the rest: ``whole`` packs everything but
``EXCLUDE``, under a digest of its own (``spark-submit.sh`` asks for it when the deploy mode is cluster).

venv-pack does not include the interpreter: the archive's ``bin/python`` is a link to the base
interpreter the virtualenv was made from, which must exist at the same path on every executor (or
at ``--python-prefix``). Run as ``python -m recsys.spark.packing``: prints the archive's path on stdout,
or one line on stderr and exit code 2 when the archive cannot be built or is unusable.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import os
import platform
import re
import sys
import tarfile
import time
import zlib
from pathlib import Path

from recsys.errors import ConfigError, ExitCode

PROJECT = "recsys"
ARCHIVE_ALIAS = "environment"          # --archives ARCHIVE#environment -> ./environment/bin/python
# Left out of the archive (venv-pack glob patterns, relative to the environment's root).
EXCLUDE = (
    "lib/python*/site-packages/__editable__*",      # the editable hook of this project
    f"lib/python*/site-packages/{PROJECT}-*.dist-info/*",
    "lib/python*/site-packages/pyspark/jars/*",     # the cluster's JVM brings its own Spark
    "lib/python*/site-packages/torch/include/*",    # C++ headers, for building extensions only
    "lib/python*/site-packages/*/tests/*",          # the packages' own test suites
    "bin/activate*",
)


# The project's requirements that no executor imports: the executors run the scoring and export tasks, the
# training processes and pyspark's Python worker (tests/test_packing.py imports them with these blocked and scans
# every import in recsys for a third-party module that is neither shipped nor known to stay on the driver).
DRIVER_ONLY = ("mlflow", "matplotlib")

KEEP_ARCHIVES = 3      # archives kept in the cache: the most recently used (checkouts on other branches share it)
DIGEST_FORMAT = "3"    # bumped when what the digest covers changes, so no archive is reused under another meaning


def default_cache_dir() -> Path:
    """Where archives are kept unless told: ``$RECSYS_PACK_CACHE``, else ``$XDG_CACHE_HOME/recsys/pack``
    (``~/.cache/recsys/pack``). Outside the checkout, so every clone on the machine shares one archive."""
    from recsys.config import pack_cache_dir

    return pack_cache_dir()


def environment_digest(prefix: Path | None = None, *, whole: bool = False) -> str:
    """A digest of what the archive would hold, and of nothing else: the interpreter the archive's
    ``bin/python`` links to (its version and path), the platform, the files left out, and every
    distribution but the project's own by name, version and the hashes its ``RECORD`` lists for the
    files inside ``site-packages``. Not the virtualenv's own path: its scripts' ``#!`` lines name it
    (``RECORD`` lists them as ``../../../bin/...``), and venv-pack rewrites those lines anyway."""
    prefix = Path(prefix or sys.prefix)
    lib = _site_packages(prefix)
    if lib is None:
        raise ConfigError(f"{prefix} holds no lib/python*/site-packages; pack a virtualenv (make venv creates .venv)")
    dists = sorted(
        f"{d.metadata['Name'].lower()}=={d.version} {_content_digest(d)}"
        for d in importlib.metadata.distributions(path=[str(lib)])
        if d.metadata["Name"] and d.metadata["Name"].lower() != PROJECT
    )
    h = hashlib.sha256()
    for part in (DIGEST_FORMAT, platform.python_version(), platform.machine(), sys.platform,
                 os.path.realpath(prefix / "bin" / "python"), *exclude_patterns(prefix, whole=whole), *dists):
        h.update(part.encode() + b"\n")
    return h.hexdigest()[:16]


def _site_packages(prefix: Path) -> Path | None:
    return next((Path(prefix) / "lib").glob("python*/site-packages"), None)


def _name(name: str) -> str:
    """A distribution's name as packaging normalises it (PEP 503): ``PyYAML`` and ``pyyaml`` are one."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirements(dist: importlib.metadata.Distribution) -> list[str]:
    """The names ``dist`` requires when installed without extras, its environment markers evaluated here."""
    from packaging.requirements import InvalidRequirement, Requirement

    names = []
    for line in dist.requires or []:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            names.append(_name(req.name))
    return names


def executor_distributions(prefix: Path | None = None) -> set[str] | None:
    """The distributions the executors need: the project's requirements but ``DRIVER_ONLY``, and everything
    those require (without extras), by normalised name. None when the virtualenv does not have the project
    installed (nothing says what the executors need, so nothing is left out)."""
    lib = _site_packages(Path(prefix or sys.prefix))
    if lib is None:
        return None
    dists = {_name(d.metadata["Name"]): d for d in importlib.metadata.distributions(path=[str(lib)])
             if d.metadata["Name"]}
    if PROJECT not in dists:
        return None
    keep: set[str] = set()
    stack = [name for name in _requirements(dists[PROJECT]) if name not in DRIVER_ONLY]
    while stack:
        name = stack.pop()
        if name in keep or name not in dists:
            continue
        keep.add(name)
        stack.extend(_requirements(dists[name]))
    return keep


def exclude_patterns(prefix: Path | None = None, *, whole: bool = False) -> list[str]:
    """``EXCLUDE`` and one pattern for each top-level file or directory of ``site-packages`` that only
    distributions the executors do not need own (by their ``RECORD``): a directory two distributions share
    (a namespace package) stays if either is needed, and a distribution without a ``RECORD`` stays whole.
    ``whole``: ``EXCLUDE`` only, for a driver that runs from the archive too."""
    prefix = Path(prefix or sys.prefix)
    if whole:
        return list(EXCLUDE)
    keep, lib = executor_distributions(prefix), _site_packages(prefix)
    if keep is None or lib is None:
        return list(EXCLUDE)
    owned: dict[str, set[bool]] = {}
    for dist in importlib.metadata.distributions(path=[str(lib)]):
        name = _name(dist.metadata["Name"] or "")
        if not name or name == PROJECT:
            continue
        record = dist.read_text("RECORD")
        if record is None:
            continue
        for line in record.splitlines():
            path = line.split(",", 1)[0]
            if path and not path.startswith(("../", "/")):
                top, _, rest = path.partition("/")
                owned.setdefault(top + ("/" if rest else ""), set()).add(name in keep)
    dropped = sorted(top for top, needed in owned.items() if True not in needed)
    return [*EXCLUDE, *(f"lib/python*/site-packages/{top}*" if top.endswith("/") else
                        f"lib/python*/site-packages/{top}" for top in dropped)]


def _content_digest(dist: importlib.metadata.Distribution) -> str:
    """The distribution's files as its ``RECORD`` lists them (path, hash, size), those under site-packages
    only; without a ``RECORD`` (installers that write none), its ``METADATA``."""
    record = dist.read_text("RECORD")
    if record is None:
        return hashlib.sha256((dist.read_text("METADATA") or "").encode()).hexdigest()[:16]
    lines = sorted(line for line in record.splitlines() if line.strip() and not line.startswith("../"))
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


def build(cache_dir: Path, prefix: Path | None = None, *, python_prefix: str | None = None,
          compress_level: int = 1, whole: bool = False) -> Path:
    """The archive of ``prefix`` (default: this interpreter's virtualenv), built unless already cached: what the
    executors import, or with ``whole`` everything the driver imports too.

    Written under a temporary name and renamed, with a ``.sha256`` beside it, so a killed build never
    leaves an archive that looks complete.
    """
    prefix = Path(prefix or sys.prefix)
    if prefix == Path(sys.base_prefix):
        raise ConfigError(f"{sys.executable} is not in a virtualenv; run 'make venv' and use .venv/bin/python")
    digest = environment_digest(prefix, whole=whole)
    if python_prefix:
        digest = hashlib.sha256(f"{digest}:{python_prefix}".encode()).hexdigest()[:16]
    cache_dir = Path(cache_dir)
    archive = cache_dir / f"{PROJECT}-env-{digest}.tar.gz"
    if archive.is_file() and _sidecar(archive).is_file():
        _say(f"using {archive} (built before for this environment)")
        os.utime(archive)                 # most recently used: the last the cache gives up
        return archive
    try:
        import venv_pack
    except ImportError:
        raise ConfigError("venv-pack is not installed; pip install venv-pack (it is in the dev extras: "
                          "pip install -e '.[dev]')") from None
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = cache_dir / f".{archive.name}.{os.getpid()}.tmp.tar.gz"
    started = time.monotonic()
    what = "the whole environment, for a driver that runs from it" if whole else "what the executors import"
    _say(f"packing {prefix} into {archive} ({what}; once per environment: a minute or a few)")
    try:
        venv_pack.pack(prefix=str(prefix), output=str(tmp), format="tar.gz", force=True, compress_level=compress_level,
                       python_prefix=python_prefix,
                       filters=[("exclude", p) for p in exclude_patterns(prefix, whole=whole)])
        _sidecar(tmp).write_text(_sha256(tmp) + "\n")
        tmp.rename(archive)
        _sidecar(tmp).rename(_sidecar(archive))
        _say(f"packed {archive.stat().st_size / 2**20:,.0f} MiB in {time.monotonic() - started:.0f} s")
        _prune(cache_dir, keep=archive)
    finally:
        tmp.unlink(missing_ok=True)
        _sidecar(tmp).unlink(missing_ok=True)
    return archive


def _prune(cache_dir: Path, keep: Path) -> None:
    """Remove all but the ``KEEP_ARCHIVES`` most recently used archives (``keep`` always stays): checkouts
    of other branches, with environments of their own, share the cache and would otherwise repack in turn."""
    def used(path: Path) -> float:
        try:
            return path.stat().st_mtime
        except OSError:
            return 0.0

    others = sorted((p for p in cache_dir.glob(f"{PROJECT}-env-*.tar.gz") if p != keep), key=used, reverse=True)
    for old in others[KEEP_ARCHIVES - 1:]:
        old.unlink(missing_ok=True)
        _sidecar(old).unlink(missing_ok=True)


def check(archive: Path) -> Path:
    """Refuse a missing or corrupt archive before anything is submitted: one line naming the file.

    An archive built here has a ``.sha256`` beside it and is checked against it; any other archive
    is read through once (gzip and tar both verify as they go) and must hold ``bin/python``.
    """
    archive = Path(archive)
    if not archive.is_file():
        raise ConfigError(f"packed environment {str(archive)!r} does not exist; build it with "
                          "'./spark-submit.sh --pack ...' (or python -m recsys.spark.packing) or give an existing archive")
    sidecar = _sidecar(archive)
    if sidecar.is_file():
        expected = sidecar.read_text().split()[0] if sidecar.read_text().strip() else ""
        if _sha256(archive) != expected:
            raise ConfigError(f"packed environment {str(archive)!r} is corrupt (its sha256 differs from {sidecar.name}); "
                              "delete both files and rerun with --pack to rebuild it")
        return archive
    try:
        with tarfile.open(archive, "r:*") as tar:
            names = {m.name.lstrip("./") for m in tar}
    except (tarfile.TarError, OSError, EOFError, zlib.error) as exc:
        reason = " ".join(str(exc).split()) or type(exc).__name__     # one line, whatever tarfile says
        raise ConfigError(f"packed environment {str(archive)!r} is not a readable tar archive ({reason}); rebuild it "
                          "with './spark-submit.sh --pack ...'") from None
    if "bin/python" not in names:
        raise ConfigError(f"packed environment {str(archive)!r} holds no bin/python; it is not a packed virtualenv "
                          "(build one with './spark-submit.sh --pack ...')")
    return archive


def _say(text: str) -> None:
    """Progress for whoever runs spark-submit.sh: stderr, since stdout carries the archive's path."""
    print(f"recsys pack: {text}", file=sys.stderr, flush=True)


def _sidecar(archive: Path) -> Path:
    return archive.with_name(archive.name + ".sha256")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m recsys.spark.packing", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache-dir", help="where archives are cached (default: $RECSYS_PACK_CACHE, else "
                                            "~/.cache/recsys/pack, shared by every checkout on the machine)")
    parser.add_argument("--archive", help="check and use this archive instead of building one")
    parser.add_argument("--python-prefix", help="link the archive's python to this interpreter prefix (e.g. /usr) "
                                                "when the executors' interpreter lives elsewhere than the driver's")
    parser.add_argument("--compress-level", type=int, default=1, choices=range(10), metavar="0-9")
    parser.add_argument("--whole", action="store_true",
                        help="pack the whole environment, MLflow and the driver's packages too: for a driver that "
                             "runs from the archive (--deploy-mode cluster); default: what the executors import")
    args = parser.parse_args(argv)
    try:
        if args.archive:
            path = check(Path(args.archive))
        else:
            cache_dir = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
            path = check(build(cache_dir, python_prefix=args.python_prefix, compress_level=args.compress_level,
                               whole=args.whole))
    except ConfigError as exc:
        print(f"recsys pack: {exc}", file=sys.stderr)
        return int(ExitCode.BAD_INPUT)
    print(path.resolve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
