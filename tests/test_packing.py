"""The packed environment: its cache key, and refusing archives that cannot work before submitting."""
from __future__ import annotations

import os
import sys
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


def test_the_digest_follows_the_files_content_and_not_where_the_virtualenv_lives(tmp_path):
    """Two clones' virtualenvs with the same distributions share one archive; a distribution whose files
    changed under the same version (a patched or rebuilt wheel) gets a new one."""
    def venv(at: str, module_hash: str, script_hash: str = "sha256=s1") -> str:
        dist = tmp_path / at / "lib" / "python3.11" / "site-packages" / "torch-2.0.dist-info"
        dist.mkdir(parents=True, exist_ok=True)
        python = tmp_path / at / "bin" / "python"             # as `python -m venv` makes it: a link to the base
        if not python.is_symlink():
            python.parent.mkdir(exist_ok=True)
            python.symlink_to(os.path.realpath(sys.executable))
        (dist / "METADATA").write_text("Name: torch\nVersion: 2.0\n")
        (dist / "RECORD").write_text(f"torch/__init__.py,{module_hash},120\n"
                                     f"../../../bin/torchrun,{script_hash},230\n"      # its #! line names the venv
                                     "torch-2.0.dist-info/RECORD,,\n")
        return packing.environment_digest(tmp_path / at)

    first = venv("clone-a/.venv", "sha256=m1")
    assert venv("elsewhere/clone-b/.venv", "sha256=m1", script_hash="sha256=s2") == first
    assert venv("clone-a/.venv", "sha256=m2") != first


def test_the_cache_is_outside_the_checkout_and_keeps_the_most_recently_used_archives(tmp_path, monkeypatch):
    monkeypatch.delenv("RECSYS_PACK_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert packing.default_cache_dir() == tmp_path / "xdg" / "recsys" / "pack"
    monkeypatch.setenv("RECSYS_PACK_CACHE", str(tmp_path / "mine"))
    assert packing.default_cache_dir() == tmp_path / "mine"

    cache = tmp_path / "cache"
    cache.mkdir()
    archives = []
    for age, name in enumerate("abcde"):           # a: the newest use, e: the oldest
        archive = cache / f"recsys-env-{name}.tar.gz"
        archive.write_bytes(b"x")
        (cache / f"{archive.name}.sha256").write_text("x\n")
        os.utime(archive, (1_000_000 - age, 1_000_000 - age))
        archives.append(archive)
    packing._prune(cache, keep=archives[-1])       # the one just built stays, whatever its time
    left = sorted(p.name for p in cache.iterdir())
    assert left == sorted([f"recsys-env-{n}.tar.gz{s}" for n in "abe" for s in ("", ".sha256")])


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
