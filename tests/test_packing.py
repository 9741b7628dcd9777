"""The packed environment: its cache key, and refusing archives that cannot work before submitting."""
from __future__ import annotations

import tarfile

import pytest

from recsys.spark import packing
from recsys.errors import ConfigError


def test_the_environment_digest_is_stable_and_covers_the_installed_distributions(tmp_path):
    assert packing.environment_digest() == packing.environment_digest()   # this venv: the same key every call
    venv = tmp_path / "venv"
    site = venv / "lib" / "python3.11" / "site-packages"

    def install(name: str, version: str) -> None:
        dist = site / f"{name}-{version}.dist-info"
        for old in site.glob(f"{name}-*.dist-info"):
            (old / "METADATA").unlink()
            old.rmdir()
        dist.mkdir(parents=True)
        (dist / "METADATA").write_text(f"Name: {name}\nVersion: {version}\n")

    install("torch", "2.0")
    before = packing.environment_digest(venv)
    assert packing.environment_digest(venv) == before                   # unchanged: the cached archive is reused
    install("torch", "2.1")
    upgraded = packing.environment_digest(venv)
    assert upgraded != before                                           # an upgrade packs a new archive
    install("numpy", "1.26")
    added = packing.environment_digest(venv)
    assert added not in (before, upgraded)                              # so does a newly installed distribution
    install("recsys", "0.1")
    assert packing.environment_digest(venv) == added    # the project itself travels with --py-files, not in the archive
    install("recsys", "0.2")
    assert packing.environment_digest(venv) == added    # so a new version of it packs nothing


def test_a_missing_archive_is_refused_naming_it(tmp_path):
    with pytest.raises(ConfigError, match=r"no-env.tar.gz.*does not exist"):
        packing.check(tmp_path / "no-env.tar.gz")


def test_an_archive_that_is_not_a_packed_venv_is_refused(tmp_path):
    garbage = tmp_path / "env.tar.gz"
    garbage.write_bytes(b"\x1f\x8b\x08\x00" + b"not really gzip" * 100)
    with pytest.raises(ConfigError, match="not a readable tar archive"):
        packing.check(garbage)
    empty = tmp_path / "empty.tar.gz"
    with tarfile.open(empty, "w:gz") as tar:
        (tmp_path / "x").write_text("x")
        tar.add(tmp_path / "x", arcname="lib/x")
    with pytest.raises(ConfigError, match="holds no bin/python"):
        packing.check(empty)


def test_a_cached_archive_that_changed_is_refused(tmp_path):
    archive = tmp_path / "recsys-env-x.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        (tmp_path / "python").write_text("#!")
        tar.add(tmp_path / "python", arcname="bin/python")
    (tmp_path / "recsys-env-x.tar.gz.sha256").write_text(packing._sha256(archive) + "\n")
    assert packing.check(archive) == archive
    with archive.open("r+b") as f:
        f.seek(20)
        f.write(b"\0\0\0\0")
    with pytest.raises(ConfigError, match="is corrupt"):
        packing.check(archive)


def test_the_command_prints_one_line_and_exits_2_for_a_bad_archive(tmp_path, capsys):
    assert packing.main(["--archive", str(tmp_path / "missing.tar.gz")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("recsys pack: ")
