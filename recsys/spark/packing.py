"""The Python environment travels with the job: a relocatable archive of this virtualenv, built once.

On a cluster the executors do not have the driver's Python environment (torch, pyarrow, numpy,
pyspark ...). ``./spark-submit.sh --pack`` ships this project's virtualenv as an archive with
``--archives ARCHIVE#environment`` and runs the executors' Python workers with
``./environment/bin/python`` (see docs/cluster.md). The archive is built with ``venv-pack``
(docs/cluster.md says why it and not conda-pack or PEX) and cached under a name keyed by a digest of
the environment: the interpreter's version and every installed distribution with its version, so a
rebuilt or upgraded environment gets a new archive and an unchanged one is never packed twice.

What is left out, on purpose: the ``recsys`` package itself (it travels with ``--py-files``, so a
code change needs no repacking, and an editable install cannot be packed), ``pyspark/jars`` (the
executors' JVM runs the cluster's own Spark; the Python workers need only pyspark's Python code),
torch's C++ headers and the packages' own ``tests`` directories: a third of the files, which every
executor (and, in client mode, the driver) unpacks and deletes again on every submit.

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


def environment_digest(prefix: Path | None = None) -> str:
    """A digest of what the archive would hold: the interpreter and every distribution's name and version."""
    prefix = Path(prefix or sys.prefix)
    lib = next((prefix / "lib").glob("python*/site-packages"), None)
    if lib is None:
        raise ConfigError(f"{prefix} holds no lib/python*/site-packages; pack a virtualenv (make venv creates .venv)")
    dists = sorted(
        f"{d.metadata['Name'].lower()}=={d.version}"
        for d in importlib.metadata.distributions(path=[str(lib)])
        if d.metadata["Name"] and d.metadata["Name"].lower() != PROJECT
    )
    h = hashlib.sha256()
    for part in (platform.python_version(), platform.machine(), sys.platform, os.path.realpath(prefix / "bin" / "python"),
                 *EXCLUDE, *dists):
        h.update(part.encode() + b"\n")
    return h.hexdigest()[:16]


def build(cache_dir: Path, prefix: Path | None = None, *, python_prefix: str | None = None,
          compress_level: int = 1) -> Path:
    """The archive of ``prefix`` (default: this interpreter's virtualenv), built unless already cached.

    Written under a temporary name and renamed, with a ``.sha256`` beside it, so a killed build never
    leaves an archive that looks complete.
    """
    prefix = Path(prefix or sys.prefix)
    if prefix == Path(sys.base_prefix):
        raise ConfigError(f"{sys.executable} is not in a virtualenv; run 'make venv' and use .venv/bin/python")
    digest = environment_digest(prefix)
    if python_prefix:
        digest = hashlib.sha256(f"{digest}:{python_prefix}".encode()).hexdigest()[:16]
    cache_dir = Path(cache_dir)
    archive = cache_dir / f"{PROJECT}-env-{digest}.tar.gz"
    if archive.is_file() and _sidecar(archive).is_file():
        _say(f"using {archive} (built before for this environment)")
        return archive
    try:
        import venv_pack
    except ImportError:
        raise ConfigError("venv-pack is not installed; pip install venv-pack (it is in the dev extras: "
                          "pip install -e '.[dev]')") from None
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = cache_dir / f".{archive.name}.{os.getpid()}.tmp.tar.gz"
    started = time.monotonic()
    _say(f"packing {prefix} into {archive} (once per environment: a minute or a few)")
    try:
        venv_pack.pack(prefix=str(prefix), output=str(tmp), format="tar.gz", force=True, compress_level=compress_level,
                       python_prefix=python_prefix, filters=[("exclude", p) for p in EXCLUDE])
        _sidecar(tmp).write_text(_sha256(tmp) + "\n")
        tmp.rename(archive)
        _sidecar(tmp).rename(_sidecar(archive))
        _say(f"packed {archive.stat().st_size / 2**20:,.0f} MiB in {time.monotonic() - started:.0f} s")
        for old in cache_dir.glob(f"{PROJECT}-env-*.tar.gz"):   # archives of environments that are gone
            if old != archive:
                old.unlink(missing_ok=True)
                _sidecar(old).unlink(missing_ok=True)
    finally:
        tmp.unlink(missing_ok=True)
        _sidecar(tmp).unlink(missing_ok=True)
    return archive


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
    parser.add_argument("--cache-dir", default=os.path.join(".recsys", "pack"),
                        help="where archives are cached (default: .recsys/pack)")
    parser.add_argument("--archive", help="check and use this archive instead of building one")
    parser.add_argument("--python-prefix", help="link the archive's python to this interpreter prefix (e.g. /usr) "
                                                "when the executors' interpreter lives elsewhere than the driver's")
    parser.add_argument("--compress-level", type=int, default=1, choices=range(10), metavar="0-9")
    args = parser.parse_args(argv)
    try:
        if args.archive:
            path = check(Path(args.archive))
        else:
            path = check(build(Path(args.cache_dir), python_prefix=args.python_prefix,
                               compress_level=args.compress_level))
    except ConfigError as exc:
        print(f"recsys pack: {exc}", file=sys.stderr)
        return int(ExitCode.BAD_INPUT)
    print(path.resolve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
